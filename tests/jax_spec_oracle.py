"""The oracle part of tests/jax_spec_runner.py: every spec against the numpy oracle.

Every named spec and trainer mode of docs/schemes-as-data.md, plus `EXTRA_SPECS` covering
every mask, soft factor, grouping, count scope, denominator kind and scope, on the v2
fixtures (rollouts: prompt groups over ranks and microbatches, a fully masked row, signed row
weights, sample masks; continued-documents: documents across rows, microbatches and ranks);
the expected gradient is ``oracle.weighted_grad`` of the oracle's c_t, and of the independent
reader's (tests/spec_reader.py) for `MIXED_ALPHA_SPECS`, whose weight and denominator alphas
differ. Plus layout invariance
of every spec whose objective does not depend on the layout (`layout_invariant`).
"""

from __future__ import annotations

import optax
from jax_spec_runner import (
    RTOL,
    VARIANTS,
    _np,
    _plain,
    _record,
    make_sweep,
    rel_err,
    spec_batch,
)
from mixed_alpha_specs import MIXED_ALPHA_SPECS, reader_weights

import jax_impl
from crosscheck import builtin_fixture
from crosscheck.contract.oracle import weighted_grad
from crosscheck.contract.spec import get_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.fixtures.builtin import V2_FIXTURES

EXTRA_SPECS: dict[str, dict] = {
    "group_count_microbatch": {
        "weight": {"group": "group", "count_scope": "microbatch"},
        "denominator": {"kind": "groups", "group": "group"},
    },
    "group_rank_scope": {
        "weight": {"group": "group", "count_scope": "rank"},
        "denominator": {"kind": "groups", "group": "group"},
        "scope": "rank",
    },
    "document_count_rank_all": {
        "weight": {"group": "document", "count_scope": "rank"},
        "denominator": {"kind": "all_groups", "group": "document"},
    },
    "all_groups_group_sample": {
        "denominator": {"kind": "all_groups", "group": "group", "mask": "sample"}
    },
    "all_groups_segment_rank": {
        "denominator": {"kind": "all_groups", "group": "segment"},
        "scope": "rank",
    },
    "all_groups_microbatch": {"denominator": {"kind": "all_groups", "group": "microbatch"}},
    "all_groups_rank": {"denominator": {"kind": "all_groups", "group": "rank"}},
    "groups_rank": {
        "weight": {"group": "rank"},
        "denominator": {"kind": "groups", "group": "rank"},
    },
    "groups_microbatch_rank_scope": {
        "weight": {"group": "microbatch", "alpha": 0.5},
        "denominator": {"kind": "groups", "group": "microbatch"},
        "scope": "rank",
    },
    "power_group": {
        "weight": {"group": "group", "alpha": 0.5},
        "denominator": {"kind": "power_sum", "group": "group", "alpha": 0.5},
    },
    # A group counted in two microbatches is two terms of D, each with its own count.
    "power_group_count_microbatch": {
        "weight": {"group": "group", "count_scope": "microbatch"},
        "denominator": {"kind": "power_sum", "group": "group"},
    },
    "power_document_count_rank": {
        "weight": {"group": "document", "count_scope": "rank", "alpha": 0.5},
        "denominator": {"kind": "power_sum", "group": "document", "alpha": 0.5},
    },
    "power_group_rank": {
        "weight": {"group": "group", "count_scope": "rank"},
        "denominator": {"kind": "power_sum", "group": "group"},
        "scope": "rank",
    },
    "power_document_microbatch_scope": {
        "weight": {"group": "document", "alpha": 0.5},
        "denominator": {"kind": "power_sum", "group": "document", "alpha": 0.5},
        "scope": "microbatch",
    },
    "power_segment_2": {
        "weight": {"group": "segment", "alpha": 2.0},
        "denominator": {"kind": "power_sum", "group": "segment", "alpha": 2.0},
    },
    "abs_rows_sample_rank": {
        "weight": {"soft": "row", "mask": "sample"},
        "denominator": {"kind": "abs_row_weight_sum", "mask": "sample"},
        "scope": "rank",
    },
    "weight_sum_sample_microbatch": {
        "weight": {"mask": "sample", "soft": "token"},
        "denominator": {"kind": "weight_sum", "mask": "sample"},
        "scope": "microbatch",
    },
    "slots_rank": {"denominator": {"kind": "slots"}, "scope": "rank"},
    "configured_microbatch": {
        "denominator": {"kind": "configured", "value": 100.0},
        "scope": "microbatch",
    },
    "one_rank": {"denominator": {"kind": "one"}, "scope": "rank"},
    "nonzero_tokens_rank": {
        "denominator": {"kind": "tokens", "mask": "nonzero_weight"},
        "scope": "rank",
    },
    "sample_tokens_microbatch": {
        "denominator": {"kind": "tokens", "mask": "sample"},
        "scope": "microbatch",
    },
}


#: (front-end, R, M, variants, with EXTRA_SPECS) of the oracle part: every front-end and
#: variant at (2, 2) for the doc's table, the extra specs under pmap; the layouts (1, 1),
#: (2, 2) and (4, 2) for layout invariance. Compiling is most of the run, hence no more.
ORACLE_RUNS = (
    ("pmap", 1, 1, VARIANTS["pmap"][:1], True),
    ("pmap", 2, 2, VARIANTS["pmap"], True),
    ("pmap", 4, 2, VARIANTS["pmap"][2:], True),
    ("shard_map", 2, 2, VARIANTS["shard_map"][1:2], False),
    ("jit", 2, 2, VARIANTS["jit"][1:], False),
)


def layout_invariant(spec: dict) -> bool:
    """Whether a spec's objective is the same for every layout: D over the update, and no
    count or grouping that follows the layout (a spanning group counted locally, or a
    microbatch or rank grouping anywhere: the number of microbatches is the layout's)."""
    weight, denominator = spec.get("weight", {}), spec.get("denominator", {})
    layout_groups = ("microbatch", "rank")
    local_count = weight.get("group") in ("group", "document") and (
        weight.get("count_scope", "update") != "update"
    )
    return (
        spec.get("scope", "update") == "update"
        and not local_count
        and weight.get("group") not in layout_groups
        and denominator.get("group") not in layout_groups
    )


def oracle_specs() -> dict[str, dict]:
    named = {name: _plain(name) for name in known_spec_names()}
    return {**named, **EXTRA_SPECS, **MIXED_ALPHA_SPECS}


def run_oracle() -> list[dict]:
    """Every spec against the oracle on the v2 fixtures; layout invariance of update scope."""
    records, opt = [], optax.sgd(0.1)
    all_specs = oracle_specs()
    grads_by_layout: dict[tuple, dict] = {}
    for front_end, R, M, variants, extra in ORACLE_RUNS:
        specs = {k: v for k, v in all_specs.items() if extra or k in known_spec_names()}
        configs = [
            jax_impl.StepConfig(optimizer=opt, scheme=spec, strategy=s, collective=c)
            for spec in specs.values()
            for s, c in variants
        ]
        sweep = make_sweep(front_end, configs, R)
        for name in V2_FIXTURES:
            fixture = builtin_fixture(name)
            params = jax_impl.params_from_numpy(fixture.params(), "float64")
            outs = iter(sweep([params] * len(configs), spec_batch(fixture, R, M)))
            laid_out = fixture.layout(R, M)
            for spec_name, spec in specs.items():
                if spec_name in MIXED_ALPHA_SPECS:  # held to the independent reader
                    c = reader_weights(fixture, spec, R, M)
                else:
                    c = get_spec(spec).effective_weights(laid_out).reshape(fixture.targets.shape)
                want = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
                for s, coll in variants:
                    got = _np(next(outs).grads)
                    err = rel_err(got, want)
                    records.append(
                        _record("oracle", front_end, name, spec_name, f"{s}-{coll}", R=R, M=M,
                                err=err, want=RTOL)
                    )  # fmt: skip
                    if layout_invariant(spec):
                        grads_by_layout.setdefault((name, spec_name), {})[(R, M)] = got
    for (name, spec_name), by_layout in grads_by_layout.items():
        base = by_layout[(1, 1)]
        for (R, M), got in by_layout.items():
            err = rel_err(got, base)
            invariance = ("oracle", "all", name, spec_name, "invariance")
            records.append(_record(*invariance, R=R, M=M, err=err, want=RTOL))
    return records
