"""JAX's reading of scheme specs (contract v2, docs/schemes-as-data.md) against the oracle.

In this process (float32, x64 off): the parser and its errors, the batch's checks of its v2
fields, and one float32 run against the oracle. The float64 checks run in two runner
processes at once (jax_enable_x64 is global), tests/jax_spec_runner.py: the v1 names against
the oracle's v1 schemes on every built-in fixture and layout, every named spec, trainer mode
and the extra specs against the numpy oracle on the v2 fixtures under every front-end, layout
invariance of every update-scope spec, and weights counted by hand (tests/jax_spec_hand.py).
Then two real jax.distributed processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from child_env import ROOT, TESTS, jax_env
from jax_matrix import RUNNER_XLA_FLAGS
from mixed_alpha_specs import MIXED_ALPHA_SPECS

import jax_impl
from crosscheck import builtin_fixture
from crosscheck.contract.oracle import weighted_grad
from crosscheck.contract.spec import get_spec
from crosscheck.contract.spec_catalogue import known_spec_names
from crosscheck.launch.worker_processes import run_workers
from jax_impl.batch import default_document_ids, lay_out_global_batch
from jax_impl.harness.multiprocess import launch_multiprocess
from jax_impl.spec import SchemeSpec, named_spec, parse_spec

RUNNERS_TIMEOUT_S = 300  # each runner takes ~40-80 s on 2 busy cores; this only stops a hang
# float64 against a float64 oracle through another summation order (docs/contract.md).
F64_RTOL = 1e-12
# float32 (eps 6e-8) against float64: sums over ~300 tokens and a softmax (docs/contract.md).
F32_RTOL = 1e-5


def oracle_dict(name: str) -> dict:
    spec = get_spec(name).to_dict()
    spec.pop("name")
    return spec


def test_empty_spec_is_token_mean_and_every_key_is_defaulted() -> None:
    spec = parse_spec({})
    assert spec == SchemeSpec() == named_spec("token_mean")
    assert spec.weight.count_scope == "update" and spec.denominator.kind == "tokens"
    assert parse_spec(spec.to_dict()) == spec


@pytest.mark.parametrize("name", [*known_spec_names(), "constant:300", "length_power:2"])
def test_named_specs_read_as_the_oracles_catalogue(name: str) -> None:
    """Our table and the oracle's name the same specs (each read by its own parser)."""
    assert named_spec(name) == parse_spec(oracle_dict(name))
    assert parse_spec(oracle_dict(name)).to_dict() == oracle_dict(name)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"wieght": {}}, r"unknown key\(s\) \['wieght'\]; allowed keys: weight, denominator"),
        ({"weight": {"grup": "row"}}, r"spec weight has unknown key\(s\) \['grup'\]"),
        ({"weight": {"mask": "nonzero_weight"}}, r"weight.mask = 'nonzero_weight'; allowed "
         r"values: valid, sample$"),
        ({"weight": {"group": "prompt"}}, r"weight.group = 'prompt'; allowed values: none, row"),
        ({"weight": {"count_scope": "epoch"}}, r"count_scope = 'epoch'; allowed values: update"),
        ({"weight": {"alpha": "1"}}, r"weight.alpha must be a number, got '1'"),
        ({"weight": {"alpha": True}}, r"weight.alpha must be a number"),
        ({"denominator": {"kind": "rows"}}, r"denominator.kind = 'rows'; allowed values: tokens"),
        ({"denominator": {"kind": "groups"}}, r"kind = 'groups' counts groups: denominator."
         r"group must be one of row, segment"),
        ({"denominator": {"kind": "configured"}}, r"needs denominator.value > 0, got None"),
        ({"denominator": {"kind": "configured", "value": 0}}, r"value > 0, got 0.0"),
        ({"denominator": {"value": 3}}, r"only read by kind 'configured'"),
        ({"denominator": {"alpha": float("nan")}}, r"denominator.alpha must be finite"),
        ({"scope": "epoch"}, r"scope = 'epoch'; allowed values: update, rank, microbatch"),
        ({"weight": "row"}, r"spec weight must be an object"),
        ("row_means", r"unknown spec name 'row_means'; known: "),
        ("length_power:x", r"'x' is not a number"),
    ],
)  # fmt: skip
def test_a_bad_spec_names_the_key_and_the_allowed_values(spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def _arrays(fixture) -> dict[str, np.ndarray]:
    keys = ("inputs", "targets", "segment_ids", "weights")
    keys += ("group_ids", "document_ids", "row_weights", "sample_mask")
    return {key: np.array(getattr(fixture, key)) for key in keys}


def test_the_batch_checks_its_v2_fields_and_defaults_them() -> None:
    fixture = builtin_fixture("rollouts")
    arrays = _arrays(fixture)
    batch = lay_out_global_batch(arrays, 2, 2, vocab_size=fixture.vocab_size)
    assert batch.group_ids.shape == (2, 2, 2) and batch.document_ids.shape == (2, 2, 2, 64)
    assert (batch.num_groups, batch.num_documents) == (3, int(fixture.document_ids.max()) + 1)
    # Defaults: every row its own group; one document per (row, segment), 0 on padding.
    plain = {k: arrays[k] for k in ("inputs", "targets", "segment_ids", "weights")}
    default = lay_out_global_batch(plain, 1, 1, vocab_size=fixture.vocab_size)
    assert (default.group_ids.ravel() == np.arange(8)).all()
    pairs = (fixture.segment_ids + 100 * np.arange(8)[:, None])[fixture.segment_ids > 0]
    assert default.num_documents == len(np.unique(pairs)) + 1  # ids 1.., 0 = padding
    assert ((default_document_ids(fixture.segment_ids) == 0) == (fixture.segment_ids == 0)).all()
    bad = {
        "sample_mask": (np.array([1, 2, 1, 1, 1, 1, 1, 1]), r"sample_mask must be 8 values"),
        "row_weights": (np.array([1.0, np.inf, 1, 1, 1, 1, 1, 1]), r"row_weights must be 8 fin"),
        "group_ids": (np.array([0, -1, 0, 0, 0, 0, 0, 0]), r"group_ids of row 1 is outside"),
        "document_ids": (np.zeros((8, 64), int), r"document_ids\[0, \d+\] = 0 with segment"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            lay_out_global_batch({**arrays, key: value}, 1, 1, vocab_size=fixture.vocab_size)
    with pytest.raises(ValueError, match=r"num_groups = 2 but the ids need 3"):
        lay_out_global_batch(arrays, 1, 1, vocab_size=fixture.vocab_size, num_groups=2)


def test_float32_group_and_document_counts_match_the_oracle() -> None:
    """x64 off: counts int32, D and a_t float32; both strategies under shard_map (2, 2)."""
    jax_impl.require_devices(4)
    opt, R, M = optax.sgd(0.1), 2, 2
    names = ("group_token_mean", "document_mean", "length_power:0.5", "rank_mean")
    variants = (("precount", "pmean"), ("postnorm", "psum"))
    configs = [
        jax_impl.StepConfig(optimizer=opt, scheme=oracle_dict(n), strategy=s, collective=c)
        for n in names
        for s, c in variants
    ]
    sweep = jax_impl.make_shard_map_sweep(configs, jax_impl.data_mesh(R))
    for fixture_name in ("rollouts", "continued-documents"):
        fixture = builtin_fixture(fixture_name)
        batch = lay_out_global_batch(_arrays(fixture), R, M, vocab_size=fixture.vocab_size)
        params = jax_impl.params_from_numpy(fixture.params(), "float32")
        outs = iter(sweep([params] * len(configs), batch))
        for name in names:
            c = (
                get_spec(name)
                .effective_weights(fixture.layout(R, M))
                .reshape(fixture.targets.shape)
            )
            want = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
            for variant in variants:
                got = next(outs).grads
                for key, w in want.items():
                    err = np.max(np.abs(np.asarray(got[key], np.float64) - w)) / np.abs(w).max()
                    assert err <= F32_RTOL, f"{fixture_name}/{name}/{variant}/{key}: {err:.2e}"


@pytest.fixture(scope="module")
def float64_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Both float64 runner parts, concurrently (one per core)."""
    work = tmp_path_factory.mktemp("jax_spec")
    script = str(TESTS / "jax_spec_runner.py")
    parts = ("v1", "oracle")
    commands = [
        [sys.executable, script, "--part", p, "--out", str(work / f"{p}.json")] for p in parts
    ]
    env = jax_env(RUNNER_XLA_FLAGS)  # the runner imports its sibling modules from tests/
    run_workers(commands, timeout_s=RUNNERS_TIMEOUT_S, log_dir=work, env=env, cwd=ROOT)
    return {p: json.loads((work / f"{p}.json").read_text()) for p in parts}


def _failures(records: list[dict]) -> list[str]:
    """NaN never passes: its error is inf, and inf <= rtol is False."""
    bad = []
    for r in records:
        if not r["err"] <= r["want"]:
            bad.append(
                f"{r['part']} {r['front_end']} {r['fixture']}/{r['spec']} {r['variant']} "
                f"R={r['R']} M={r['M']}: err {r['err']:.2e}, wanted {r['want']}"
            )
    return bad


@pytest.mark.timeout(RUNNERS_TIMEOUT_S + 60)
def test_v1_names_give_the_oracles_v1_gradients(float64_records) -> None:
    # Rewritten: this held the v1 schemes' spec forms to jax_impl's v1 path bit for bit; there
    # is now one path, so the v1 names are held to the oracle's v1 schemes (F64_RTOL) instead.
    records = float64_records["v1"]
    problems = _failures(records)
    assert not problems, f"{len(problems)} case(s):\n" + "\n".join(problems[:30])
    assert {r["want"] for r in records} == {F64_RTOL}
    # Every fixture, every default layout under pmap, every variant, every v1 spec.
    pmap = {(r["fixture"], r["R"], r["M"]) for r in records if r["front_end"] == "pmap"}
    assert len(pmap) == 3 + 6 * 5  # seed: 3 layouts; the 8- and 144-row fixtures: 6 each
    specs = {r["spec"] for r in records}
    assert specs == {"token_mean", "sequence_mean", "row_mean", "weighted_mean", "constant",
                     "sum", "constant:300", "rank_mean", "microbatch_mean"}  # fmt: skip
    assert {r["front_end"] for r in records} == {"pmap", "shard_map", "jit"}


@pytest.mark.timeout(RUNNERS_TIMEOUT_S + 60)
def test_every_spec_matches_the_oracle_and_update_scope_is_layout_invariant(
    float64_records,
) -> None:
    records = float64_records["oracle"]
    problems = _failures(records)
    assert not problems, f"{len(problems)} case(s):\n" + "\n".join(problems[:30])
    oracle = {r["spec"] for r in records if r["part"] == "oracle" and r["variant"] != "invariance"}
    assert set(known_spec_names()) <= oracle and len(oracle) >= len(known_spec_names()) + 20
    assert set(MIXED_ALPHA_SPECS) <= oracle  # D's alpha apart from the weight's
    invariant = {r["spec"] for r in records if r["variant"] == "invariance"}
    assert {"group_token_mean", "document_mean", "signed_row_weight_mean"} <= invariant
    assert "group_count_microbatch" not in invariant  # a local count is not invariant
    hand = {(r["spec"], r["front_end"]) for r in records if r["part"] == "hand"}
    assert len({spec for spec, _ in hand}) == 8 and {fe for _, fe in hand} == {
        "pmap", "shard_map", "jit"
    }  # fmt: skip


#: Every named scheme and trainer mode: the worker holds them all in one compiled sweep.
MULTIPROCESS_SPECS = tuple(known_spec_names())


@pytest.mark.timeout(240)
def test_two_jax_distributed_processes_compute_the_oracles_gradient(tmp_path: Path) -> None:
    """The shard_map step over a mesh spanning 2 real processes (gloo), M = 2, every variant,
    float64; each process's reduced gradient against the oracle."""
    fixtures = ("rollouts", "continued-documents")
    cases = [
        {"fixture": str(builtin_fixture(n).save(tmp_path / f"{n}.npz")), "accum_steps": 2}
        for n in fixtures
    ]
    variants = [["precount", "psum"], ["precount", "pmean"], ["postnorm", "psum"]]
    spec = {
        "x64": True, "optimizer": {"name": "sgd", "learning_rate": 0.1}, "num_updates": 1,
        "variants": variants, "schemes": [], "dtypes": ["float64"], "cases": cases,
        "scheme_specs": [oracle_dict(n) for n in MULTIPROCESS_SPECS],
    }  # fmt: skip
    outputs = launch_multiprocess(
        spec, 2, tmp_path / "run", timeout_s=180, extra_xla_flags=RUNNER_XLA_FLAGS
    )
    assert sorted(int(out["rank"]) for out in outputs) == [0, 1]
    for case, name in enumerate(fixtures):
        fixture = builtin_fixture(name)
        for k, spec_name in enumerate(MULTIPROCESS_SPECS):
            c = get_spec(spec_name).effective_weights(fixture.layout(2, 2)).reshape(8, 64)
            want = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c)
            for strategy, collective in variants:
                key = f"{case}/float64/{strategy}-{collective}/spec{k}/0"
                for out in outputs:
                    for leaf, w in want.items():
                        got = out[f"{key}/grads.{leaf}"]
                        err = np.max(np.abs(got - w)) / np.abs(w).max()
                        assert err <= F64_RTOL, f"{key}/{leaf}: {err:.2e}"  # NaN fails too


@pytest.mark.parametrize("front_end", ["pmap", "shard_map", "jit"])
def test_the_ready_made_update_steps_with_a_spec(front_end: str) -> None:
    """One SGD update of every front-end's update function on a Batch: the params move
    by -lr times the oracle's gradient (float32, x64 off)."""
    jax_impl.require_devices(2)
    fixture, lr, R, M = builtin_fixture("rollouts"), 0.5, 2, 2
    config = jax_impl.StepConfig(
        optimizer=optax.sgd(lr), scheme="group_token_mean", strategy="postnorm"
    )
    make = {
        "pmap": lambda: jax_impl.make_pmap_update(config, R),
        "shard_map": lambda: jax_impl.make_shard_map_update(config, jax_impl.data_mesh(R)),
        "jit": lambda: jax_impl.make_global_update(config, jax_impl.data_mesh(R)),
    }[front_end]()
    params = jax_impl.params_from_numpy(fixture.params(), "float32")
    batch = lay_out_global_batch(_arrays(fixture), R, M, vocab_size=fixture.vocab_size)
    result = make(params, jax_impl.init_opt_state(config.optimizer, params), batch)
    c = get_spec("group_token_mean").effective_weights(fixture.layout(R, M))
    want = weighted_grad(fixture.params(), fixture.inputs, fixture.targets, c.reshape(8, 64))
    for key, g in want.items():
        step = (fixture.params()[key] - np.asarray(result.params[key], np.float64)) / lr
        # The step is read back from float32 params: their rounding (~6e-8 |p|, |p| ~ 1)
        # divided by lr |g| (|g| ~ 0.05 here) is ~3e-6 relative: 1e-4 admits it, and nothing
        # a wrong count could give (a group of 7 tokens counted as 6 is 17% off).
        assert np.max(np.abs(step - g)) / np.abs(g).max() <= 1e-4, key


def test_an_update_whose_denominator_is_zero_adds_zero_not_nan() -> None:
    """Every row sample-masked: D = 0 for zero_variance_excluded while the numerator (valid
    tokens) is not empty; the update's gradient is exactly 0 in every strategy."""
    jax_impl.require_devices(2)
    fixture = builtin_fixture("rollouts")
    arrays = {**_arrays(fixture), "sample_mask": np.zeros(8, int)}
    batch = lay_out_global_batch(arrays, 2, 2, vocab_size=fixture.vocab_size)
    params = jax_impl.params_from_numpy(fixture.params(), "float32")
    opt, variants = optax.sgd(0.1), (("precount", "pmean"), ("postnorm", "psum"))
    configs = [
        jax_impl.StepConfig(
            optimizer=opt, scheme="zero_variance_excluded", strategy=s, collective=c
        )
        for s, c in variants
    ]
    outs = jax_impl.make_pmap_sweep(configs, 2)([params] * 2, batch)
    outs += jax_impl.make_global_sweep(configs[1:], jax_impl.data_mesh(2))([params], batch)
    for out in outs:
        assert float(out.global_denominator) == 0.0 and float(out.loss) == 0.0
        for g in out.grads.values():
            assert np.all(np.asarray(g) == 0), "a unit with D = 0 must add exactly 0"
