"""`crosscheck export-vectors`: portable test vectors, checked without the oracle.

The vectors are produced by the oracle; here they are checked against code written from the
manifest's own statement of the math (one-hot einsums instead of the oracle's fancy indexing
and scatter-add, per-microbatch loops for the schemes, the AdamW formula by hand), reading
only the exported files. Then the torch and JAX implementations are checked against them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from spec_reader import spec_weights

from crosscheck.contract.cases import TrainSettings
from crosscheck.contract.schemes import SCHEMES
from crosscheck.fixtures.vectors import (
    MANIFEST_NAME,
    MODE_FIXTURES,
    ExportDirectoryError,
    export_vectors,
    mode_references,
)
from crosscheck.run.matrix import run_matrix
from crosscheck.run.plan import Plan

RTOL = 1e-12
IGNORE = -100
FIXTURE_KEYS = {"inputs", "targets", "segment_ids", "weights", "embed", "unembed"}
OPTIONAL_FIXTURE_KEYS = {"group_ids", "document_ids", "row_weights", "sample_mask"}
VECTOR_KEYS = {
    "loss",
    "denominator",
    "token_weights",
    "grad_embed",
    "grad_unembed",
    "adamw_embed",
    "adamw_unembed",
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vectors")
    result = export_vectors(directory)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    return directory, result, manifest


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


def _rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - b| / max |b| (the manifest's comparison), inf on a non-finite value."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    diff = np.abs(actual - expected)
    if not np.isfinite(diff).all():
        return math.inf
    return float(diff.max()) / max(float(np.abs(expected).max()), 1e-300)


def _by_fixture(directory: Path, manifest: dict) -> dict[str, tuple[dict, list[dict]]]:
    """fixture name -> (its arrays, its vector records)."""
    out = {}
    for record in manifest["fixtures"]:
        vectors = [v for v in manifest["vectors"] if v["fixture"] == record["name"]]
        out[record["name"]] = (_load(directory / record["path"]), vectors)
    return out


def test_two_exports_are_byte_identical(exported, tmp_path):
    first, _, _ = exported
    second = export_vectors(tmp_path / "again").manifest_path.parent
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for relative in files:
        assert (first / relative).read_bytes() == (second / relative).read_bytes(), relative


def test_manifest_lists_every_file_and_documents_every_key(exported):
    directory, result, manifest = exported
    on_disk = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    listed = [
        r["path"]
        for r in manifest["fixtures"]
        + manifest["vectors"]
        + manifest["objective_params"]
        + manifest["objective_vectors"]
    ]
    assert len(listed) == len(set(listed))
    assert on_disk == {*listed, MANIFEST_NAME}
    assert {p.relative_to(directory).as_posix() for p in result.files} == on_disk
    assert result.num_bytes == sum((directory / p).stat().st_size for p in on_disk)
    assert manifest["format_version"] == 2
    assert set(manifest["keys"]["fixture_optional"]) == OPTIONAL_FIXTURE_KEYS
    sizes = {r["name"]: r["sizes"] for r in manifest["fixtures"]}
    optional_seen = set()
    for kind, records, keys in (
        ("fixture", manifest["fixtures"], FIXTURE_KEYS),
        ("expected", manifest["vectors"], VECTOR_KEYS),
    ):
        docs = manifest["keys"][kind]
        assert set(docs) == keys
        if kind == "fixture":
            docs = {**docs, **manifest["keys"]["fixture_optional"]}
        assert all(
            doc["meaning"] and doc["symbolic_shape"] and doc["dtype"] for doc in docs.values()
        )
        for record in records:
            data = (directory / record["path"]).read_bytes()
            assert record["bytes"] == len(data)
            assert record["sha256"] == hashlib.sha256(data).hexdigest()
            arrays = _load(directory / record["path"])
            assert set(arrays) == set(record["keys"]), record["path"]
            assert keys <= set(arrays) <= keys | OPTIONAL_FIXTURE_KEYS, record["path"]
            optional_seen |= set(arrays) - keys
            dims = sizes[record.get("fixture", record.get("name"))]
            for key, entry in record["keys"].items():
                symbolic = docs[key]["symbolic_shape"]
                assert entry["symbolic_shape"] == symbolic
                assert list(arrays[key].shape) == entry["shape"], (record["path"], key)
                assert entry["shape"] == [dims[s] for s in re.findall(r"[A-Z]", symbolic)]
                assert arrays[key].dtype.str == entry["dtype"]
                assert np.dtype(entry["dtype"]) == np.dtype(docs[key]["dtype"])
    assert optional_seen == OPTIONAL_FIXTURE_KEYS  # the v2 fixtures carry every one


def test_manifest_covers_every_fixture_scheme_and_layout(exported):
    _, _, manifest = exported
    modes = mode_references()
    assert set(manifest["schemes"]) == set(SCHEMES) | set(modes)
    for name, scheme in manifest["schemes"].items():
        assert scheme["definition"] and scheme["spec"], name
        if name in SCHEMES:
            assert scheme["a_t"] and scheme["d"] and scheme["D"], name
            assert scheme["intended"] == SCHEMES[name].intended
        else:
            assert scheme["intended"], name  # every exported trainer mode is layout invariant
    for word in ("logits", "per_token_loss", "loss", "grad_unembed", "grad_embed"):
        assert manifest["model"][word]
    assert manifest["model"]["ignore_index"] == IGNORE
    expected = set()
    for record in manifest["fixtures"]:
        N = record["sizes"]["N"]
        layouts = {
            (R, M) for R in range(1, 9) for M in range(1, 5) if R * M <= 8 and N % (R * M) == 0
        }
        assert {tuple(layout) for layout in record["layouts"]} == layouts
        schemes = [*SCHEMES, *(modes if record["name"] in MODE_FIXTURES else ())]
        expected |= {(record["name"], s, R, M) for s in schemes for R, M in layouts}
    seen = set()
    for v in manifest["vectors"]:
        assert v["path"] == f"expected/{v['fixture']}/{v['scheme']}/R{v['R']}_M{v['M']}.npz"
        seen.add((v["fixture"], v["scheme"], v["R"], v["M"]))
    assert seen == expected and len(manifest["vectors"]) == len(expected)


def _token_terms(fx: dict[str, np.ndarray]):
    """One-hot form of the manifest's model: x one-hot, E[x_t], l_t and e_t for every token."""
    embed, unembed = fx["embed"], fx["unembed"]
    vocab = np.arange(embed.shape[0])
    valid = fx["targets"] != IGNORE
    x_hot = (fx["inputs"][..., None] == vocab).astype(np.float64)  # [N, T, V]
    y_hot = ((fx["targets"][..., None] == vocab) & valid[..., None]).astype(np.float64)
    hidden = np.einsum("ntx,xh->nth", x_hot, embed)  # E[x_t]
    logits = np.einsum("nth,hv->ntv", hidden, unembed)  # z_t
    top = logits.max(axis=-1)
    lse = top + np.log(np.exp(logits - top[..., None]).sum(axis=-1))
    loss = np.where(valid, lse - np.einsum("ntv,ntv->nt", logits, y_hot), 0.0)
    error = np.exp(logits - lse[..., None]) * valid[..., None] - y_hot  # softmax - onehot
    return x_hot, hidden, loss, error


def test_independent_model_reproduces_every_loss_and_gradient(exported):
    directory, _, manifest = exported
    count = 0
    for fx, vectors in _by_fixture(directory, manifest).values():
        x_hot, hidden, token_loss, error = _token_terms(fx)
        back = np.einsum("ntv,hv->nth", error, fx["unembed"])  # U e_t
        for record in vectors:
            v = _load(directory / record["path"])
            c = v["token_weights"]
            loss = math.fsum((c * token_loss).ravel().tolist())
            grad_unembed = np.einsum("nth,ntv->hv", hidden * c[..., None], error)
            grad_embed = np.einsum("ntx,nth->xh", x_hot, back * c[..., None])
            where = record["path"]
            assert abs(loss - float(v["loss"])) <= RTOL * abs(float(v["loss"])), where
            assert _rel_err(grad_unembed, v["grad_unembed"]) <= RTOL, where
            assert _rel_err(grad_embed, v["grad_embed"]) <= RTOL, where
            count += 1
    assert count == len(manifest["vectors"])


def _scheme_weights(fx: dict[str, np.ndarray], scheme: str, R: int, M: int):
    """(c [N, T], D) from the manifest's (a_t, d, D) definitions, microbatch by microbatch."""
    N, T = fx["targets"].shape
    B = N // (R * M)
    shape = (R, M, B, T)
    valid = (fx["targets"] != IGNORE).reshape(shape).astype(np.float64)
    segments, soft = fx["segment_ids"].reshape(shape), fx["weights"].reshape(shape)
    a = np.zeros(shape)
    d: list[float] = []
    for r in range(R):
        n_rank = valid[r].sum()
        for m in range(M):
            v, n = valid[r, m], valid[r, m].sum()
            if scheme in ("token_mean", "constant", "sum"):
                a[r, m] = v
                d.append({"token_mean": n, "constant": B * T, "sum": 0.0}[scheme])
            elif scheme == "weighted_mean":
                a[r, m] = soft[r, m] * v
                d.append(math.fsum((soft[r, m] * v).ravel().tolist()))
            elif scheme == "rank_mean":
                a[r, m] = v / n_rank if n_rank else 0.0
            elif scheme == "microbatch_mean":
                a[r, m] = v / n if n else 0.0
                d.append(1.0)
            else:  # sequence_mean groups by (row, segment id), row_mean by row
                count = 0
                for b in range(B):
                    keys = segments[r, m, b] if scheme == "sequence_mean" else np.zeros(T)
                    for key in np.unique(keys):
                        group = keys == key
                        n_group = v[b][group].sum()
                        if n_group > 0:
                            a[r, m, b][group] = v[b][group] / n_group
                            count += 1
                d.append(float(count))
    D = {"sum": 1.0, "rank_mean": float(R)}.get(scheme, math.fsum(d))
    return (a / D if D else a * 0.0).reshape(N, T), D


def test_scheme_definitions_reproduce_every_token_weight_and_denominator(exported):
    directory, _, manifest = exported
    checked = 0
    for fx, vectors in _by_fixture(directory, manifest).values():
        for record in vectors:
            v = _load(directory / record["path"])
            if record["scheme"] not in SCHEMES:
                continue  # a trainer mode: read from its spec in the next test
            checked += 1
            c, D = _scheme_weights(fx, record["scheme"], record["R"], record["M"])
            assert abs(D - float(v["denominator"])) <= RTOL * abs(D), record["path"]
            assert _rel_err(c, v["token_weights"]) <= RTOL, record["path"]
    assert checked == sum(v["scheme"] in SCHEMES for v in manifest["vectors"])


def test_independent_adamw_step_reproduces_every_update(exported):
    directory, _, manifest = exported
    optimizer = manifest["optimizer"]
    hyper = optimizer["hyperparameters"]
    # The vectors must use exactly the harness's optimizer, and say that nothing is clipped.
    assert hyper == asdict(TrainSettings().optimizer)
    assert "no gradient clipping" in optimizer["gradient"]
    lr, b1, b2, eps, wd = (hyper[k] for k in ("learning_rate", "b1", "b2", "eps", "weight_decay"))
    for fx, vectors in _by_fixture(directory, manifest).values():
        for record in vectors:
            v = _load(directory / record["path"])
            for name in ("embed", "unembed"):
                theta, g = fx[name], v[f"grad_{name}"]
                m, s = (1 - b1) * g, (1 - b2) * g * g  # k = 1 from zero moments
                step = (m / (1 - b1)) / (np.sqrt(s / (1 - b2)) + eps)
                updated = theta - lr * (step + wd * theta)
                assert _rel_err(updated, v[f"adamw_{name}"]) <= RTOL, (record["path"], name)


def test_torch_and_jax_reproduce_the_vectors(exported):
    directory, _, manifest = exported
    plan = Plan(
        fixtures=["packed", "seed"],
        schemes=list(SCHEMES),
        impls=["torch-ddp", "jax-pmap"],
        world_sizes=[1, 2],
        accum_steps=[1, 2],
        settings=TrainSettings(num_updates=1, max_grad_norm=None),
        world_size_change=False,
        resume=False,
    )
    run = run_matrix(plan)
    failed = [row for row in run.rows if row.check == "vs-oracle" and not row.ok]
    assert not failed, failed[:3]
    paths = {(v["fixture"], v["scheme"], v["R"], v["M"]): v["path"] for v in manifest["vectors"]}
    covered = set()
    for case, output in sorted(run.outputs.items()):
        v = _load(directory / paths[case.fixture, case.scheme, case.world_size, case.accum_steps])
        for name in ("embed", "unembed"):
            assert _rel_err(output.grads[name], v[f"grad_{name}"]) <= RTOL, (case, name)
            assert _rel_err(output.params[0][name], v[f"adamw_{name}"]) <= RTOL, (case, name)
        covered.add((case.impl, case.scheme))
    assert covered == {(impl, s) for impl in plan.impls for s in SCHEMES}
    # seed: (1,1), (1,2), (2,1); packed adds (2,2): every case of the plan came back.
    assert len(run.outputs) == len(plan.cases()) > 50


def test_the_api_refuses_a_non_empty_directory_before_writing_anything(tmp_path):
    (tmp_path / "results.csv").write_text("a user's file")
    with pytest.raises(ExportDirectoryError, match=r"is not empty \(it holds results\.csv\)"):
        export_vectors(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]
    with pytest.raises(ExportDirectoryError, match="is a file, not a directory"):
        export_vectors(tmp_path / "results.csv", force=True)


def test_every_trainer_mode_is_reproduced_from_its_spec_in_the_manifest(exported):
    directory, _, manifest = exported
    checked = 0
    for fx, vectors in _by_fixture(directory, manifest).values():
        for record in vectors:
            if record["scheme"] in SCHEMES:
                continue
            v = _load(directory / record["path"])
            spec = manifest["schemes"][record["scheme"]]["spec"]
            c, (D,) = spec_weights(fx, spec, record["R"], record["M"])
            # counts are exact; a weight or power sum rounds a few times, well inside RTOL
            assert abs(D - float(v["denominator"])) <= RTOL * abs(D), record["path"]
            assert _rel_err(c, v["token_weights"]) <= RTOL, record["path"]
            checked += 1
    assert checked == sum(v["scheme"] not in SCHEMES for v in manifest["vectors"]) > 300


def test_objective_vectors_hold_what_the_manifest_says(exported):
    """Each objective file against the manifest's own statement: the total is the sum of its
    terms' coefficient x L_k, the counts are what the fixture file's arrays count, an
    update-scope term's D is its count (token means) and the aux objective is the same at
    every layout (every term over the whole update)."""
    directory, _, manifest = exported
    terms = {n: o["terms"] for n, o in manifest["objective"]["objectives"].items()}
    fixtures = {r["name"]: _load(directory / r["path"]) for r in manifest["fixtures"]}
    by_case = {}
    for record in manifest["objective_vectors"]:
        v = _load(directory / record["path"])
        fx = fixtures[record["fixture"]]
        valid = fx["targets"] != IGNORE
        shifted = np.zeros_like(valid)  # mtp: the next target of the same row and segment
        same = fx["segment_ids"][:, 1:] == fx["segment_ids"][:, :-1]
        shifted[:, :-1] = valid[:, 1:] & same
        counts = {"ce": valid.sum(), "mtp": shifted.sum(), "moe_lb": (fx["segment_ids"] > 0).sum()}
        total = math.fsum(
            t.get("coefficient", 1.0) * float(v[f"term{k}_loss"])
            for k, t in enumerate(terms[record["objective"]])
        )
        assert abs(total - float(v["loss"])) <= RTOL * abs(total), record["path"]
        for k, t in enumerate(terms[record["objective"]]):
            want = counts.get(t["kind"], valid.sum())
            assert int(v[f"term{k}_count"]) == want, (record["path"], t)
            if t["kind"] != "moe_lb" and not t.get("scheme"):
                assert v[f"term{k}_denominators"].tolist() == [float(want)]
        by_case.setdefault((record["fixture"], record["objective"]), []).append(v)
    assert len(manifest["objective_vectors"]) == 2 * 2 * 6  # objectives x fixtures x layouts
    for (fixture, objective), vectors in by_case.items():
        if objective == "aux":
            for v in vectors[1:]:
                for key in ("grad_embed", "grad_router", "grad_mtp_unembed"):
                    assert _rel_err(v[key], vectors[0][key]) <= RTOL, (fixture, key)


def test_torch_and_jax_reproduce_the_objective_vectors(exported):
    """The frameworks' multi-term references against the exported files, (2, 2) and (4, 1)."""
    from crosscheck.launch.schedule import run_jobs
    from crosscheck.run import objective_jax, objective_torch
    from crosscheck.run.objectives import ObjectiveCase

    directory, _, manifest = exported
    paths = {
        (r["fixture"], r["objective"], r["R"], r["M"]): r["path"]
        for r in manifest["objective_vectors"]
    }
    cases = [
        ObjectiveCase(impl, objective, "packed", R, M)
        for impl in (objective_jax.IMPL, objective_torch.IMPL)
        for objective in ("aux", "aux-local")
        for R, M in ((2, 2), (4, 1))
    ]
    outputs = {}
    jobs = [
        *objective_jax.jobs(
            [c for c in cases if c.impl == objective_jax.IMPL], outputs.__setitem__
        ),
        *objective_torch.jobs(
            [c for c in cases if c.impl == objective_torch.IMPL], outputs.__setitem__
        ),
    ]
    run_jobs(jobs)
    assert set(outputs) == set(cases)
    for case, output in outputs.items():
        assert not isinstance(output, BaseException), (case, output)
        v = _load(
            directory / paths[case.fixture, case.objective, case.world_size, case.accum_steps]
        )
        for name, grad in output.grads.items():
            assert _rel_err(grad, v[f"grad_{name}"]) <= RTOL, (case, name)
        for k, term in enumerate(output.terms):
            assert term.count == int(v[f"term{k}_count"]), (case, term.name)
            assert abs(term.loss - float(v[f"term{k}_loss"])) <= RTOL * abs(term.loss)
