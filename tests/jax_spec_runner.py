"""Runner of tests/test_jax_spec.py's float64 checks (jax_enable_x64 is global: own process).

``python tests/jax_spec_runner.py --part {v1,oracle} --out R.json`` writes one record per
compared case: ``{"part", "front_end", "fixture", "spec", "variant", "R", "M", "err",
"want"}`` with ``want`` the relative tolerance ``err`` must not exceed. Parts:

v1
    every v1 name (the six intended schemes, ``constant:300`` and the accidental rank_mean /
    microbatch_mean), given to `jax_impl.StepConfig` by name, against the numpy oracle's v1
    schemes (`crosscheck.contract.oracle.loss_and_grad`: gradient and denominator) on every
    built-in fixture and layout R in {1, 2, 4}, M in {1, 2}, every variant, under pmap;
    shard_map and global-view jit on the four 8 x 64 fixtures.
oracle
    every named spec, trainer mode and extra spec against the numpy oracle on the v2
    fixtures under every front-end, and layout invariance (tests/jax_spec_oracle.py); and
    hand-computed weights (tests/jax_spec_hand.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import optax

import jax_impl
from crosscheck import BUILTIN_FIXTURES, builtin_fixture
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.spec import get_spec

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


def spec_batch(fixture, R: int, M: int) -> jax_impl.Batch:
    return jax_impl.lay_out_global_batch(
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


def v1_variants(front_end: str, M: int) -> tuple[tuple[str, str], ...]:
    """Every variant; under pmap with M = 1 not pmean (s = R runs at M = 2 for every R):
    compiling is most of the run."""
    if front_end == "pmap" and M == 1:
        return tuple(v for v in VARIANTS["pmap"] if v[1] != "pmean")
    return VARIANTS[front_end]


def run_v1(front_end: str, fixture_names: Iterable[str]) -> list[dict]:
    """Every v1 name against the oracle's v1 scheme, under one front-end.

    Rewritten: this compared the spec form of each v1 scheme with jax_impl's v1 path bit for
    bit; there is now one path (a v1 name is an entry of the spec table), so each v1 name is
    held to the oracle instead, gradient and denominator, with the file's float64 tolerance.
    """
    records, opt = [], optax.sgd(0.1)
    names = [*V1_SCHEMES, f"constant:{CONSTANT_C:g}", "rank_mean", "microbatch_mean"]
    sweeps: dict[tuple, Callable] = {}  # one per (R, variants): one compile per batch shape

    def sweep_of(R: int, variants: tuple) -> Callable:
        if (R, variants) not in sweeps:
            configs = [
                jax_impl.StepConfig(optimizer=opt, scheme=n, strategy=s, collective=c)
                for n in names
                for s, c in variants
            ]
            sweeps[(R, variants)] = make_sweep(front_end, configs, R)
        return sweeps[(R, variants)]

    for name in fixture_names:
        fixture = builtin_fixture(name)
        params = jax_impl.params_from_numpy(fixture.params(), "float64")
        for R, M in layouts(fixture, front_end):
            variants = v1_variants(front_end, M)
            record = functools.partial(_record, "v1", front_end, name, R=R, M=M)
            num_configs = len(names) * len(variants)
            outs = iter(sweep_of(R, variants)([params] * num_configs, spec_batch(fixture, R, M)))
            for spec_name in names:
                # For rank_mean / microbatch_mean the oracle's denominator is K (R or R M),
                # which is what the step reports as its global denominator for those scopes.
                want = loss_and_grad(fixture, spec_name, R, M)
                for s, coll in variants:
                    got = next(outs)
                    err = max(
                        rel_err(got.grads, want.grads),
                        rel_err({"D": got.global_denominator}, {"D": np.float64(want.denominator)}),
                    )
                    records.append(record(spec_name, f"{s}-{coll}", err=err, want=RTOL))
    return records


def _plain(name: str) -> dict:
    spec = get_spec(name).to_dict()
    spec.pop("name")
    return spec


def _np(tree) -> dict:
    return {k: np.asarray(v, dtype=np.float64) for k, v in tree.items()}


def _record(part, front_end, fixture, spec, variant, *, R, M, err, want) -> dict:
    return {
        "part": part, "front_end": front_end, "fixture": fixture, "spec": spec,
        "variant": variant, "R": R, "M": M, "err": err, "want": want,
    }  # fmt: skip


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
