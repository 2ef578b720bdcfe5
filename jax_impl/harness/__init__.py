"""What runs the JAX reference rather than what it is: the ``jax.distributed`` multi-process
launcher and its worker, the in-place run under an outside launcher, and the buggy steps of
the bug catalogue. Worker processes, their zygote and their stopping are `crosscheck.launch`'s
(the process layer the torch harness uses too).

Nothing in `jax_impl` outside this package imports it: the reference reads on its own.
"""
