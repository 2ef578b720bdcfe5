"""`crosscheck bench`: what correct loss weighting costs, timed on the small transformer.

Three ways to weight one update of R ranks x M microbatches, each in torch (DDP) and JAX
(shard_map), timed interleaved in one run:

- naive: each rank's own token mean, the gradient all-reduce averaging ranks (DDP's default,
  JAX pmean): the path users keep, and the one that weighs a token on a short rank more;
- precount: the global count all-reduced first (one extra scalar collective), then
  loss = sum / D with D the global count;
- fused: the count carried inside the gradient collective itself (torch: the postnorm comm
  hook of `torch_impl.comm_hooks`; JAX: one psum of (gradient, count)), then divide by D.

Modules: `config` (the sizes and the packed batch, numpy), `torch_bench` and `jax_bench`
(what runs in the rank and worker processes), `checks` (the gradients each path must give,
judged before any timing), `memory` (peak RSS of one call), `stats` (medians and ratios),
`runner` (launching both frameworks), `report` (the table and the JSON), `command` (the
command line's glue). docs/bench.md says how to read it.

Layer: above `verification`, below `cli`; imports `judge`, `launch` and `run` (what is
installed) only.
torch and JAX are imported only in the processes that run them.
"""
