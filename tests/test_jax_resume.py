"""Checkpoint resume of the JAX reference (pmap + orbax): stop, save, restart fresh, continue.

Every case of the resume grid (tests/resume_grid.py, the torch reference's grid too) runs three
AdamW updates with clipping in float64, stops after update 1 or inside update 2 after some of
its microbatches, saves an orbax checkpoint, resumes in a fresh process (at the same layout, or
between updates at another layout of the same global batch), and compares the params after
update 3 with an uninterrupted run of the reference pmap step and with the oracle's.

The grid goes through `crosscheck.run.jax_resume.run_resume`: one worker process stops every
case (and runs the baselines), a second one resumes every case. Around it, in this process
(float32: x64 is global and stays off here): an unfinalized checkpoint is never restored, a
mid-accumulation checkpoint refuses another layout, and a resume that lost its partial
gradient is caught by the same comparison (the comparison can fail).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from resume_grid import NUM_UPDATES, SCENARIOS, resume_case, resume_grid

from crosscheck import FLOAT64_RTOL, builtin_fixture, tree_rel_err
from crosscheck.contract.cases import ResumeCase, ResumeOutput, TrainSettings
from crosscheck.contract.fixture import BATCH_KEYS
from crosscheck.contract.optimizers import train
from crosscheck.run.jax_resume import run_resume

SETTINGS = TrainSettings(num_updates=NUM_UPDATES)
CASES = resume_grid("jax-pmap")


@pytest.fixture(scope="module")
def outputs() -> dict[ResumeCase, ResumeOutput | BaseException]:
    assert jax.device_count() >= 8, "tests/conftest.py must give this process 8 CPU devices"
    done: dict[ResumeCase, ResumeOutput | BaseException] = {}
    run_resume(CASES, SETTINGS, lambda case, out: done.__setitem__(case, out))
    return done


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe().replace(" ", "_"))
def test_resume_matches_uninterrupted_and_oracle(outputs, case: ResumeCase) -> None:
    out = outputs[case]
    if isinstance(out, BaseException):
        raise out
    oracle = train(
        builtin_fixture(case.fixture),
        case.scheme,
        case.world_size,
        case.accum_steps,
        num_updates=NUM_UPDATES,
        optimizer=SETTINGS.optimizer,
        max_grad_norm=SETTINGS.max_grad_norm,
        clip_convention="optax",
    )[-1].params
    # float64, 1e-12: a resume recomputes the same sums in the same order (the scan carry of the
    # second part starts from the saved first-part sums), and the reference step differs only
    # by XLA's fusion of a handful of reductions; anything near 1e-12 is a lost or doubled term.
    resumed_vs_run = tree_rel_err(out.resumed, out.uninterrupted)
    assert resumed_vs_run.max_rel_err <= FLOAT64_RTOL, resumed_vs_run.describe()
    # The oracle's result does not depend on the layout for intended schemes, so one (R, M)
    # serves a resume at another layout too; same float64 tolerance for the same reason.
    resumed_vs_oracle = tree_rel_err(out.resumed, oracle)
    assert resumed_vs_oracle.max_rel_err <= FLOAT64_RTOL, resumed_vs_oracle.describe()


def test_unsupported_impl_is_refused_by_name() -> None:
    got = {}
    case = resume_case("jax-shard_map", "packed", "token_mean", "precount", SCENARIOS[0])
    run_resume([case], SETTINGS, lambda c, out: got.__setitem__(c, out))
    assert isinstance(got[case], ValueError) and "pmap only" in str(got[case])


# ---- in this process, float32 ----------------------------------------------------------------


@pytest.fixture(scope="module")
def f32():
    """A float32 run on `packed` (postnorm) stopped inside update 2 after 1 of 2 microbatches
    at (2, 2), its checkpoint, and the uninterrupted run's params after update 3."""
    import jax_impl
    from jax_impl.checkpoint import batch_fingerprint
    from jax_impl.resume import ResumableLoop

    assert not jax.config.jax_enable_x64, "x64 must stay off in the pytest process"
    fixture = builtin_fixture("packed")
    global_batch = {k: np.asarray(getattr(fixture, k)) for k in BATCH_KEYS}
    c = SETTINGS.optimizer
    optimizer = optax.adamw(
        c.learning_rate, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay
    )
    config = jax_impl.StepConfig(
        optimizer=optimizer,
        scheme="token_mean",
        strategy="postnorm",
        max_grad_norm=SETTINGS.max_grad_norm,
    )
    loop = ResumableLoop(config, 2, 2)
    batch = jax_impl.lay_out_global_batch(
        global_batch, 2, 2, vocab_size=fixture.vocab_size, weights_dtype=np.float32
    )
    params0 = jax_impl.params_from_numpy(fixture.params(), np.float32)
    full = loop.run(loop.init(params0), batch, until_updates=NUM_UPDATES)
    stopped = loop.run(loop.init(params0), batch, until_updates=1, then_microbatches=1)
    return {
        "loop": loop,
        "batch": batch,
        "params0": params0,
        "fingerprint": batch_fingerprint(global_batch),
        "full": {k: np.asarray(v) for k, v in full.params.items()},
        "stopped": stopped,
    }


def _save(f32, path: Path) -> Path:
    from jax_impl.resume import save_train_state

    return save_train_state(path, f32["loop"], f32["stopped"], f32["fingerprint"])


def _restore(f32, path: Path, loop=None):
    from jax_impl.resume import restore_train_state

    loop = loop or f32["loop"]
    return restore_train_state(path, loop, f32["params0"], f32["fingerprint"])


def _finish(f32, state) -> dict[str, np.ndarray]:
    state = f32["loop"].run(state, f32["batch"], until_updates=NUM_UPDATES)
    return {k: np.asarray(v) for k, v in state.params.items()}


# float32, 1e-5: the resumed and the uninterrupted run execute the same programs on the same
# values, so they agree to float32 rounding of a few reductions at most.
F32_RTOL = 1e-5


def test_mid_window_resume_in_process_and_dropped_partial_is_caught(f32, tmp_path) -> None:
    path = _save(f32, tmp_path / "ckpt")
    restored = _restore(f32, path)
    assert restored.updates_done == 1 and restored.partial.done == 1
    assert tree_rel_err(_finish(f32, restored), f32["full"]).max_rel_err <= F32_RTOL
    # The mutant: a resume that lost the saved partial gradient (zeros instead) must miss by
    # far more than the tolerance, or the comparison above proves nothing.
    p = restored.partial
    dropped = restored._replace(
        partial=p._replace(grad_sums={k: np.zeros_like(v) for k, v in p.grad_sums.items()})
    )
    err = tree_rel_err(_finish(f32, dropped), f32["full"]).max_rel_err
    assert err > 1e3 * F32_RTOL, f"dropping the partial gradient went unnoticed ({err:.2e})"


def test_unfinalized_checkpoint_is_never_restored(f32, tmp_path) -> None:
    from orbax.checkpoint.path import step

    from jax_impl.checkpoint import CheckpointError

    good = _save(f32, tmp_path / "good")
    # What a save killed before orbax's final rename leaves: a complete-looking temporary dir.
    partial = tmp_path / f"ckpt{step.TMP_DIR_SUFFIX}-1234567890"
    shutil.copytree(good, partial)
    with pytest.raises(CheckpointError, match="no checkpoint there; only unfinalized save"):
        _restore(f32, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="unfinalized orbax checkpoint"):
        _restore(f32, partial)
    # A truncated temporary dir (some files never written) is refused the same way.
    shutil.rmtree(partial / "state")
    with pytest.raises(CheckpointError, match="unfinalized"):
        _restore(f32, partial)
    assert _restore(f32, good).partial.done == 1  # the finalized one is still fine


def test_mid_window_checkpoint_refuses_another_layout(f32, tmp_path) -> None:
    from jax_impl.checkpoint import CheckpointError
    from jax_impl.resume import ResumableLoop, restore_train_state, scheme_label

    path = _save(f32, tmp_path / "ckpt")
    other = ResumableLoop(f32["loop"].config, 1, 4)
    with pytest.raises(CheckpointError, match=r"resumes only at R=2,M=2 \(not R=1,M=4\)"):
        _restore(f32, path, other)
    loop, params0 = f32["loop"], f32["params0"]
    # Rewritten: restore lost its scheme argument (the loop's StepConfig holds the scheme), so
    # another scheme is now a loop built with another scheme spec (at the same layout).
    summing = ResumableLoop(dataclasses.replace(loop.config, scheme="sum"), 2, 2)
    saved, here = (scheme_label(s) for s in (loop.config.scheme, summing.config.scheme))
    refused = re.escape(f"checkpoint has scheme={saved!r}, this run scheme={here!r}")
    with pytest.raises(CheckpointError, match=refused):
        restore_train_state(path, summing, params0, f32["fingerprint"])
    with pytest.raises(CheckpointError, match="batch_fingerprint"):
        restore_train_state(path, loop, params0, "another batch")
