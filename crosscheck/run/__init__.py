"""`crosscheck run`: the matrix of implementations x fixtures x schemes x layouts, its plan,
rows, resume cases, and one driver per framework (`torch_runner`, `jax_runner` with its
`jax_worker` and `jax_resume`).

Layer 6: imports the layers below it.
"""
