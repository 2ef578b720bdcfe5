"""Processes and jobs: the schedule that packs jobs onto the machine's cores (`schedule`) and the
one place every launcher is stopped from (`processes`: signals, `terminate_all`).

Layer 5: imports nothing of crosscheck above `crosscheck.exit_codes`; the launchers themselves
live with their reference package (``torch_impl.harness``, ``jax_impl.harness``).
"""
