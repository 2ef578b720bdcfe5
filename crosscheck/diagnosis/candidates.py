r"""What each scheme and each known bug pattern predicts for a gradient, from the oracle.

Diagnosis compares a gradient with every candidate's prediction. A candidate is a named
per-token effective weighting :math:`w_t` (its gradient is the oracle's
:math:`\sum_t w_t \nabla l_t`) plus, where the pattern defines it, the denominator the step
would log. Relative to the intended scheme's weights :math:`w^I_t = a_t / D`
(R ranks, M microbatches, :math:`D_r` / :math:`d_{rm}` a rank's / microbatch's share of D):

====================== ======================================================================
rank-mean              :math:`a_t / (R\, D_r)` (each rank normalizes locally, ranks averaged)
microbatch-mean        :math:`a_t / (R M\, d_{rm})` (each microbatch normalizes locally)
microstep-mean :math:`a_t / (M \sum_r d_{rm})` (each microbatch normalizes over all
                       ranks); where every rank of each microbatch holds the same d_rm it is
                       microbatch-mean, and is left to that name
missing-world-size     :math:`w^I / R`, logs D
double-reduce-count    :math:`w^I / R`, logs R D (same gradient: only the log tells them apart)
double-world-size      :math:`R\, w^I`
double-accum-scale     :math:`M\, w^I`
double-accum-divide    :math:`w^I / M`
unshifted-count        :math:`w^I D / (D + n_{rows})`, rows with a valid target (token mean)
attention-mask-count   :math:`w^I D / A`, A attended positions (token mean)
padding-as-tokens      :math:`w^I D / (N T)` (token mean)
packed-as-one          row-mean weights (sequence mean intended)
stale-count            :math:`w^I D / (D + \sum \text{earlier } D)`
clip-per-microbatch    :math:`w^I \min(1, c / \lVert g_m \rVert)` per accumulation step m, with
                       torch's or optax's clipping convention
float32-count          :math:`w^I D / \tilde D`, :math:`\tilde D` a float32 number near D > 2^24
local-group-count      the intended spec with its group or document count per microbatch
cp-...                 the context-parallel patterns (`context_candidates`)
pp-unsent-count        the stages before the last get D times their gradient (a pipeline)
zero-count-nan         no weights: a non-finite gradient on a layout with a unit the intended
                       scheme counts nothing in (`crosscheck.diagnosis.zero_count`)
====================== ======================================================================

and every other scheme's own weights under its own name. The definitions of what each buggy
step does are in `crosscheck.diagnosis.patterns`; this module is the numpy side of that contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from crosscheck.contract.fixture import Fixture
from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.optimizers import TORCH_CLIP_EPS, global_norm
from crosscheck.contract.oracle import Params
from crosscheck.contract.schemes import SCHEMES, is_v1_scheme
from crosscheck.contract.spec import SchemeSpec, get_spec
from crosscheck.contract.spec_catalogue import MODE_SPECS, NAMED_SPECS
from crosscheck.diagnosis.patterns import PATTERNS

#: Largest relative distance from D at which a float32 denominator is still float32-count:
#: a few float32 roundings of a sum of a few thousand terms (eps 6e-8 each).
FLOAT32_COUNT_MAX_REL = 2.0**-12
#: Below this, D is exact in float32 and float32-count cannot occur.
FLOAT32_EXACT_LIMIT = 2.0**24


@dataclass(frozen=True, slots=True)
class Candidate:
    """A named prediction: effective weights [N, T] and the denominator the step logs."""

    name: str
    kind: str  # "intended", "pattern", "scheme" or "family"
    weights: np.ndarray
    logged_denominator: float | None = None
    note: str = ""
    #: At this layout the candidate is another one by construction (rank-mean at R = 1 is the
    #: intended scheme, microbatch-mean at M = 1 is rank-mean): it never names a case, but it
    #: counts when a run asks which name fits every case (``crosscheck.diagnosis.naming``).
    degenerate: bool = False
    #: A gradient that is no token weighting: `weights`' gradient with these parameters
    #: scaled (a pipeline stage that was never given D). Judged by its gradient alone.
    leaf_scales: Mapping[str, float] | None = None


#: The oracle gradient of given [N, T] effective weights (diagnosis passes a fast one).
GradOf = Callable[[np.ndarray], Params]


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator with 0 where the denominator is 0 (an empty rank adds nothing)."""
    safe = np.where(denominator > 0, denominator, 1.0)
    return np.where(denominator > 0, numerator / safe, 0.0)


def _candidate(name: str, spec: SchemeSpec, batch: LaidOutBatch, **kw) -> Candidate:
    return Candidate(name, "pattern", batch.to_global(spec.effective_weights(batch)), **kw)


def _additive(spec: SchemeSpec) -> bool:
    """Whether D over a set of microbatches is the sum of theirs: counts of tokens, slots or
    weights, and of groups that never leave a row. Only then is each accumulation step's count
    over all ranks the sum of its microbatches' (microstep-mean)."""
    d = spec.denominator
    local_groups = d.kind in ("groups", "all_groups") and d.group in ("row", "segment")
    return d.kind in ("tokens", "slots", "weight_sum", "abs_row_weight_sum") or local_groups


def local_mean_candidates(intended: SchemeSpec, batch: LaidOutBatch) -> list[Candidate]:
    """The intended spec normalized more locally than the update: rank-mean (``scope =
    rank``), microbatch-mean (``scope = microbatch``), microstep-mean (each accumulation step
    over all ranks, for an additive denominator) and local-group-count (a group or document
    count taken per microbatch, D unchanged: slime's per-rollout means, verl#2776)."""
    R, M = batch.layout.world_size, batch.layout.accum_steps
    out = []
    if intended.scope == "update" and intended.denominator.kind not in ("one", "configured"):
        # At R = 1 rank-mean is the intended scheme; at M = 1 a microbatch is a rank and
        # microbatch-mean is rank-mean itself: degenerate there.
        ranks = replace(intended, scope="rank")
        out.append(
            _candidate(
                "rank-mean",
                ranks,
                batch,
                logged_denominator=ranks.unit_denominators(batch)[0],
                degenerate=R == 1,
            )
        )
        micro = replace(intended, scope="microbatch")
        d = np.asarray(micro.unit_denominators(batch), dtype=np.float64).reshape(R, M)
        out.append(
            _candidate(
                "microbatch-mean",
                micro,
                batch,
                logged_denominator=float(d[0, -1]),
                degenerate=M == 1,
            )
        )
        if _additive(intended):
            # Microbatch m's count over all ranks, n_m = sum_r d_rm, and the M means averaged.
            # At M = 1 that is the intended scheme, at R = 1 microbatch-mean; and where every
            # rank holds the same d_rm in each microbatch, n_m = R d_rm and it is
            # microbatch-mean again: the two predict one gradient there, and the older name
            # is the one given.
            per_step = d.sum(axis=0)
            w = _divide(intended.token_weights(batch), per_step[None, :, None, None]) / M
            out.append(
                Candidate(
                    "microstep-mean",
                    "pattern",
                    batch.to_global(w),
                    float(per_step[-1]),
                    degenerate=R == 1 or M == 1 or bool(np.all(d == d[:1])),
                )
            )
    w = intended.weight
    if w.group in ("group", "document") and w.count_scope == "update":
        local = replace(intended, weight=replace(w, count_scope="microbatch"))
        out.append(
            _candidate(
                "local-group-count",
                local,
                batch,
                logged_denominator=intended.global_denominator(batch),
                degenerate=R * M == 1,
            )
        )
    return out


def context_candidates(intended: SchemeSpec, batch: LaidOutBatch) -> list[Candidate]:
    r"""The context-parallel patterns, at a layout of C > 1 context ranks per data rank
    (process p = r C + c holds context rank c's positions of data rank r's rows;
    :math:`D_p` is process p's share of D, :math:`D_c = \sum_r D_{rc}` context rank c's):

    ======================= ==============================================================
    cp-local-count          :math:`a_t / (R C\, D_p)`: the intended spec at process scope
    cp-count-over-replicas  :math:`w^I / C`, logs C D
    missing-cp-compensation :math:`w^I / C`, logs D (same gradient: the log tells them apart)
    cp-count-over-dp-only   :math:`a_t / D_{c(t)}` (an additive D)
    cp-local-sequence-count the intended spec with its row, segment, document or group counts
                            taken per process and microbatch, D unchanged
    ======================= ==============================================================
    """
    layout = batch.layout
    R, C = layout.world_size, layout.context_size
    out: list[Candidate] = []
    if intended.scope == "update" and intended.denominator.kind not in ("one", "configured"):
        shard = replace(intended, scope="rank")  # a "rank" of a spec's scope is a process
        d = np.asarray(shard.unit_denominators(batch), dtype=np.float64)
        out.append(_candidate("cp-local-count", shard, batch, logged_denominator=float(d[0])))
        weights = batch.to_global(intended.effective_weights(batch))
        D = intended.global_denominator(batch)
        out += [
            Candidate("cp-count-over-replicas", "pattern", weights / C, C * D),
            Candidate("missing-cp-compensation", "pattern", weights / C, D),
        ]
        if _additive(intended):
            by_context = d.reshape(R, C).sum(axis=0)  # D_c: context rank c over the data ranks
            context = layout.context_ranks(batch.targets.shape[-1])
            w = _divide(intended.token_weights(batch), by_context[context])
            out.append(
                Candidate(
                    "cp-count-over-dp-only",
                    "pattern",
                    batch.to_global(w),
                    float(by_context[0]),
                )
            )
    w = intended.weight
    if w.group in ("row", "segment", "group", "document") and w.count_scope == "update":
        local = replace(intended, weight=replace(w, count_scope="microbatch"))
        out.append(
            _candidate(
                "cp-local-sequence-count",
                local,
                batch,
                logged_denominator=intended.global_denominator(batch),
            )
        )
    return out


def pipeline_candidates(
    intended: SchemeSpec, batch: LaidOutBatch, weights: np.ndarray, stages: Sequence[Sequence[str]]
) -> list[Candidate]:
    """pp-unsent-count: the parameters of every stage before the last keep the unnormalized
    sum, D times their intended gradient (`stages`: each stage's parameters, in pipeline
    order); the last stage's are as intended. Logs D."""
    if len(stages) < 2 or intended.scope != "update":
        return []
    D = intended.global_denominator(batch)
    scales = {leaf: D for stage in stages[:-1] for leaf in stage}
    return [Candidate("pp-unsent-count", "pattern", weights, D, leaf_scales=scales)]


def _same_as(spec: SchemeSpec, name: str) -> bool:
    """Whether `spec` computes the catalogue's `name`, whatever it is called."""
    return replace(spec, name=name) == get_spec(name)


def scale_candidates(
    intended: SchemeSpec,
    fixture: Fixture,
    batch: LaidOutBatch,
    weights: np.ndarray,
    previous_denominators: tuple[float, ...],
) -> list[Candidate]:
    """Patterns that weigh every token as intended but scale the gradient."""
    R, M = batch.layout.world_size, batch.layout.accum_steps
    D = intended.global_denominator(batch)
    # A factor R (or M) of 1 is the intended gradient: degenerate at R = 1 (M = 1).
    out = [
        Candidate("missing-world-size", "pattern", weights / R, D, degenerate=R == 1),
        Candidate("double-reduce-count", "pattern", weights / R, R * D, degenerate=R == 1),
        Candidate("double-world-size", "pattern", weights * R, D, degenerate=R == 1),
        Candidate("double-accum-scale", "pattern", weights * M, D, degenerate=M == 1),
        Candidate("double-accum-divide", "pattern", weights / M, D, degenerate=M == 1),
    ]
    if previous_denominators and D > 0:
        stale = D + sum(previous_denominators)
        out.append(Candidate("stale-count", "pattern", weights * (D / stale), stale))
    if _same_as(intended, "token_mean") and D > 0:
        valid = fixture.valid
        rows = float(np.count_nonzero(valid.any(axis=1)))
        attended = float(np.count_nonzero(fixture.segment_ids > 0))
        slots = float(valid.size)
        out += [
            Candidate("unshifted-count", "pattern", weights * (D / (D + rows)), D + rows),
            Candidate("attention-mask-count", "pattern", weights * (D / attended), attended),
            Candidate("padding-as-tokens", "pattern", weights * (D / slots), slots),
        ]
    if _same_as(intended, "sequence_mean"):
        row_mean = SCHEMES["row_mean"]
        out.append(
            Candidate(
                "packed-as-one",
                "pattern",
                batch.to_global(row_mean.effective_weights(batch)),
                row_mean.global_denominator(batch),
            )
        )
    return out


def clip_candidates(
    grad_of: GradOf, batch: LaidOutBatch, weights: np.ndarray, max_norm: float
) -> list[Candidate]:
    """clip-per-microbatch: each accumulation step's all-rank gradient clipped, then summed."""
    M = batch.layout.accum_steps
    if M < 2:
        return []  # one microbatch per rank: clipping it is clipping after accumulation
    step_of = np.broadcast_to(np.arange(M)[None, :, None, None], batch.targets.shape)
    step_of = batch.to_global(step_of)
    norms = [global_norm(grad_of(weights * (step_of == m))) for m in range(M)]
    out = []
    for convention, factor in (
        ("optax", [1.0 if n < max_norm else max_norm / n for n in norms]),
        ("torch", [min(max_norm / (n + TORCH_CLIP_EPS), 1.0) for n in norms]),
    ):
        scale = np.asarray(factor)[step_of]
        out.append(
            Candidate(
                "clip-per-microbatch",
                "pattern",
                weights * scale,
                note=f"{convention} clipping at {max_norm:g}; step norms "
                + ", ".join(f"{n:.3g}" for n in norms),
            )
        )
    return out


def float32_count_candidate(
    intended: SchemeSpec, batch: LaidOutBatch, weights: np.ndarray, scale: float
) -> list[Candidate]:
    """float32-count: the gradient's fitted scale implies a float32 denominator near D.

    The float32 result depends on the order of the float32 additions, which the diagnosis
    cannot know; it reads the implied denominator D / scale instead and accepts it when it is
    a float32 number other than D within a few roundings of D.
    """
    token_or_weight_count = intended.denominator.kind in ("tokens", "weight_sum")
    if not (intended.scope == "update" and token_or_weight_count) or not scale > 0:
        return []
    D = intended.global_denominator(batch)
    if D <= FLOAT32_EXACT_LIMIT:
        return []
    implied = float(np.float32(D / scale))
    # A float32 running sum of n terms rounds each partial sum once: it drifts from D by about
    # sqrt(n) roundings of half a float32 ulp of D. Farther than sqrt(n) ulps is a wrong count,
    # not a float32 one (it would otherwise name any scale within 2^-12 of 1).
    summands = max(int(np.count_nonzero(weights)), 1)
    window = math.sqrt(summands) * float(np.spacing(np.float32(D)))
    if implied == D or abs(implied - D) > min(window, FLOAT32_COUNT_MAX_REL * D):
        return []
    note = f"the denominator was {implied:.0f} instead of D = {D:.0f}"
    return [Candidate("float32-count", "pattern", weights * (D / implied), implied, note)]


def scheme_candidates(intended: SchemeSpec, batch: LaidOutBatch) -> list[Candidate]:
    """Every other scheme under its own name (a gradient of the wrong scheme altogether).

    v1's schemes always; the trainer modes of `crosscheck.contract.spec_catalogue` too when the
    intended scheme is not one of v1's: on v1's fixtures (one group per row, every row
    sampled, no row weights) most modes are a v1 scheme again and would only add ties. The
    accidental schemes are left out where the rank-mean and microbatch-mean patterns of the
    intended scheme already are them (token mean); rank_mean at R = 1 is token_mean and
    microbatch_mean at M = 1 is rank_mean, so they are degenerate there.
    """
    skip = {intended.name}
    if _same_as(intended, "token_mean"):
        skip |= {"rank_mean", "microbatch_mean"}
    R, M = batch.layout.world_size, batch.layout.accum_steps
    degenerate = {"rank_mean": R == 1, "microbatch_mean": M == 1}
    others = dict(SCHEMES)
    if not is_v1_scheme(intended):
        others |= {name: get_spec(name) for name in MODE_SPECS if name not in NAMED_SPECS}
    return [
        Candidate(
            name,
            "scheme",
            batch.to_global(scheme.effective_weights(batch)),
            degenerate=degenerate.get(name, False),
        )
        for name, scheme in others.items()
        if name not in skip
    ]


def known_names() -> tuple[str, ...]:
    """Every name a diagnosis can give: schemes, docs/bugs.md patterns and the reweighting
    families of `crosscheck.diagnosis.families` (listed here, not imported: families build on this
    module)."""
    return (*SCHEMES, *PATTERNS, "scale", "rank-skew", "microbatch-skew")
