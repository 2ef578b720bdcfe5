"""Candidates of a diagnosis whose intended scheme is a scheme spec (contract v2).

v1's candidates read a scheme's (a_t, d) per microbatch; a spec states its scope and counts
instead, so its local-mean patterns are the same spec at a more local scope, and the v2
pattern of a count taken where it should not be is the same spec with a more local count:

================= ===========================================================================
rank-mean         the spec with ``scope = rank``: each rank divides by its own D_r, ranks
                  averaged
microbatch-mean   the spec with ``scope = microbatch``
local-group-count the spec with its group or document count taken per microbatch
                  (``count_scope = microbatch``), D unchanged: the per-microbatch group mean
                  of slime's per-rollout means and of verl#2776's question
================= ===========================================================================

and the trainer modes of `crosscheck.contract.spec_catalogue` under their own names (all rows
against non-empty rows, configured rows, sample-mask rows, ...).
"""

from __future__ import annotations

from dataclasses import replace

from crosscheck.contract.layout import LaidOutBatch
from crosscheck.contract.spec import SchemeSpec, get_spec
from crosscheck.contract.spec_catalogue import MODE_SPECS, NAMED_SPECS
from crosscheck.contract.spec_scheme import SpecScheme
from crosscheck.diagnosis.candidates import Candidate


def _candidate(name: str, kind: str, spec: SchemeSpec, batch: LaidOutBatch, **kw) -> Candidate:
    return Candidate(name, kind, batch.to_global(spec.effective_weights(batch)), **kw)


def spec_pattern_candidates(intended: SpecScheme, batch: LaidOutBatch) -> list[Candidate]:
    """rank-mean, microbatch-mean and local-group-count of the intended spec."""
    spec = intended.scheme_spec
    R, M = batch.layout.world_size, batch.layout.accum_steps
    out = []
    if spec.scope == "update" and spec.denominator.kind not in ("one", "configured"):
        ranks = replace(spec, scope="rank")
        out.append(
            _candidate(
                "rank-mean",
                "pattern",
                ranks,
                batch,
                logged_denominator=ranks.unit_denominators(batch)[0],
                degenerate=R == 1,
            )
        )
        micro = replace(spec, scope="microbatch")
        out.append(
            _candidate(
                "microbatch-mean",
                "pattern",
                micro,
                batch,
                logged_denominator=micro.unit_denominators(batch)[M - 1],
                degenerate=M == 1,
            )
        )
    if spec.weight.group in ("group", "document") and spec.weight.count_scope == "update":
        local = replace(spec, weight=replace(spec.weight, count_scope="microbatch"))
        out.append(
            _candidate(
                "local-group-count",
                "pattern",
                local,
                batch,
                logged_denominator=intended.global_denominator(batch),
                degenerate=R * M == 1,
            )
        )
    return out


def spec_scheme_candidates(intended: SpecScheme, batch: LaidOutBatch) -> list[Candidate]:
    """Every trainer mode other than the intended one, under its own name."""
    return [
        _candidate(name, "scheme", get_spec(name), batch)
        for name in MODE_SPECS
        if name != intended.name and name not in NAMED_SPECS
    ]
