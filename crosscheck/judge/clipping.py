r"""Clipping placement: after accumulation (the contract) vs per microbatch (the bug).

The contract clips the fully accumulated, fully reduced gradient :math:`g = \sum_{r,m} g_{rm}`
of the update, where :math:`g_{rm}` is microbatch (r, m)'s share of the objective's gradient
(its tokens' :math:`a_t / D`). Clipping each :math:`g_{rm}` before accumulating
(transformers#986; optax.apply_every in gpt-jax#2) gives
:math:`\sum_{r,m} \mathrm{clip}(g_{rm})`, which differs from :math:`\mathrm{clip}(g)` as soon
as one microbatch norm exceeds the threshold: that microbatch is shrunk on its own, so the
tokens of one microbatch weigh less than the others'. These rows compute both in float64 and
show the difference instead of hiding it; the implementations' own clip-after rows are their
vs-oracle rows (every case clips after accumulation with the run's threshold).
"""

from __future__ import annotations

from crosscheck.contract.cases import CaseResult
from crosscheck.contract.fixture import Fixture
from crosscheck.contract.optimizers import clip_by_global_norm, global_norm
from crosscheck.contract.oracle import weighted_grad
from crosscheck.contract.schemes import resolve_scheme
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err


def microbatch_gradients(fixture: Fixture, scheme: str, R: int, M: int) -> list[dict]:
    """g_rm for every microbatch: the gradient of its tokens' share of the objective."""
    batch = fixture.layout(R, M)
    weights = resolve_scheme(scheme).effective_weights(batch)
    params = fixture.params()
    return [
        weighted_grad(params, mb.inputs, mb.targets, weights[r, m])
        for r, m, mb in batch.microbatches()
    ]


def clip_strategy(max_norm: float) -> str:
    """The row's strategy column: where it clips, and at what threshold."""
    return f"per-microbatch c={max_norm:g}"


def clip_placement(fixture: Fixture, scheme: str, R: int, M: int, max_norm: float) -> CaseResult:
    """One row: does clipping per microbatch differ from clipping after, and when?"""
    parts = microbatch_gradients(fixture, scheme, R, M)
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    after, total_norm = clip_by_global_norm(total, max_norm)
    per_mb = [clip_by_global_norm(p, max_norm)[0] for p in parts]
    clipped_each = {k: sum(p[k] for p in per_mb) for k in total}
    norms = [global_norm(p) for p in parts]
    exceeded = sum(norm > max_norm for norm in norms)
    difference = tree_rel_err(clipped_each, after).max_rel_err
    differs = difference > FLOAT64_RTOL
    # The contract of the row: the placements differ whenever a microbatch exceeded the
    # threshold; when none did, they differ exactly when the total did (clip-after acts
    # alone). The exception is a window where one microbatch carries the whole gradient (the
    # others are empty): then clip(g_rm) is clip(g).
    carrying = sum(norm > 0 for norm in norms)
    expected_to_differ = (exceeded > 0 or total_norm > max_norm) and carrying > 1
    return CaseResult(
        check="clipping",
        fixture=fixture.name,
        scheme=scheme,
        impl="oracle",
        strategy=clip_strategy(max_norm),
        world_size=R,
        accum_steps=M,
        dtype="float64",
        max_rel_err=difference,
        ok=differs == expected_to_differ,
        reference="clip after accumulation",
        detail=(
            f"{exceeded}/{len(norms)} microbatch norms above {max_norm}, {carrying} nonzero "
            f"(largest {max(norms):.3g}); update norm {total_norm:.3g}"
        ),
        extra={"microbatch_norms": [float(n) for n in norms], "max_grad_norm": max_norm},
    )
