"""The contract, in numpy alone: what a batch is, how each scheme weights it, what the update is.

Layer 1 of the flow fixture -> layout -> step -> gradient -> judge / diagnose -> report; it
imports nothing else of crosscheck. `layout` splits a global batch into ranks and microbatches,
`schemes` gives every token its weight a_t and every scheme its denominator D, `fixture` is
the batch type, `oracle` is the float64 closed form of the objective and its gradient,
`optimizers` the update math (clipping, SGD, AdamW) the oracle trains with, and `cases` the
coordinates and result rows of a check (the JSON contract of `crosscheck run`).
"""
