"""What runs the JAX reference rather than what it is: worker processes (`launch`), the
zygote that forks them with JAX imported once, the ``jax.distributed`` multi-process
launcher, and the buggy steps of the bug catalogue.

Nothing in `jax_impl` outside this package imports it: the reference reads on its own.
"""
