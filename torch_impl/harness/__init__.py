"""What runs the torch reference rather than what it is: the launch of rank processes
(`launcher`, its rank side `rank_worker` and command line `rank_main`; the processes themselves,
their zygote and their stopping are `crosscheck.launch`'s, as for JAX's workers), the per-rank
case loop (`cases`, on the `jobs` every rank is handed), a user's step under watch
(`user_step`, `step_gradient`) and the buggy loops of the bug catalogue (`bugs`,
`bugs_windows`, `windows`).

The reference modules never import it; ``torch_impl`` re-exports `launch` and its two errors
for convenience.
"""
