"""Runner of tests/test_jax_spec.py's float64 checks (jax_enable_x64 is global: own process).

``python tests/jax_spec_runner.py --part {v1,oracle} --out R.json`` writes one record per
compared case: ``{"part", "front_end", "fixture", "spec", "variant", "R", "M", "err",
"bitwise", "want"}`` with ``want`` either ``"bitwise"`` or a relative tolerance. Parts:

v1
    the spec form of every v1 scheme against jax_impl's v1 path (`jax_impl.schemes`, and
    `jax_impl.accidental` for rank_mean / microbatch_mean) on every built-in fixture and
    layout R in {1, 2, 4}, M in {1, 2}, every variant, under pmap; shard_map and global-view
    jit on the four 8 x 64 fixtures.
oracle
    every named spec and trainer mode, plus specs covering every mask, soft factor,
    grouping, count scope, kind and scope (`EXTRA_SPECS`), against the numpy oracle
    (``crosscheck.contract.spec``'s c_t through ``oracle.weighted_grad``) on the v2 fixtures
    (rollouts, continued-documents), under every front-end; layout invariance of every
    update-scope spec (records with variant "invariance"); and hand-computed weights
    (tests/jax_spec_hand.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import optax

import jax_impl
from crosscheck import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.contract.oracle import weighted_grad
from crosscheck.contract.spec import get_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.fixtures.builtin import V2_FIXTURES
from jax_impl.spec_batch import lay_out_spec_batch
from jax_impl.spec_step import spec_step_config

# float64 against a float64 oracle through a different summation order: every path is a
# handful of sums and products on O(1) numbers (docs/contract.md, Tolerances).
RTOL = 1e-12
VARIANTS = {
    "pmap": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    "shard_map": (("precount", "psum"), ("precount", "pmean"), ("postnorm", "psum")),
    "jit": (("precount", "psum"), ("postnorm", "psum")),
}
FIELDS = ("group_ids", "document_ids", "row_weights", "sample_mask")
CONSTANT_C = 300.0
V1_SCHEMES = ("token_mean", "sequence_mean", "row_mean", "weighted_mean", "constant", "sum")
#: Ids' static vector lengths shared by every fixture of one shape: one compile per layout.
NUM_GROUPS, NUM_DOCUMENTS = 160, 1024
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


def spec_arrays(fixture) -> dict[str, np.ndarray]:
    keys = ("inputs", "targets", "segment_ids", "weights", *FIELDS)
    return {key: getattr(fixture, key) for key in keys}


def spec_batch(fixture, R: int, M: int):
    return lay_out_spec_batch(
        spec_arrays(fixture),
        R,
        M,
        vocab_size=fixture.vocab_size,
        num_groups=NUM_GROUPS,
        num_documents=NUM_DOCUMENTS,
    )


def rel_err(got, want) -> float:
    """max over leaves of max |a - b| / max |b|; inf on NaN (NaN never passes)."""
    worst = 0.0
    for key, w in want.items():
        g = np.asarray(got[key], dtype=np.float64)
        if not np.isfinite(g).all():
            return float("inf")
        worst = max(worst, float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-300)))
    return worst


def bitwise(got, want) -> bool:
    return all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)


def make_sweep(front_end: str, configs: list, R: int) -> Callable:
    if front_end == "pmap":
        return jax_impl.make_pmap_sweep(configs, R)
    if front_end == "shard_map":
        return jax_impl.make_shard_map_sweep(configs, jax_impl.data_mesh(R))
    return jax_impl.make_global_sweep(configs, jax_impl.data_mesh(R))


def layouts(fixture, front_end: str) -> Iterable[tuple[int, int]]:
    """Every default layout under pmap; (2, 2) and (4, 1) under shard_map and jit."""
    if front_end != "pmap":
        return [(2, 2), (4, 1)]
    return [(R, M) for R in (1, 2, 4) for M in (1, 2) if fixture.num_rows % (R * M) == 0]


def run_v1(front_end: str, fixture_names: Iterable[str]) -> list[dict]:
    """Spec forms of the v1 schemes against the v1 path of the same front-end."""
    records, opt = [], optax.sgd(0.1)
    variants = VARIANTS[front_end]
    names = [*V1_SCHEMES, f"constant:{CONSTANT_C:g}"]
    spec_configs = [
        spec_step_config(_plain(n), opt, strategy=s, collective=c)
        for n in names
        for s, c in variants
    ]
    v1_configs = [jax_impl.StepConfig(optimizer=opt, strategy=s, collective=c) for s, c in variants]
    accidental = [
        jax_impl.StepConfig(optimizer=opt, gradients=g)
        for g in (jax_impl.rank_mean_gradients, jax_impl.microbatch_mean_gradients)
    ]
    local_specs = [
        spec_step_config(n, opt, strategy=s, collective=c)
        for n in ("rank_mean", "microbatch_mean")
        for s, c in variants
    ]
    sweeps: dict[tuple[str, int], Callable] = {}  # built once per R: one compile per shape

    def cached(kind: str, configs: list, R: int, where: str = front_end) -> Callable:
        if (kind, R) not in sweeps:
            sweeps[(kind, R)] = make_sweep(where, configs, R)
        return sweeps[(kind, R)]

    for name in fixture_names:
        fixture = builtin_fixture(name)
        params = jax_impl.params_from_numpy(fixture.params(), "float64")
        for R, M in layouts(fixture, front_end):
            sweep = cached("spec", spec_configs + local_specs, R)
            batch = spec_batch(fixture, R, M)
            outs = sweep([params] * len(spec_configs + local_specs), batch)
            arrays = spec_arrays(fixture)
            v1_batch = jax_impl.lay_out_global_batch(arrays, R, M, vocab_size=fixture.vocab_size)
            v1_sweep = cached("v1", v1_configs, R)
            i = 0
            for spec_name in names:
                scheme, _, c = spec_name.partition(":")
                refs = v1_sweep([params] * len(variants), v1_batch, scheme, float(c or 0))
                for (s, coll), ref in zip(variants, refs, strict=True):
                    got = outs[i]
                    i += 1
                    same = bitwise(got.grads, ref.grads) and np.array_equal(
                        got.global_denominator, ref.global_denominator
                    )
                    # Same arithmetic, same bits; except postnorm's g / C: the spec's C is a
                    # compile-time constant (v1's a runtime argument), and XLA may turn a
                    # division by a constant into a product with its reciprocal (one rounding).
                    want = RTOL if c and s == "postnorm" else "bitwise"
                    records.append(
                        _record(
                            "v1",
                            front_end,
                            name,
                            spec_name,
                            f"{s}-{coll}",
                            R,
                            M,
                            rel_err(got.grads, _np(ref.grads)),
                            same,
                            want,
                        )
                    )
            # Global-view jit has no per-rank gradient to replace: its reference is pmap's.
            where = "pmap" if front_end == "jit" else front_end
            acc_refs = cached("accidental", accidental, R, where)([params] * 2, v1_batch)
            for k, spec_name in enumerate(("rank_mean", "microbatch_mean")):
                for s, coll in variants:
                    got = outs[i]
                    i += 1
                    # The accidental path takes each local mean and then pmean (a division
                    # by n then by R); the spec scales each sum by s / (K D) once: same
                    # weights, other roundings.
                    err = rel_err(got.grads, _np(acc_refs[k].grads))
                    records.append(
                        _record(
                            "v1", front_end, name, spec_name, f"{s}-{coll}", R, M, err, False, RTOL
                        )
                    )
    return records


def _plain(name: str) -> dict:
    spec = get_spec(name).to_dict()
    spec.pop("name")
    return spec


def _np(tree) -> dict:
    return {k: np.asarray(v, dtype=np.float64) for k, v in tree.items()}


def _record(part, front_end, fixture, spec, variant, R, M, err, same, want) -> dict:
    return {
        "part": part,
        "front_end": front_end,
        "fixture": fixture,
        "spec": spec,
        "variant": variant,
        "R": R,
        "M": M,
        "err": err,
        "bitwise": bool(same),
        "want": want,
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
    return {**{name: _plain(name) for name in known_spec_names()}, **EXTRA_SPECS}


def run_oracle() -> list[dict]:
    """Every spec against the oracle on the v2 fixtures; layout invariance of update scope."""
    records, opt = [], optax.sgd(0.1)
    all_specs = oracle_specs()
    grads_by_layout: dict[tuple, dict] = {}
    for front_end, R, M, variants, extra in ORACLE_RUNS:
        specs = {k: v for k, v in all_specs.items() if extra or k not in EXTRA_SPECS}
        configs = [
            spec_step_config(spec, opt, strategy=s, collective=c)
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
                oracle_spec = get_spec(spec)
                c = oracle_spec.effective_weights(laid_out).reshape(fixture.targets.shape)
                want = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
                for s, coll in variants:
                    got = _np(next(outs).grads)
                    records.append(
                        _record(
                            "oracle",
                            front_end,
                            name,
                            spec_name,
                            f"{s}-{coll}",
                            R,
                            M,
                            rel_err(got, want),
                            False,
                            RTOL,
                        )
                    )
                    if layout_invariant(spec):
                        grads_by_layout.setdefault((name, spec_name), {})[(R, M)] = got
    for (name, spec_name), by_layout in grads_by_layout.items():
        base = by_layout[(1, 1)]
        for (R, M), got in by_layout.items():
            err = rel_err(got, base)
            records.append(
                _record("oracle", "all", name, spec_name, "invariance", R, M, err, False, RTOL)
            )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("v1", "oracle"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    jax_impl.require_devices(4)  # fail, never skip, when the devices are missing
    if args.part == "v1":
        records = run_v1("pmap", BUILTIN_FIXTURES)
        eight_by_64 = [n for n in BUILTIN_FIXTURES if builtin_fixture(n).targets.shape == (8, 64)]
        records += run_v1("shard_map", eight_by_64) + run_v1("jit", eight_by_64)
    else:
        from jax_spec_hand import run_hand

        records = run_oracle() + run_hand()
    args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
