"""A training process for tests/test_jax_hardening.py that a test kills in the middle of a save.

``python -m jax_checkpoint_kill save WORK``: runs the uninterrupted baseline (NUM_UPDATES
updates, saved to ``WORK/baseline.npz``), then the run to be killed: it stops inside update 2
after one microbatch and checkpoints to ``WORK/ckpt-a`` (the previous checkpoint), continues to
the end of update 2 and starts saving ``WORK/ckpt-b``. That save blocks once orbax has written
every file into its temporary directory, right before the rename that finalizes it, after
writing the temporary directory's path to ``WORK/saving``: the test SIGKILLs the process there.

``python -m jax_checkpoint_kill resume WORK``: in a fresh process, restores ``ckpt-a``, runs on
to NUM_UPDATES and writes the params to ``WORK/resumed.npz``; and records in ``WORK/refused.json``
what restoring ``ckpt-b`` (which never got finalized) and its temporary directory says.

float32 without x64, pmap at (R, M) = (2, 2), AdamW with clipping, as the harness resumes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from crosscheck.contract.cases import TrainSettings
from crosscheck.run.jax_resume import _config, _numpy, _optimizer, _problem

FIXTURE, SCHEME, STRATEGY, R, M, DTYPE = "packed", "token_mean", "precount", 2, 2, "float32"
NUM_UPDATES = 3


def _loop():
    from jax_impl.resume import ResumableLoop

    settings = TrainSettings(num_updates=NUM_UPDATES)
    return ResumableLoop(_config(SCHEME, STRATEGY, settings, _optimizer(settings)), R, M)


def _block_before_the_rename(final: Path, saving: Path) -> None:
    """Make orbax's finalize of `final` (the rename of its temporary directory, after every
    item in it was written and finalized) wait for the kill."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def blocking_finalize(self) -> None:
        if Path(self.get_final()) != final:  # an item inside the checkpoint: as usual
            return await finalize(self)
        saving.write_text(str(self.get()))
        time.sleep(600)

    atomicity.AtomicRenameTemporaryPath.finalize = blocking_finalize


def save(work: Path) -> None:
    from jax_impl.resume import save_train_state

    loop = _loop()
    batch, params0, fingerprint = _problem(FIXTURE, R, M, DTYPE)
    baseline = loop.run(loop.init(params0), batch, until_updates=NUM_UPDATES)
    np.savez(work / "baseline.npz", **_numpy(baseline.params))
    state = loop.run(loop.init(params0), batch, until_updates=1, then_microbatches=1)
    save_train_state(work / "ckpt-a", loop, state, fingerprint)
    state = loop.run(state, batch, until_updates=2)
    _block_before_the_rename(work.absolute() / "ckpt-b", work / "saving")
    save_train_state(work / "ckpt-b", loop, state, fingerprint)
    raise SystemExit("the save of ckpt-b was to be killed, not to finish")


def resume(work: Path) -> None:
    from jax_impl.checkpoint import CheckpointError
    from jax_impl.resume import restore_train_state

    loop = _loop()
    batch, params0, fingerprint = _problem(FIXTURE, R, M, DTYPE)
    state = restore_train_state(work / "ckpt-a", loop, params0, fingerprint)
    state = loop.run(state, batch, until_updates=NUM_UPDATES)
    np.savez(work / "resumed.npz", **_numpy(state.params))
    refused = {}
    for name in ("ckpt-b", Path(work / "saving").read_text()):
        try:
            restore_train_state(work / name, loop, params0, fingerprint)
            refused[Path(name).name] = "restored"
        except CheckpointError as error:
            refused[Path(name).name] = str(error)
    (work / "refused.json").write_text(json.dumps(refused))


if __name__ == "__main__":
    {"save": save, "resume": resume}[sys.argv[1]](Path(sys.argv[2]))
