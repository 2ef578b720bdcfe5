"""What runs the torch reference rather than what it is: rank processes and their fork server
(`launcher`, `rank_processes`), the per-rank case loop (`cases`), a user's step under watch
(`user_step`, `step_watch`) and the buggy loops of the bug catalogue.

The reference modules never import it; ``torch_impl`` re-exports `launch` and its two errors
for convenience.
"""
