"""User fixture files (.npz) and exported vector files: accepted by path, refused by name.

`crosscheck.fixtures.builtin.builtin_fixture` is the lookup `run`, `verify` and `bugs` use: given a
path (a name ending in .npz or holding a separator) it loads the file, resolved to an absolute
path so that workers started elsewhere find it, and validates it as a built-in. Every broken
file here is a real file written in tmp_path: truncated at several lengths, a key missing or
extra, a wrong shape, dtype or value, damaged bytes. Each error must name the file and what is
wrong. The vector readers (`crosscheck.fixtures.vectors_read.read_manifest`,
`read_vector_file`) get the same treatment: a truncated file or a manifest without a key is
named with the file and key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from child_env import run_cli

from crosscheck.contract.fixture import NPZ_KEYS, Fixture, FixtureError
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.contract.row_fields import ROW_FIELD_KEYS
from crosscheck.fixtures.builtin import builtin_fixture, fixture_reference, is_fixture_path
from crosscheck.fixtures.vectors import MANIFEST_NAME, export_vectors
from crosscheck.fixtures.vectors_read import VectorFileError, read_manifest, read_vector_file


def _arrays(name: str = "packed") -> dict[str, np.ndarray]:
    fixture = builtin_fixture(name)
    return {key: np.array(getattr(fixture, key)) for key in NPZ_KEYS}


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


# ---- a good file is a fixture like any other ---------------------------------------------------


def test_a_path_is_loaded_validated_and_resolved(tmp_path: Path, monkeypatch) -> None:
    path = builtin_fixture("packed").save(tmp_path / "mine.npz")
    monkeypatch.chdir(tmp_path)
    loaded = builtin_fixture("mine.npz")  # relative: resolved against the working directory
    # Named by the reference, like a built-in: the harness keys its rows by what it was given.
    assert loaded.name == "mine.npz"
    assert builtin_fixture("mine.npz") is loaded  # cached while the file is unchanged
    absolute = builtin_fixture(str(path))
    assert absolute.name == str(path) and builtin_fixture(absolute.name) is absolute
    assert builtin_fixture(path).name == str(path)  # a Path object is a path too
    for key in NPZ_KEYS:
        assert getattr(loaded, key).tobytes() == getattr(builtin_fixture("packed"), key).tobytes()
    # What a worker is handed: absolute, so another working directory finds the same file.
    assert fixture_reference("mine.npz") == str(path.resolve())
    assert fixture_reference("./sub/../mine.npz") == str(path.resolve())
    assert fixture_reference("packed") == "packed"
    # The oracle runs on it as on the built-in it copies.
    np.testing.assert_array_equal(
        loss_and_grad(loaded, "token_mean", 2, 2).grads["embed"],
        loss_and_grad(builtin_fixture("packed"), "token_mean", 2, 2).grads["embed"],
    )


def test_what_counts_as_a_path() -> None:
    assert (
        is_fixture_path("mine.npz") and is_fixture_path("data/mine") and is_fixture_path(Path("x"))
    )
    assert not is_fixture_path("packed") and not is_fixture_path("empty-rank")


def test_a_rewritten_file_is_read_again(tmp_path: Path) -> None:
    path = builtin_fixture("packed").save(tmp_path / "mine.npz")
    first = builtin_fixture(str(path))
    replacement = builtin_fixture("soft-weights").save(tmp_path / "other.npz")
    os.replace(replacement, path)  # renamed over it: another inode
    assert builtin_fixture(str(path)).weights.tobytes() == (
        builtin_fixture("soft-weights").weights.tobytes()
    )
    assert first.weights.tobytes() == builtin_fixture("packed").weights.tobytes()


def test_the_lookups_of_run_verify_and_the_jax_worker_accept_the_path(tmp_path: Path) -> None:
    """The plan (run), verify's job list and the JAX verify worker's own lookup."""
    from crosscheck.run.plan import Plan
    from crosscheck.verification.jax_verify_worker import _fixture
    from crosscheck.verification.verifier import jobs_for

    path = str(builtin_fixture("ragged").save(tmp_path / "user-ragged.npz"))
    Plan(fixtures=[path], resume_fixtures=[path]).validate()
    jobs = jobs_for([path], None, None, "float64")
    assert jobs and {job.fixture for job in jobs} == {path}
    assert _fixture(path).targets.tobytes() == builtin_fixture(path).targets.tobytes()
    with pytest.raises(FixtureError, match="cannot be read"):
        Plan(fixtures=[str(tmp_path / "absent.npz")]).validate()


# ---- a broken file is named, with what is wrong -------------------------------------------------


@pytest.mark.parametrize("keep", [0, 3, 100, 0.5, -30])
def test_a_truncated_file_is_named(tmp_path: Path, keep: float) -> None:
    path = builtin_fixture("packed").save(tmp_path / "cut.npz")
    size = path.stat().st_size
    length = int(size * keep) if isinstance(keep, float) else (keep if keep >= 0 else size + keep)
    with open(path, "r+b") as f:
        f.truncate(length)
    with pytest.raises(FixtureError) as failure:
        builtin_fixture(str(path))
    message = str(failure.value)
    assert message.startswith(
        f"fixture file {path} is not a readable .npz (truncated, or not a fixture file): "
    ), message


def test_damaged_bytes_inside_a_member_are_named_with_the_key(tmp_path: Path) -> None:
    path = builtin_fixture("packed").save(tmp_path / "damaged.npz")
    data = bytearray(path.read_bytes())
    start = data.index(b"weights.npy")  # the member's header, then its data
    data[start + 400 : start + 408] = b"\xff" * 8  # inside weights' float data: CRC mismatch
    path.write_bytes(bytes(data))
    with pytest.raises(FixtureError) as failure:
        Fixture.load(path)
    assert str(failure.value).startswith(
        f"fixture file {path}: key 'weights' cannot be read (truncated or damaged file): "
        "BadZipFile: Bad CRC-32"
    )


def test_missing_and_extra_keys_are_named(tmp_path: Path) -> None:
    arrays = _arrays()
    missing = _write(
        tmp_path / "missing.npz", **{k: v for k, v in arrays.items() if k != "weights"}
    )
    with pytest.raises(FixtureError) as failure:
        builtin_fixture(str(missing))
    assert str(failure.value) == (
        f"fixture file {missing}: a fixture .npz holds exactly {list(NPZ_KEYS)}, and "
        "optionally ['group_ids', 'document_ids', 'row_weights', 'sample_mask']; "
        "missing ['weights'], extra []"
    )
    extra = _write(tmp_path / "extra.npz", **arrays, labels=np.zeros(3))
    with pytest.raises(FixtureError, match=r"extra\.npz: .*missing \[\], extra \['labels'\]"):
        builtin_fixture(str(extra))


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"weights": lambda a: a[:, :-1]}, "weights has shape (8, 63), targets have (8, 64)"),
        (
            {"targets": lambda a: a.astype(np.float32)},
            "targets must be an integer array, got float32 holding whole numbers: cast it with "
            ".astype(np.int64)",
        ),
        (
            {"weights": lambda a: (a > 0).astype(np.int8)},
            "weights must be a floating-point array (soft per-token weights), got int8; cast "
            "it with .astype(np.float64)",
        ),
        (
            {"embed": lambda a: a.astype(np.float32)},
            "embed must be a 2-D float64 array, got float32 of shape (40, 12)",
        ),
        ({"unembed": lambda a: a.T}, "unembed must be [H, V] = (12, 40), got (40, 12)"),
        (
            {"unembed": lambda a: np.where(np.arange(40) == 7, np.nan, a)},
            "unembed[0, 7] = nan is not finite",
        ),
        (
            {"targets": lambda a: np.where(np.arange(64) == 2, 40, a) * (np.arange(8) == 1)[:, None]
             + a * (np.arange(8) != 1)[:, None]},
            "target 40 at row 1, position 2 is neither -100 (ignored) nor in the vocabulary "
            "[0, 40)",
        ),
    ],
    ids=["shape", "float-targets", "int-weights", "float32-params", "transposed", "nan-param",
         "target-out-of-vocab"],
)  # fmt: skip
def test_wrong_shapes_dtypes_and_values_name_the_file(tmp_path: Path, change, problem) -> None:
    arrays = _arrays()
    for key, transform in change.items():
        arrays[key] = transform(arrays[key])
    path = _write(tmp_path / "user.npz", **arrays)
    with pytest.raises(FixtureError) as failure:
        builtin_fixture(str(path))
    assert str(failure.value) == f"fixture file {path}: {problem}"


def test_a_missing_file_a_directory_and_an_npy_are_named(tmp_path: Path) -> None:
    absent = tmp_path / "absent.npz"
    with pytest.raises(FixtureError) as failure:
        builtin_fixture(str(absent))
    assert str(failure.value).startswith(
        f"fixture file {absent} cannot be read (No such file or directory); a fixture is a "
        "built-in name (seed, packed, "
    )
    with pytest.raises(FixtureError, match=r"is a directory; a fixture file is an \.npz"):
        Fixture.load(tmp_path)
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(FixtureError, match=r"single\.npy holds a single array \(\.npy\), not an"):
        builtin_fixture(str(single))
    with pytest.raises(ValueError, match="unknown fixture 'pakced'; built-in fixtures: seed"):
        builtin_fixture("pakced")


# ---- exported vectors: read back with the file and key named ----------------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("vectors")
    export_vectors(directory)
    return directory


def _copy(export: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(export, target)
    return target


def test_every_exported_file_reads_back(export: Path) -> None:
    manifest = read_manifest(export)
    for record in manifest["fixtures"]:
        arrays = read_vector_file(export, record, "fixture")
        # v1's six keys, and contract v2's fields where the fixture gives them
        assert set(NPZ_KEYS) <= set(arrays) <= set(NPZ_KEYS) | set(ROW_FIELD_KEYS)
        assert set(arrays) - set(NPZ_KEYS) == set(
            builtin_fixture(record["name"]).explicit_row_fields
        )
    for record in manifest["vectors"]:
        assert "grad_embed" in read_vector_file(export, record, "expected")


def test_a_truncated_vector_file_is_named(export: Path, tmp_path: Path) -> None:
    directory = _copy(export, tmp_path)
    manifest = read_manifest(directory)
    record = manifest["vectors"][5]
    path = directory / record["path"]
    with open(path, "r+b") as f:
        f.truncate(record["bytes"] // 2)
    with pytest.raises(VectorFileError) as failure:
        read_vector_file(directory, record, "expected")
    assert str(failure.value) == (
        f"{path}: {record['bytes'] // 2} bytes, the manifest says {record['bytes']}: the file "
        "is truncated or was replaced"
    )


def test_a_vector_file_without_a_key_is_named(export: Path, tmp_path: Path) -> None:
    """A file rewritten without `denominator`, its manifest record updated to match, so that
    only the key check can catch it."""
    import hashlib

    directory = _copy(export, tmp_path)
    manifest = read_manifest(directory)
    record = dict(manifest["vectors"][0])
    path = directory / record["path"]
    with np.load(path) as archive:
        arrays = {k: archive[k] for k in archive.files if k != "denominator"}
    np.savez(path, **arrays)
    record.update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(VectorFileError) as failure:
        read_vector_file(directory, record, "expected")
    assert str(failure.value) == f"{path}: missing key 'denominator'"


def test_a_manifest_without_a_key_or_cut_short_is_named(export: Path, tmp_path: Path) -> None:
    directory = _copy(export, tmp_path)
    path = directory / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["vectors"][3]["sha256"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(VectorFileError) as failure:
        read_manifest(directory)
    vector = manifest["vectors"][3]["path"]
    assert str(failure.value) == f"{path}: vectors[3] ({vector}) is missing key 'sha256'"
    del manifest["fixtures"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(VectorFileError, match=r"manifest\.json: missing key 'fixtures'$"):
        read_manifest(directory)
    text = (export / MANIFEST_NAME).read_text()
    path.write_text(text[: len(text) // 3])
    with pytest.raises(VectorFileError, match=r"manifest\.json: not valid JSON at line \d+"):
        read_manifest(directory)
    path.unlink()
    with pytest.raises(VectorFileError, match=r"manifest\.json: cannot be read \(No such file"):
        read_manifest(directory)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`crosscheck ARGV`, its tables drawn 300 columns wide (COLUMNS): a fixture's path is
    read whole from a cell, as from a wide log."""
    return run_cli(*argv, cwd=cwd, env={**os.environ, "COLUMNS": "300"}, timeout=300)


def test_run_verify_and_bugs_take_a_fixture_file_from_the_command_line(tmp_path: Path) -> None:
    """A user's .npz, given relative to the working directory, through all three commands;
    a truncated one is a set-up error (exit 2) in one line, before anything runs."""
    repo = Path(__file__).resolve().parents[1]
    mine = tmp_path / "mine.npz"
    builtin_fixture("packed").save(mine)
    run = _cli(
        "run", "--fixtures", "mine.npz", "--impls", "oracle,torch-ddp", "--no-resume",
        "--world-sizes", "2", "--accum-steps", "1,2", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "0 failed" in run.stdout
    step = "examples.torch_torchtitan:step"
    verify = _cli(
        "verify", "--framework", "torch", "--step", step, "--scheme", "token_mean",
        "--fixtures", str(mine), "--world-sizes", "2", "--accum-steps", "2", cwd=repo,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    bugs = _cli(
        "bugs", "--fixtures", "mine.npz", "--frameworks", "torch",
        "--patterns", "rank-mean,missing-world-size", cwd=tmp_path,
    )  # fmt: skip
    assert bugs.returncode == 0, bugs.stdout[-2000:] + bugs.stderr[-2000:]
    assert str(mine) in bugs.stdout and "4 of 4 buggy steps detected and named" in bugs.stdout
    with open(mine, "r+b") as f:
        f.truncate(100)
    cut = _cli("run", "--fixtures", "mine.npz", "--impls", "oracle", cwd=tmp_path)
    assert cut.returncode == 2, cut.stdout[-2000:] + cut.stderr[-2000:]
    assert cut.stdout == ""  # a set-up error: one line on stderr, nothing where results go
    [line] = cut.stderr.splitlines()
    assert line.startswith(f"crosscheck run: fixture file {mine} is not a readable .npz")
