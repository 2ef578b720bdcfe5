"""Every wait on a worker process is bounded: a crash or a hang fails fast, nothing lingers.

The multi-process collective tests depend on this: a peer that dies leaves the others blocked
in a collective, so the launcher must notice the death and stop them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from jax_matrix import RUNNER_XLA_FLAGS, smallest_multiprocess_spec

from crosscheck import FLOAT64_RTOL, assert_tree_close
from crosscheck.launch.worker_processes import LaunchError, run_workers
from jax_impl.harness.multiprocess import launch_multiprocess

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_workers_that_succeed_return_their_status(tmp_path: Path) -> None:
    commands = [[sys.executable, "-c", f"print('worker {i}')"] for i in range(3)]
    results = run_workers(commands, timeout_s=60, log_dir=tmp_path)
    assert [r.returncode for r in results] == [0, 0, 0]
    assert results[2].stdout_path.read_text().strip() == "worker 2"


def test_a_crashed_worker_stops_the_others_at_once(tmp_path: Path) -> None:
    crash = [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit('boom')"]
    start = time.monotonic()
    with pytest.raises(
        LaunchError,
        match=r"^worker\(s\) \[1\] failed: worker 1 \(pid \d+\) exited with code 1; the",
    ) as error:
        run_workers([SLEEPER, crash], timeout_s=120, log_dir=tmp_path)
    assert time.monotonic() - start < 15  # not the sleeper's 120 s
    assert "boom" in str(error.value) and "still running (killed)" in str(error.value)
    assert error.value.failed == {1: 1} and not error.value.timed_out


def test_a_hung_worker_is_killed_at_the_deadline(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"still running after 1 s") as error:
        run_workers([SLEEPER, SLEEPER], timeout_s=1, log_dir=tmp_path)
    assert time.monotonic() - start < 15
    assert error.value.timed_out and error.value.failed == {}


def test_a_crashed_jax_distributed_process_does_not_hang_its_peer(tmp_path: Path) -> None:
    """Process 1 dies right after joining; process 0 would wait in its first collective."""
    spec = smallest_multiprocess_spec(tmp_path, fail_process=1)
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"worker\(s\) \[1\] failed") as error:
        launch_multiprocess(
            spec, 2, tmp_path / "run", timeout_s=120, extra_xla_flags=RUNNER_XLA_FLAGS
        )
    assert "worker 1 (pid " in str(error.value) and ") exited with code 3" in str(error.value)
    assert "failing on purpose" in str(error.value)
    assert error.value.failed == {1: 3}
    assert time.monotonic() - start < 60


def test_processes_of_two_devices_give_the_ranks_of_one_device_processes(tmp_path: Path) -> None:
    """R = 4 as two processes of two devices (how `crosscheck run` launches it,
    `crosscheck.run.jax_runner.devices_per_process`) returns rank by rank what four processes
    of one device return, bit for bit: process i holds ranks 2i and 2i + 1, in order."""
    spec = smallest_multiprocess_spec(tmp_path, num_updates=2)
    spec["cases"] = [{**spec["cases"][0], "accum_steps": 2}]
    four = launch_multiprocess(
        spec, 4, tmp_path / "four", timeout_s=120, extra_xla_flags=RUNNER_XLA_FLAGS
    )
    paired = launch_multiprocess(
        spec,
        2,
        tmp_path / "paired",
        timeout_s=120,
        extra_xla_flags=RUNNER_XLA_FLAGS,
        devices_per_process=2,
    )
    assert len(four) == len(paired) == 4
    for rank, (one, two) in enumerate(zip(four, paired, strict=True)):
        assert one.keys() == two.keys(), rank
        # loaded_programs and traced_sweeps are its process's, not the rank's: rank 1 is
        # process 1 of four (it loads the sweeps) and process 0 of two (it compiles them).
        for key in one.keys() - {"loaded_programs", "traced_sweeps"}:
            np.testing.assert_array_equal(one[key], two[key], err_msg=f"rank {rank} {key}")


def test_a_case_that_names_its_schemes_gets_those_alone_and_the_same_values(
    tmp_path: Path,
) -> None:
    """A case of a launch's spec may name the schemes it needs (what `crosscheck run` passes:
    v1's names for v1's fixtures, the trainer modes for v2's): it gets records for those
    alone, equal (within float64 rounding) to those of a launch that computes every scheme for
    every case; a name the spec does not hold fails the launch, naming it."""
    spec = smallest_multiprocess_spec(
        tmp_path, schemes=["token_mean", "sequence_mean"], dtypes=["float64"], x64=True
    )
    case = spec["cases"][0]
    spec["cases"] = [{**case, "accum_steps": 2}, case]
    every = launch_multiprocess(
        spec, 2, tmp_path / "every", timeout_s=120, extra_xla_flags=RUNNER_XLA_FLAGS
    )
    spec["cases"] = [
        {**case, "accum_steps": 2, "schemes": ["sequence_mean"]},
        {**case, "schemes": ["token_mean"]},
    ]
    named = launch_multiprocess(
        spec, 2, tmp_path / "named", timeout_s=120, extra_xla_flags=RUNNER_XLA_FLAGS
    )
    for rank, (all_of_them, some) in enumerate(zip(every, named, strict=True)):
        kept = {key for key in some if key.split("/")[0] in ("0", "1")}
        assert kept and all("/sequence_mean/" in k for k in kept if k.startswith("0/"))
        assert all("/token_mean/" in k for k in kept if k.startswith("1/"))
        assert {k.split("/")[0] for k in kept} == {"0", "1"}
        # Within float64 rounding, as the matrix judges (relative to each leaf's largest
        # entry), not bit for bit: a sweep runs its configs batched with vmap, and another
        # number of configs may sum a reduction in another order
        # (`jax_impl.update.sweep_rank_gradients`).
        assert_tree_close(
            {key: some[key] for key in kept},
            {key: all_of_them[key] for key in kept},
            FLOAT64_RTOL,
            f"rank {rank}",
        )
    spec["cases"] = [{**case, "schemes": ["row_mean"]}]
    with pytest.raises(LaunchError, match=r"spec case 0 names schemes \['row_mean'\]"):
        launch_multiprocess(
            spec, 2, tmp_path / "unknown", timeout_s=120, extra_xla_flags=RUNNER_XLA_FLAGS
        )
