"""Processes and jobs: the schedule that packs jobs onto the machine's cores (`schedule`), the
one module every runner starts its worker processes through (`workers`: JAX workers and their
zygote, torch launches per world size) and the one place every launcher is stopped from
(`processes`: signals, `terminate_all`).

Layer 5: imports `crosscheck.exit_codes`, `crosscheck.contract` and `crosscheck.fixtures` only;
the launchers themselves live with their reference package (``torch_impl.harness``,
``jax_impl.harness``), and torch and JAX are imported only when something is launched.
"""
