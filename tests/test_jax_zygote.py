"""The JAX zygote: workers forked from one process that imported JAX, launched like any other.

The harness forks every JAX worker from `crosscheck.launch.zygote` instead of starting a fresh
Python (`crosscheck.run.jax_runner.worker_zygote`). A forked worker must behave like
``python -m MODULE`` in everything a worker relies on: its own XLA_FLAGS (the fake device count
is read after the fork), argv, environment, working directory and output files, its exit
status, and a bounded wait (the differences are listed in `crosscheck.launch.zygote`).
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from child_env import zygote_env

from crosscheck.launch.processes import pid_alive
from crosscheck.launch.worker_processes import LaunchError, run_workers
from crosscheck.launch.zygote import Zygote, ZygoteError


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    zygote = Zygote(["jax", "zygote_probe"], zygote_env(), tmp_path_factory.mktemp("z") / "log")
    yield zygote
    zygote.close()


def _probe(code: int, sleep_s: float = 0.0) -> list[str]:
    return [sys.executable, "-m", "zygote_probe", str(code), str(sleep_s)]


def test_forked_workers_see_their_own_flags_argv_env_and_cwd(zygote, tmp_path):
    results = [
        run_workers(
            [_probe(0)],
            timeout_s=60,
            log_dir=tmp_path / name,
            env=zygote_env(
                XLA_FLAGS=f"--xla_force_host_platform_device_count={count}", GW_PROBE=name
            ),
            cwd=tmp_path,
            zygote=zygote,
        )[0]
        for name, count in (("eight", 8), ("one", 1))
    ]
    reports = [json.loads(r.stdout_path.read_text()) for r in results]
    assert [r["devices"] for r in reports] == [8, 1]
    assert [r["probe"] for r in reports] == ["eight", "one"]
    assert all(r["argv"] == ["0", "0.0"] for r in reports)
    assert all(Path(r["cwd"]) == tmp_path for r in reports)
    # Forked by the zygote, not started by this process.
    assert all(r["ppid"] != os.getpid() for r in reports)
    # What the zygote imported is frozen out of the collector's sight (its JAX alone is far
    # more than 10,000 objects).
    assert all(r["frozen"] > 10_000 for r in reports)
    assert "probe exiting with 0" in results[0].stderr_tail()


def test_a_failing_worker_is_reported_with_its_status_and_stderr(zygote, tmp_path):
    with pytest.raises(LaunchError) as error:
        run_workers(
            [_probe(0, 30.0), _probe(7)],
            timeout_s=60,
            log_dir=tmp_path,
            env=zygote_env(XLA_FLAGS="--xla_force_host_platform_device_count=1"),
            zygote=zygote,
        )
    message = str(error.value)
    assert "worker(s) [1] failed" in message
    assert "exited with code 7" in message and "probe exiting with 7" in message
    # The sleeping peer was killed, not left behind.
    assert "still running (killed)" in message


def test_the_wait_is_bounded_and_the_worker_killed(zygote, tmp_path):
    with pytest.raises(LaunchError, match="still running after 2 s"):
        run_workers(
            [_probe(0, 60.0)],
            timeout_s=2,
            log_dir=tmp_path,
            env=zygote_env(XLA_FLAGS="--xla_force_host_platform_device_count=1"),
            zygote=zygote,
        )
    # The launcher waited for the kill to land: the zygote reaped the child (SIGKILL: -9).
    assert (tmp_path / "worker0.err.exitcode").read_text() == "-9"


def test_a_dead_zygote_means_plain_processes_not_failures(tmp_path):
    dead = Zygote(["zygote_probe"], zygote_env(), tmp_path / "log")
    dead.close()
    result = run_workers(
        [_probe(0)],
        timeout_s=60,
        log_dir=tmp_path / "run",
        env=zygote_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
        zygote=dead,
    )[0]
    report = json.loads(result.stdout_path.read_text())
    assert report["devices"] == 2 and report["ppid"] == os.getpid()  # started by us


def test_the_zygote_refuses_to_fork_a_threaded_process(tmp_path):
    with pytest.raises(ZygoteError, match="threads after the imports; fork is unsafe"):
        Zygote(["zygote_threaded"], zygote_env(), tmp_path / "log")


def test_the_harness_forks_its_jax_workers():
    from crosscheck.run.jax_runner import worker_zygote

    zygote = worker_zygote()
    assert zygote is not None and zygote.alive


def test_terminate_all_stops_a_child_of_a_zygote_that_no_launch_registered(tmp_path):
    """A worker forked while its launch was being interrupted, before the launch learned its
    pid, is in no registry: `terminate_all` finds it as a child of a registered zygote and
    stops it before the zygote itself, so that nothing is left once the zygote is gone."""
    from crosscheck.launch import processes

    forker = Zygote([], zygote_env(), tmp_path / "log")
    orphan = forker.spawn(
        "zygote_probe",
        ["0", "600"],
        env=zygote_env(),
        cwd=tmp_path,
        stdout=tmp_path / "out",
        stderr=tmp_path / "err",
    )
    assert orphan.pid not in processes.registered_groups() and orphan.poll() is None
    signalled = processes.terminate_all(grace_s=1.0)
    assert signalled >= 2  # the orphan's group and this zygote (another zygote may run too)
    assert not forker.alive
    assert not Path(f"/proc/{orphan.pid}").exists() or Path(
        f"/proc/{orphan.pid}/stat"
    ).read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_a_request_whose_folder_is_gone_exits_quietly(tmp_path):
    """A request that reaches the zygote after its client removed the log folder (an
    interrupt, between the request and the fork) has nobody to report to: the child exits 1
    without a traceback in the zygote's log, which stays empty and is removed on close."""
    log = tmp_path / "log"
    zygote = Zygote(["zygote_probe"], zygote_env(), log)
    gone = tmp_path / "gone"
    try:
        child = zygote.spawn(
            "zygote_probe",
            ["0", "0.0"],
            env=zygote_env(),
            cwd=None,
            stdout=gone / "worker0.out",
            stderr=gone / "worker0.err",
        )
        # Its exit status would go to the gone folder too: wait for the zygote to reap it.
        deadline = time.monotonic() + 30
        while pid_alive(child.pid):
            assert time.monotonic() < deadline, "the child is still running after 30 s"
            time.sleep(0.05)
        assert log.read_bytes() == b""
    finally:
        zygote.close()
    assert not log.exists()
