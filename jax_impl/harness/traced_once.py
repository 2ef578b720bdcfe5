"""One trace for every batch shape of a sweep: the program is exported once with symbolic
M, B and T and compiled per concrete shape from that export.

A harness worker runs one sweep (every (spec, strategy) config of a set, side by side) on
every fixture and layout of its world size: batch shapes [R, M, B, T] that differ in M (the
accumulation steps), B (rows per microbatch) and T (positions). ``jax.jit`` traces and lowers
the program again for each shape, and for a sweep of a dozen configs the trace and lowering
cost more than XLA's compile of the result. The program's code does not depend on those
sizes: the spec's counts are data (segment sums over a static id space), the accumulation is
a ``lax.scan`` over M, and K = R M is formed from the shape. So it is traced and lowered once
with M, B and T as ``jax.export`` dimension variables; each concrete shape refines that
module and compiles it (XLA needs static shapes), with jit's cache per shape as before.

What runs computes the same thing, though not as the same text: XLA sees the refined shapes
later than jit's lowering would give them, and a global jit's partitioner may place a
collective differently. Every case of the shard_map, global-jit and multi-process rows of the
default matrix gave the same bits both ways (compared over the whole `--json`,
docs/performance.md). How a program is compiled, not what it computes, like
`jax_impl.harness.multiprocess_worker.CompiledByProcessZero`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import export

#: The batch's per-fixture sizes, in the order of its axes after the rank axis R (which the
#: mesh fixes): token fields are [R, M, B, T], row fields [R, M, B].
BATCH_DIMENSIONS = "M, B, T"


class TracedOnce:
    """`jitted` (a sweep's program: ``program(params per config, batch)``) exported once per
    kind of arguments, with the batch's M, B and T symbolic, and called through the export.

    The kind is everything but those sizes: the params' shapes and dtypes, the batch's
    structure (its static id space included), its fields' ranks and dtypes. The export holds
    no input shardings (jax 0.10.2 cannot call an export whose input shardings have symbolic
    shapes: it applies them to the exported avals, not the call's); the arrays passed in carry
    them, and the program places itself: a shard_map names its mesh, a global jit is
    partitioned from its inputs' shardings, as ``jax.jit`` does with committed arrays.

    Only under the GSPMD partitioner (``jax_use_shardy_partitioner`` off, as the harness's
    in-process workers run, `crosscheck.launch.workers.SMALL_PROGRAM_JAX_CONFIG`): with Shardy
    on, jaxlib 0.10.2 crashes (SIGSEGV in ``mlir.refine_polymorphic_shapes``) refining such a
    module, so there every shape is traced as ``jax.jit`` traces it. Called like `jitted`, or
    lowered like it (`lower`); `traces` counts the exports, for the tests.
    """

    def __init__(self, jitted: Any) -> None:
        self._jitted = jitted
        self._programs: dict[str, Any] = {}
        self.traces = 0

    def __call__(self, params: Any, batch: Any) -> Any:
        return self._program(params, batch)(params, batch)

    def lower(self, params: Any, batch: Any) -> Any:
        """The program for these arguments' shapes, lowered as ``jitted.lower`` lowers it
        (`jax_impl.harness.multiprocess_worker.CompiledByProcessZero` compiles it)."""
        return self._program(params, batch).lower(params, batch)

    def _program(self, params: Any, batch: Any) -> Any:
        """The jitted call of the export for the arguments' kind, exported at its first use;
        `jitted` itself under Shardy."""
        if jax.config.jax_use_shardy_partitioner:
            return self._jitted
        kind = _kind(params, batch)
        program = self._programs.get(kind)
        if program is None:
            program = self._programs[kind] = self._export(params, batch)
        return program

    def _export(self, params: Any, batch: Any) -> Any:
        """The jitted call of an export for these arguments' kind (jit then compiles it
        once per concrete shape)."""
        sizes = export.symbolic_shape(BATCH_DIMENSIONS)

        def symbolic(x: Any) -> jax.ShapeDtypeStruct:
            # [R, M, B, T] or [R, M, B]: R as laid out, the rest symbolic.
            return jax.ShapeDtypeStruct((x.shape[0], *sizes[: x.ndim - 1]), x.dtype)

        def concrete(x: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        exported = export.export(self._jitted)(
            jax.tree.map(concrete, params), jax.tree.map(symbolic, batch)
        )
        self.traces += 1
        return jax.jit(exported.call)


def _kind(params: Any, batch: Any) -> str:
    """What an export is for: the arguments' structure, the params' shapes and dtypes, the
    batch fields' ranks and dtypes (not their sizes)."""
    param_leaves, param_tree = jax.tree.flatten(params)
    batch_leaves, batch_tree = jax.tree.flatten(batch)
    return "|".join(
        [
            str(param_tree),
            str(batch_tree),
            *(f"{x.shape}{x.dtype}" for x in param_leaves),
            *(f"{x.shape[0]},{x.ndim}{x.dtype}" for x in batch_leaves),
        ]
    )
