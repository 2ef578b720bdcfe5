"""The launcher never hangs: a failing rank is named, a hung launch times out, both in bounded time.

Each test starts a real two-process gloo group and breaks one rank in the middle of a postnorm
update, after microbatch 0's backward and while rank 0 waits in the gradient all-reduce of the
last microbatch: the situation in which an unbounded launcher would wait forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from crosscheck import builtin_fixture
from crosscheck.launch.processes import usable_cores
from torch_impl.batch import BATCH_KEYS, TokenBatch, rank_microbatches
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.harness.cases import UpdateCase, run_cases
from torch_impl.harness.launcher import LaunchTimeoutError, RankFailedError, launch
from torch_impl.harness.rank_worker import GLOO_LOOP_NICENESS, GLOO_LOOP_THREAD, GLOO_LOOP_WATCH_S
from torch_impl.losses import bilinear_token_losses
from torch_impl.model import BilinearLM
from torch_impl.optimizers import OptimizerSpec
from torch_impl.update import accumulate_postnorm

# Starting the ranks' zygote (its first import of torch) takes 2-10 s on the 2-core CI machine,
# forking two ranks from it well under a second; everything past that is the launcher's own
# detection, immediate for a raise and for a silent death alike (the rank's report file is
# written before it exits, so an exit without one is final), then the stop of the other rank.
FAILURE_BOUND_S = 30.0


def _bad_token_update(rank: int, world_size: int) -> list:
    """An update through the case harness whose rank-1 microbatch 1 has an unknown target."""
    fixture = builtin_fixture("packed")
    batch = {key: np.array(getattr(fixture, key)) for key in BATCH_KEYS}
    batch["targets"][6, 3] = 999  # R = 2, M = 2: rows 6-7 are rank 1's microbatch 1
    case = UpdateCase(
        label="bad-token",
        batch=batch,
        params=fixture.params(),
        scheme="token_mean",
        strategy="postnorm",
        accum_steps=2,
        optimizer=OptimizerSpec(name="sgd", learning_rate=0.1),
    )
    return run_cases(rank, world_size, [case])


def _interrupted_update(rank: int, world_size: int, how: str) -> None:
    """A postnorm update in which rank 1 raises, dies or hangs in microbatch 1 (`how`)."""
    fixture = builtin_fixture("packed")
    ddp = DistributedDataParallel(BilinearLM.from_numpy(fixture.params()))
    state = PostnormState(rank=rank, world_size=world_size)
    ddp.register_comm_hook(state, sum_and_carry_hook)

    def losses(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        if batch.rank == 1 and batch.microbatch == 1:
            if how == "raise":
                raise RuntimeError("injected failure after microbatch 0's backward")
            if how == "exit":
                os._exit(3)  # no traceback, no report: as a segfault or an OOM kill would
            time.sleep(600)
        return bilinear_token_losses(model, batch)

    batch = {key: getattr(fixture, key) for key in BATCH_KEYS}
    microbatches = rank_microbatches(batch, rank, world_size, 2)
    accumulate_postnorm(
        ddp,
        microbatches,
        "token_mean",
        vocab_size=fixture.vocab_size,
        hook_state=state,
        per_token_losses=losses,
    )


def _rank_1_fails(how: str) -> RankFailedError:
    """The error of a 2-rank update whose rank 1 fails `how` after microbatch 0's backward; it
    must come within FAILURE_BOUND_S."""
    start = time.monotonic()
    with pytest.raises(RankFailedError) as failure:
        launch(_interrupted_update, 2, (how,), timeout_s=120)
    elapsed = time.monotonic() - start
    assert elapsed < FAILURE_BOUND_S, f"took {elapsed:.1f} s"
    return failure.value


def test_rank_that_raises_mid_update_is_named() -> None:
    error = _rank_1_fails("raise")
    assert error.rank == 1
    message = str(error)
    assert message.startswith("rank 1 failed")
    assert "RuntimeError: injected failure after microbatch 0's backward" in message


def test_bad_input_is_named_through_the_launcher() -> None:
    with pytest.raises(RankFailedError) as failure:
        launch(_bad_token_update, 2, timeout_s=120)
    assert failure.value.rank == 1
    assert (
        "BatchError: rank 1, microbatch 1, row 0 (global row 6), position 3: "
        "target 999 is neither -100 (ignored) nor in the vocabulary [0, 40)"
    ) in str(failure.value)


def test_rank_that_dies_silently_is_named() -> None:
    error = _rank_1_fails("exit")
    # Rank 0 then fails in the all-reduce; the root cause is still rank 1.
    assert error.rank == 1
    assert "exited with code 3 without reporting a result" in str(error)


def test_hung_rank_hits_the_launch_deadline() -> None:
    timeout_s = 8.0
    start = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as failure:
        # The collective timeout is longer than the launch's, so the deadline is what fires.
        launch(_interrupted_update, 2, ("hang",), timeout_s=timeout_s, collective_timeout_s=120)
    elapsed = time.monotonic() - start
    assert 1 in failure.value.ranks
    assert "did not finish within 8 s" in str(failure.value)
    # The deadline plus the stop (SIGTERM, SIGKILL after 2 s, 2 s for it to land): the
    # launch's stated bound. SIGTERM ends a sleeping rank at once.
    assert elapsed < timeout_s + 4, f"took {elapsed:.1f} s"


def test_launch_rejects_an_empty_world() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch(_bad_token_update, 0)


#: A script that launches a function it defines itself, with what it prints: the ranks import
#: the script (as ``__mp_main__``, its ``__main__`` block not run) to find the function, and
#: what a rank prints reaches the caller's output.
SCRIPT_LAUNCH = """
import sys
from torch_impl.harness.launcher import launch


def shout(rank, world_size, word):
    print(f"rank {rank} says {word}")
    return f"{word}-{rank}-{__name__}"


if __name__ == "__main__":
    print(launch(shout, 2, ("hi",), timeout_s=120))
"""


def test_a_function_of_the_calling_script_runs_on_every_rank_and_its_output_reaches_the_caller(
    tmp_path,
):
    (tmp_path / "script.py").write_text(SCRIPT_LAUNCH)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["rank 0 says hi", "rank 1 says hi"], proc.stdout
    assert lines[2] == "['hi-0-__mp_main__', 'hi-1-__mp_main__']", proc.stdout


#: A module that notes every process importing it, and a function to launch from it.
PRELOAD_PROBE = """
import os

VERSION = {version}
with open(os.path.join(os.path.dirname(__file__), "imports.txt"), "a") as log:
    log.write(f"{{os.getpid()}}\\n")


def where(rank, world_size):
    return os.getpid(), VERSION
"""


def _importers(folder) -> list[int]:
    """Every process but this one that imported the probe, in order."""
    lines = (folder / "imports.txt").read_text().split()
    return [int(pid) for pid in lines if int(pid) != os.getpid()]


def test_preloading_imports_the_users_module_once_for_every_rank_and_afresh_per_block(
    tmp_path, monkeypatch
):
    from torch_impl.harness.launcher import preloading

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "preload_probe.py").write_text(PRELOAD_PROBE.format(version=1))
    import preload_probe

    with preloading(["preload_probe"], timeout_s=60) as zygote:
        assert zygote is not None
        ranks = launch(preload_probe.where, 2, timeout_s=120)
        again = launch(preload_probe.where, 2, timeout_s=120)
    # One import, by the zygote, for the four ranks of two launches.
    assert _importers(tmp_path) == [zygote.pid]
    assert {pid for pid, _ in ranks + again}.isdisjoint({zygote.pid})
    assert [version for _, version in ranks + again] == [1] * 4
    assert not zygote.alive  # closed with its block

    # Edited between two blocks: the next block's zygote imports the new text.
    (tmp_path / "preload_probe.py").write_text(PRELOAD_PROBE.format(version=2))
    with preloading(["preload_probe"], timeout_s=60):
        assert [version for _, version in launch(preload_probe.where, 2)] == [2, 2]
    # Outside a block each rank imports it itself, as before.
    (tmp_path / "imports.txt").write_text("")
    assert [version for _, version in launch(preload_probe.where, 2)] == [2, 2]
    assert len(_importers(tmp_path)) == 2


def test_preloading_a_module_that_cannot_be_imported_leaves_the_error_to_the_ranks(
    tmp_path, monkeypatch
):
    from torch_impl.harness.launcher import preloading

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_probe.py").write_text("raise ImportError('broken at import')\n")
    with preloading(["broken_probe"], timeout_s=60) as zygote:
        assert zygote is None  # no zygote of its own: the ranks fork from the usual one
        with pytest.raises(RankFailedError, match="broken at import"):
            launch(_imports_broken_probe, 2, timeout_s=120)


def _imports_broken_probe(rank: int, world_size: int) -> None:
    import broken_probe  # noqa: F401


def _gloo_loop_niceness() -> list[int]:
    """The niceness of every gloo device loop of this process."""
    values = []
    for name in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{name}/comm") as comm:
            if comm.read().strip() == GLOO_LOOP_THREAD:
                values.append(os.getpriority(os.PRIO_PROCESS, int(name)))
    return values


def _loops_before_and_after_a_subgroup(rank: int, world_size: int) -> tuple[list, list]:
    import torch.distributed as dist

    before = _gloo_loop_niceness()
    subgroup = dist.new_group(list(range(world_size)))  # a device, and its loop, of its own
    dist.barrier(group=subgroup)
    # The watch looks every GLOO_LOOP_WATCH_S; three of them leave it two full looks.
    time.sleep(3 * GLOO_LOOP_WATCH_S)
    return before, _gloo_loop_niceness()


def test_every_gloo_device_loop_of_a_rank_runs_at_the_lowest_priority() -> None:
    """A spinning loop must yield its core (`rank_worker.lower_gloo_loops`): the default group's
    loop from the start of `fn`, a subgroup's within the watch's interval. None found fails:
    the pinned torch's gloo no longer names its loop so, and the ranks spin again."""
    for before, after in launch(_loops_before_and_after_a_subgroup, 2, timeout_s=120):
        assert before and set(before) == {GLOO_LOOP_NICENESS}, before
        assert len(after) > len(before) and set(after) == {GLOO_LOOP_NICENESS}, after


def _affinities(rank: int, world_size: int) -> tuple[list[int], list[list[int]]]:
    """The cores this rank's main thread and each of its gloo device loops may run on."""
    loops = []
    for name in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{name}/comm") as comm:
            if comm.read().strip() == GLOO_LOOP_THREAD:
                loops.append(sorted(os.sched_getaffinity(int(name))))
    return sorted(os.sched_getaffinity(0)), loops


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_that_fill_the_cores_are_pinned_one_core_each_gloo_loops_included(
    world_size: int,
) -> None:
    """`rank_worker.bind_to_core`: with at least as many ranks as cores, rank r and every thread
    it starts (gloo's loop among them) run on core r mod n only; with fewer, anywhere (several
    small groups pinned alike would crowd the first cores). A one-rank group has no peer to
    connect to and may have no loop running yet; a group of two or more has one per rank."""
    cores = usable_cores()
    per_rank = launch(_affinities, world_size, timeout_s=120)
    for rank, (main_thread, loops) in enumerate(per_rank):
        expected = [cores[rank % len(cores)]] if world_size >= len(cores) else cores
        assert main_thread == expected, (rank, main_thread)
        assert loops or world_size == 1, (rank, loops)
        assert all(loop == expected for loop in loops), (rank, loops)
