"""Processes and jobs. The process layer, one for torch and JAX alike and the standard library
only: how a worker process starts (`worker_processes`: ``python -m MODULE``, its own process
group, output in files, `run_workers` with every wait bounded), the one fork server (`zygote`,
`zygote_server`: one per preload list, torch's ranks and JAX's workers), and the one registry
of process groups with its terminator (`processes`: `terminate_all`, signals). Above it: the
schedule that packs jobs onto the machine's cores (`schedule`) and what the runners launch
through (`workers`: a JAX worker's environment and job, a torch launch per world size).

Layer 5: imports `crosscheck.exit_codes`, `crosscheck.contract` and `crosscheck.fixtures` only.
The torch and JAX harnesses (``torch_impl.harness``, ``jax_impl.harness``) start their
processes through the process layer; torch and JAX are imported only when something is
launched.
"""
