"""Checkpoint resume of the torch reference: stop, save, restart in fresh processes, continue.

Every case of the resume grid (tests/resume_grid.py, the JAX reference's grid too) runs three
AdamW updates with clipping in float64, stops after update 1 or inside update 2 after some of
its microbatches, saves a checkpoint, resumes in a fresh launch (at the same layout, or between
updates at another layout of the same global batch), and compares the params after update 3
with an uninterrupted run's and with the oracle's.

It runs through the harness's `run_resume` (crosscheck.run.torch_runner): one round of
launches to stop (one per world size: 1, 2), one to resume (1, 2, 4). Spawning ranks is most of
the time, so the mutants ride in the grid's own round-2 launch: resumes from copies of a
mid-accumulation checkpoint with the partial gradient or partial sums dropped, which must miss
by far more than the tolerance (the comparison can fail). Around the grid, in one process: a
save that dies midway is never picked up, a damaged checkpoint is refused by name, and a
mid-accumulation checkpoint refuses another layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_grid import NUM_UPDATES, SCENARIOS, STRATEGIES, resume_case, resume_grid
from torch_world import ADAMW, MAX_GRAD_NORM, adamw_spec, oracle_updates

from crosscheck import FLOAT64_RTOL, assert_tree_close, builtin_fixture, tree_rel_err
from crosscheck.contract.cases import ResumeCase, ResumeOutput, TrainSettings
from crosscheck.run.torch_runner import run_resume
from torch_impl import checkpoint
from torch_impl.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from torch_impl.harness import launcher
from torch_impl.model import BilinearLM
from torch_impl.optimizers import make_optimizer
from torch_impl.partial import PartialAccumulation
from torch_impl.resume import load_checkpoint, restore
from torch_impl.spec import get_spec

SETTINGS = TrainSettings(num_updates=NUM_UPDATES, optimizer=ADAMW, max_grad_norm=MAX_GRAD_NORM)
GRID = resume_grid("torch-ddp")


def case_id(case: ResumeCase) -> str:
    return (
        f"{case.fixture}-{case.scheme}-{case.strategy}-R{case.world_size}M{case.accum_steps}"
        f"-stop1+{case.stop_after_microbatches}-R{case.resume_world_size}M{case.resume_accum_steps}"
    )


# --- Mutants: what a resume that lost part of the partial accumulation would compute -------


def _drop_grads(state: dict) -> None:
    state["grads"] = {}


def _drop_sums(state: dict) -> None:
    state["partial"].update(local_denominator=0.0, local_loss_sum=0.0, local_valid_tokens=0)


#: Stopped at (1, 4) after update 1 + 1 microbatch. Both strategies recompute the update's
#: plan from the labels on resume (a rank's share of D rides on its last microbatch), so the
#: partial sums feed only the logged objective: dropping them must not move the params, and
#: dropping the partial gradient must.
MUTANT_SOURCE = {
    s: resume_case("torch-ddp", "ragged", "token_mean", s, SCENARIOS[2]) for s in STRATEGIES
}
MUTANTS = {
    ("precount", "no-partial-grad"): _drop_grads,
    ("postnorm", "no-partial-grad"): _drop_grads,
    ("postnorm", "no-partial-sums"): _drop_sums,
}
#: The mutants that lose part of the update's gradient, as opposed to its logged sums.
LOSES_GRADIENT = {("precount", "no-partial-grad"), ("postnorm", "no-partial-grad")}


def _rewrite(source: Path, target: Path, edit) -> None:
    """A copy of a checkpoint with `edit` applied to every rank's state, checksums renewed.

    This is what a save that forgot part of the state would have written: it loads cleanly.
    """
    shutil.copytree(source, target)
    manifest = json.loads((target / checkpoint.MANIFEST).read_text())
    for entry in manifest["ranks"]:
        path = target / entry["file"]
        state = torch.load(path, weights_only=True)
        edit(state)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        path.write_bytes(buffer.getvalue())
        entry["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
        entry["bytes"] = len(buffer.getvalue())
    (target / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _mutant_source(update_case) -> str | None:
    """The strategy of a round-2 resume that continues a mutant source's checkpoint, or None."""
    if update_case.resume_from is None or get_spec(update_case.scheme).name != "token_mean":
        return None
    manifest = checkpoint.read_manifest(update_case.resume_from)
    ragged = builtin_fixture("ragged").targets
    source = MUTANT_SOURCE[update_case.strategy]
    stopped_at = (manifest.world_size, manifest.accum_steps, manifest.microbatches_done)
    same_batch = np.array_equal(update_case.batch["targets"], ragged)
    if same_batch and stopped_at == (1, 4, source.stop_after_microbatches):
        return update_case.strategy
    return None


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """run_resume over the grid; mutant resumes ride in the launch that resumes their source.

    Returns (ResumeCase -> output or error, (strategy, mutant) -> final params).
    """
    outputs: dict[ResumeCase, ResumeOutput | BaseException] = {}
    mutated: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    workdir = tmp_path_factory.mktemp("mutants")
    real_launch = launcher.launch

    def launch_with_mutants(fn, world_size, args, **kwargs):
        (update_cases,) = args
        extra = []
        for update_case in update_cases:
            strategy = _mutant_source(update_case)
            for (mutant_strategy, name), edit in MUTANTS.items():
                if strategy != mutant_strategy:
                    continue
                copy = workdir / f"{name}-{strategy}"
                _rewrite(Path(update_case.resume_from), copy, edit)
                mutant = dataclasses.replace(update_case, label=name, resume_from=str(copy))
                extra.append(((strategy, name), mutant))
        per_rank = real_launch(fn, world_size, ([*update_cases, *(c for _, c in extra)],), **kwargs)
        for index, (key, _) in enumerate(extra, start=len(update_cases)):
            mutated[key] = per_rank[0][index].updates[-1].params
        return [rank_outputs[: len(update_cases)] for rank_outputs in per_rank]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "launch", launch_with_mutants)
        run_resume(GRID, SETTINGS, outputs.__setitem__)
    return outputs, mutated


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_resume_matches_uninterrupted_and_oracle(resumed, case: ResumeCase) -> None:
    output = resumed[0][case]
    if isinstance(output, BaseException):
        raise output
    # float64, 1e-12 (docs/contract.md): a resume at the saved layout replays the uninterrupted
    # run's operations in the same order (measured: bit-identical); one at another layout reorders
    # the gradient sums of updates 2 and 3, and the oracle is independent code for the same math.
    # Either way only rounding (~1e-16 per operation) separates them, while a dropped microbatch or
    # a wrong D moves the params by > 1e-6 (test_dropped_partial_state_misses).
    what = case.describe()
    assert_tree_close(
        output.resumed, output.uninterrupted, FLOAT64_RTOL, f"{what} vs uninterrupted"
    )
    # The oracle's params after NUM_UPDATES AdamW updates, clipped as clip_grad_norm_ clips.
    records = oracle_updates(
        case.fixture, case.scheme, case.world_size, case.accum_steps, NUM_UPDATES
    )
    expected = records[-1].params
    assert_tree_close(output.resumed, expected, FLOAT64_RTOL, f"{what} vs oracle")


def test_every_case_reported(resumed) -> None:
    assert set(resumed[0]) == set(GRID) and len(GRID) == 72


@pytest.mark.parametrize("mutant", list(MUTANTS), ids="-".join)
def test_dropped_partial_state_misses(resumed, mutant: tuple[str, str]) -> None:
    """Resuming without microbatch 0's gradient must not pass as exact; without the partial
    sums (which only the logged objective reads: D is recomputed from the labels) the params
    are the uninterrupted run's."""
    outputs, mutated = resumed
    strategy, name = mutant
    assert mutant in mutated, f"the {name} mutant of {strategy} never ran"
    err = tree_rel_err(mutated[mutant], outputs[MUTANT_SOURCE[strategy]].uninterrupted)
    if mutant in LOSES_GRADIENT:
        # Update 2 lost a quarter of the batch's gradient: the params move by orders of
        # magnitude more than rounding (1e-12).
        assert err.max_rel_err > 1e-6, f"{strategy} {name} went unnoticed: {err.describe()}"
    else:
        # The same operations in the same order as the uninterrupted run: bit for bit.
        assert err.max_rel_err == 0.0, f"{strategy} {name} moved the params: {err.describe()}"


def test_cases_the_reference_cannot_resume_are_reported_not_run() -> None:
    base = resume_case("torch-ddp", "ragged", "token_mean", "precount", SCENARIOS[0])
    unsupported = [
        dataclasses.replace(base, impl="torch-fsdp2"),
        dataclasses.replace(base, scheme="rank_mean"),
    ]
    reports: dict[ResumeCase, ResumeOutput | BaseException] = {}
    run_resume(unsupported, SETTINGS, reports.__setitem__)
    assert set(reports) == set(unsupported)
    assert "DDP only" in str(reports[unsupported[0]])
    assert "intended schemes" in str(reports[unsupported[1]])


# --- Atomic saves, and loads that name what is wrong (one process, no process group) ---------


class _Crash(BaseException):
    """Stands in for the process dying: no `except Exception` in the save can catch it."""


def _model_and_optimizer(seed: float = 0.1) -> tuple[BilinearLM, torch.optim.Optimizer]:
    """The packed fixture's model after one AdamW step, so the optimizer has moments."""
    model = BilinearLM.from_numpy(builtin_fixture("packed").params())
    optimizer = make_optimizer(model.parameters(), adamw_spec())
    for index, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, seed * (index + 1))
    optimizer.step()
    return model, optimizer


def _save(directory: Path, updates_done: int, partial: PartialAccumulation | None = None) -> Path:
    model, optimizer = _model_and_optimizer()
    if partial is not None:
        for param in model.parameters():
            param.grad = torch.linspace(-1.0, 1.0, param.numel(), dtype=param.dtype).view_as(param)
    return save_checkpoint(
        directory,
        model,
        optimizer,
        updates_done=updates_done,
        accum_steps=4,
        strategy="postnorm",
        scheme="token_mean",
        partial=partial,
    )


def _load(directory: Path, world_size=1, accum_steps=4, rank=0, strategy="postnorm"):
    return load_checkpoint(
        directory,
        rank=rank,
        world_size=world_size,
        accum_steps=accum_steps,
        strategy=strategy,
        scheme="token_mean",
        dtype="float64",
    )


PARTIAL = PartialAccumulation(
    strategy="postnorm",
    microbatches_done=1,
    local_denominator=37.0,
    local_loss_sum=101.5,
    local_valid_tokens=37,
)


def _half_written(path: Path, state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    raise _Crash


@pytest.mark.parametrize(
    "crash_point", ["_write_rank_file", "_write_manifest", "_commit"], ids=lambda p: p.strip("_")
)
def test_a_save_that_dies_is_never_picked_up(tmp_path, monkeypatch, crash_point: str) -> None:
    _save(tmp_path / "update-1", updates_done=1)

    def crash(*args, **kwargs):
        if crash_point == "_write_rank_file":
            _half_written(*args)  # a truncated rank file on disk, then death
        raise _Crash

    with monkeypatch.context() as patched:
        patched.setattr(checkpoint, crash_point, crash)
        with pytest.raises(_Crash):
            _save(tmp_path / "update-2", updates_done=2, partial=PARTIAL)
    assert checkpoint.staging_path(tmp_path / "update-2").is_dir()  # the debris is there...
    assert latest_checkpoint(tmp_path) == tmp_path / "update-1"  # ...and is never chosen
    with pytest.raises(CheckpointError, match="a save that did not finish"):
        _load(tmp_path / "update-2")
    with pytest.raises(CheckpointError, match="staging directory of an unfinished save"):
        _load(checkpoint.staging_path(tmp_path / "update-2"))
    # The next save of that name clears the debris and commits.
    _save(tmp_path / "update-2", updates_done=2, partial=PARTIAL)
    assert latest_checkpoint(tmp_path) == tmp_path / "update-2"
    assert _load(tmp_path / "update-2").partial == PARTIAL


def test_round_trip_restores_params_moments_and_partial_gradient(tmp_path) -> None:
    model, optimizer = _model_and_optimizer()
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    save_checkpoint(
        tmp_path / "c",
        model,
        optimizer,
        updates_done=1,
        accum_steps=4,
        strategy="postnorm",
        scheme="token_mean",
        partial=PARTIAL,
    )
    fresh, fresh_optimizer = _model_and_optimizer(seed=0.7)  # different params and moments
    partial = restore(_load(tmp_path / "c"), fresh, fresh_optimizer)
    assert partial == PARTIAL
    for name, param in fresh.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name
        assert torch.equal(param.grad, grads[name]), name
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for index in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[index][key], loaded[index][key]), (index, key)


def test_damaged_checkpoints_are_refused_by_name(tmp_path) -> None:
    directory = _save(tmp_path / "c", updates_done=1)
    with pytest.raises(CheckpointError, match="already exists"):
        _save(directory, updates_done=1)
    rank_file = directory / "rank-00000.pt"
    payload = rank_file.read_bytes()
    rank_file.write_bytes(payload[:-100])
    with pytest.raises(CheckpointError, match=r"rank-00000\.pt is truncated or altered"):
        _load(directory)
    rank_file.unlink()
    with pytest.raises(CheckpointError, match=r"missing rank file\(s\) rank-00000\.pt"):
        _load(directory)
    (directory / checkpoint.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        _load(directory)
    assert latest_checkpoint(tmp_path) is None


def test_mid_accumulation_resume_keeps_its_layout(tmp_path) -> None:
    between = _save(tmp_path / "between", updates_done=1)
    inside = _save(tmp_path / "inside", updates_done=1, partial=PARTIAL)
    # Between updates the state is replicated: any world size reads it (rank r <- r mod R).
    assert _load(between, world_size=4, accum_steps=1, rank=3).source_rank == 0
    assert _load(inside).partial == PARTIAL
    for world_size, accum_steps in ((4, 1), (1, 2)):
        with pytest.raises(CheckpointError) as refused:
            _load(inside, world_size=world_size, accum_steps=accum_steps)
        message = str(refused.value)
        assert "stopped inside an update (after update 1 + 1 of 4 microbatches" in message
        assert "from a checkpoint taken between updates" in message
        if world_size != 1:
            assert "world_size saved 1, asked 4" in message
        assert f"accum_steps saved 4, asked {accum_steps}" in message
    with pytest.raises(CheckpointError, match="strategy saved 'postnorm', asked 'precount'"):
        _load(inside, strategy="precount")
