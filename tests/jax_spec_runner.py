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
    every named spec, trainer mode and extra spec against the numpy oracle on the v2
    fixtures under every front-end, and layout invariance (tests/jax_spec_oracle.py); and
    hand-computed weights (tests/jax_spec_hand.py).
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
from crosscheck.contract.spec import get_spec
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
    """Every default layout under pmap; (2, 2) under shard_map and jit (their other layouts
    run in the oracle part: compiling is most of the run)."""
    if front_end != "pmap":
        return [(2, 2)]
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
        from jax_spec_oracle import run_oracle

        records = run_oracle() + run_hand()
    args.out.write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
