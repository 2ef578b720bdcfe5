"""Hardening of the JAX side (issue 13): every process bounded, and gone when its run ends.

- Process groups: `run_workers` kills each worker's group, with what the worker started, on
  every exit path (exit 0, a failure, the deadline, KeyboardInterrupt), for plain and for
  zygote-forked workers; `terminate_all` stops every registered group (SIGTERM, SIGKILL after
  the grace), the zygotes after their workers.
- ``verify --timeout``: a JAX step that starts children and hangs ends the run within the
  limit plus `jax_verify.TIMEOUT_GRACE_S`, the hung job timed out, the later ones not run, the
  finished one kept, and no child left.
- The zygote only where supported: ``GRADWEIGHT_NO_FORK_SERVERS=1`` and a platform without
  ``os.waitid`` (macOS) fall back to plain processes, with the same results.
- Coordinator ports: two launches at once both succeed on different ports; a taken port is
  retried on another.
- A kill in the middle of an orbax save leaves the previous checkpoint, and the resume from it
  is bit for bit the uninterrupted run.
- A worker SIGKILLed mid-run stops the launch with an error naming the worker and the signal.

Every test checks that no process it started is alive afterwards: the `started` fixture
records every process group the launchers register during the test and fails the test when
one still holds a live process (the harness's shared zygote excepted: it lives as long as this
process); tests whose processes carry a marker in their command line look for that too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from case_fields import make_case
from child_env import ROOT, zygote_env
from jax_matrix import RUNNER_XLA_FLAGS, smallest_multiprocess_spec

from crosscheck.contract.cases import Case, CaseOutput, TrainSettings
from crosscheck.contract.oracle import loss_and_grad
from crosscheck.fixtures.builtin import builtin_fixture
from crosscheck.judge.compare import FLOAT64_RTOL, tree_rel_err
from crosscheck.launch import processes, worker_processes
from crosscheck.launch import workers as launch_workers
from crosscheck.launch.worker_processes import LaunchError, WorkerResult, run_workers
from crosscheck.launch.zygote import NO_FORK_SERVERS_ENV, Zygote, ZygoteError, unavailable
from crosscheck.run import jax_runner
from crosscheck.verification import jax_verify
from crosscheck.verification.protocol import StepError, VerifyJob, VerifyOutput
from jax_impl.harness import multiprocess as jax_multiprocess
from jax_impl.harness.multiprocess import launch_multiprocess

# ---- helpers --------------------------------------------------------------------------------


def _marker() -> str:
    return f"gw-hardening-{uuid.uuid4().hex[:12]}"


def _proc_table() -> list[tuple[int, int, str, bytes]]:
    """(pid, pgid, state, cmdline) of every process, from /proc."""
    table = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[-1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # exited while we looked
            continue
        table.append((int(entry.name), int(fields[2]), fields[0].decode(), cmdline))
    return table


def _command(cmdline: bytes) -> str:
    return cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]


def _live(pids_or_groups: set[int]) -> list[str]:
    """Every live (not zombie) process whose pid or process group is in `pids_or_groups`."""
    return [
        f"pid {pid} (group {pgid}): {_command(cmdline)}"
        for pid, pgid, state, cmdline in _proc_table()
        if state not in ("Z", "X") and (pid in pids_or_groups or pgid in pids_or_groups)
    ]


def _marked(marker: str) -> list[str]:
    """Every live process whose command line holds `marker`."""
    return [
        f"pid {pid}: {_command(cmdline)}"
        for pid, _, state, cmdline in _proc_table()
        if state not in ("Z", "X") and marker.encode() in cmdline
    ]


def _wait_for(path: Path, timeout_s: float, why: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process is not None and process.poll() is not None:
            pytest.fail(f"{why}: the process exited with {process.returncode} first")
        if time.monotonic() > deadline:
            pytest.fail(f"{why}: {path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Every worker group the launchers register during the test; none may survive it.

    Zygotes are servers that live as long as their owner (this process, or a module's
    fixture): not counted here; a test that stops one checks that itself.
    """
    leaders: list = []
    register = worker_processes.register_group

    def record(leader, *, server: bool = False) -> None:
        if not server:
            leaders.append(leader)
        register(leader, server=server)

    monkeypatch.setattr(worker_processes, "register_group", record)
    yield leaders
    left = _live({leader.pid for leader in leaders})
    assert not left, f"processes the test started outlived it: {left}"


@pytest.fixture(scope="module")
def light_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Zygote]]:
    """A zygote that preloads nothing but what ``python -m crosscheck.launch.zygote_server``
    imports; started again when a test stopped it (terminate_all)."""
    made: list[Zygote] = []

    def get() -> Zygote:
        if not made or not made[-1].alive:
            made.append(Zygote([], zygote_env(), tmp_path_factory.mktemp("zygote") / "log"))
        return made[-1]

    yield get
    for zygote in made:
        zygote.close()


def _spawner(marker: str, pid_file: Path, sleep_s: float, code: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "hardening_spawner", marker, str(pid_file), str(sleep_s),
            str(code), *flags]  # fmt: skip


def _pids(pid_file: Path) -> tuple[int, int]:
    worker, child = pid_file.read_text().split()
    return int(worker), int(child)


# ---- process groups -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["exit 0", "exit 3", "deadline", "KeyboardInterrupt"])
@pytest.mark.parametrize("mode", ["plain", "zygote"])
def test_every_exit_path_kills_the_worker_with_what_it_started(
    mode: str, path: str, tmp_path: Path, started: list, light_zygote: Callable[[], Zygote]
) -> None:
    zygote = light_zygote() if mode == "zygote" else None
    marker, pid_file = _marker(), tmp_path / "pids"
    sleep_s, code = {"exit 0": (0, 0), "exit 3": (0, 3)}.get(path, (600, 0))
    command = _spawner(marker, pid_file, sleep_s, code)

    def run(timeout_s: float = 60) -> list[WorkerResult]:
        return run_workers(
            [command],
            timeout_s=timeout_s,
            log_dir=tmp_path / "logs",
            env=zygote_env(),
            zygote=zygote,
        )

    if path == "exit 0":
        [result] = run()
        assert result.returncode == 0 and result.forked == (mode == "zygote")
    elif path == "exit 3":
        with pytest.raises(LaunchError) as error:
            run()
        worker, _ = _pids(pid_file)
        assert str(error.value).startswith(
            f"worker(s) [0] failed: worker 0 (pid {worker}) exited with code 3; the others were "
            "stopped\n"
        )
        assert error.value.failed == {0: 3} and not error.value.timed_out
    elif path == "deadline":
        with pytest.raises(LaunchError, match=r"^worker\(s\) \[0\] still running after 2 s; all"):
            run(timeout_s=2)
    else:

        def interrupt() -> None:
            deadline = time.monotonic() + 30
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: KeyboardInterrupt in the main thread

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run()
    worker, child = _pids(pid_file)
    assert not _live({worker, child}), "a worker or its child survived run_workers"
    assert not _marked(marker)


def test_terminate_all_stops_every_group_workers_first(
    tmp_path: Path, started: list, light_zygote: Callable[[], Zygote]
) -> None:
    """Two launches in threads, one plain, one forked, whose workers (and their children)
    ignore SIGTERM: terminate_all SIGKILLs them after the grace, then stops the zygote."""
    marker, zygote = _marker(), light_zygote()
    errors: dict[str, BaseException] = {}

    def launch_in_thread(name: str, forker: Zygote | None) -> None:
        command = _spawner(marker, tmp_path / f"{name}.pids", 600, 0, "ignore-term")
        try:
            run_workers(
                [command], timeout_s=120, log_dir=tmp_path / name, env=zygote_env(), zygote=forker
            )
        except BaseException as error:  # reported below, in the main thread
            errors[name] = error

    threads = [
        threading.Thread(target=launch_in_thread, args=(name, zygote))
        for name, zygote in (("plain", None), ("forked", zygote))
    ]
    for thread in threads:
        thread.start()
    for name in ("plain", "forked"):
        _wait_for(tmp_path / f"{name}.pids", 30, f"the {name} worker never started its child")
    grace_s = 1.0
    start = time.monotonic()
    signalled = processes.terminate_all(grace_s=grace_s)
    elapsed = time.monotonic() - start
    for thread in threads:
        thread.join(30)
    # The two workers' groups and the light zygote (and the harness's zygote, if running).
    assert signalled >= 3
    # SIGTERM was ignored, so the SIGKILL came after the grace, and the wait is bounded.
    assert grace_s <= elapsed < grace_s + processes.TERMINATE_KILL_WAIT_S + 1.0
    assert not zygote.alive
    for name in ("plain", "forked"):
        worker, child = _pids(tmp_path / f"{name}.pids")
        assert isinstance(errors[name], LaunchError), errors[name]
        # The zygote was stopped after its worker, so it still reported the worker's signal.
        assert str(errors[name]).startswith(
            f"worker(s) [0] failed: worker 0 (pid {worker}) was killed by SIGKILL (signal 9); "
        ), errors[name]
        assert not _live({worker, child})
    assert not _marked(marker)
    assert processes.terminate_all(grace_s=grace_s) == 0  # idempotent: nothing left to stop


# ---- verify --timeout -----------------------------------------------------------------------

HANGS = "tests.jax_hardening_steps:spawns_then_hangs"
VERIFY_TIMEOUT_S = 10.0


def test_a_hung_step_ends_within_the_grace_and_its_children_are_gone(
    tmp_path: Path, started: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = _marker()
    monkeypatch.setenv("GW_HARDENING_MARKER", marker)
    monkeypatch.setenv("GW_HARDENING_DIR", str(tmp_path))
    monkeypatch.chdir(ROOT)  # the step is named from the repository root, as a user names theirs
    done = VerifyJob(fixture="packed", world_size=1, accum_steps=1)
    hung = VerifyJob(fixture="ragged", world_size=2, accum_steps=1)
    later = [
        VerifyJob(fixture="ragged", world_size=1, accum_steps=2),
        VerifyJob(fixture="packed", world_size=2, accum_steps=2),
    ]
    start = time.monotonic()
    outcomes = jax_verify.run(HANGS, [done, hung, *later], timeout_s=VERIFY_TIMEOUT_S)
    elapsed = time.monotonic() - start
    print(f"verify with a hung step and --timeout {VERIFY_TIMEOUT_S:g}: {elapsed:.2f} s")
    assert VERIFY_TIMEOUT_S <= elapsed < VERIFY_TIMEOUT_S + jax_verify.TIMEOUT_GRACE_S
    # The finished job keeps its result.
    assert isinstance(outcomes[done], VerifyOutput), outcomes[done]
    want = loss_and_grad(builtin_fixture("packed"), "token_mean", 1, 1).grads
    assert tree_rel_err(outcomes[done].grads, want).max_rel_err < FLOAT64_RTOL
    head = f"step {HANGS} did not finish within {VERIFY_TIMEOUT_S:g} s"
    assert isinstance(outcomes[hung], StepError)
    assert str(outcomes[hung]) == (
        f"{hung.describe()}: timed out: {head}: it was still running this job when the worker "
        "was killed"
    )
    for job in later:
        assert isinstance(outcomes[job], StepError)
        assert str(outcomes[job]) == (
            f"{job.describe()}: not run: {head}: the worker was running {hung.describe()} when "
            "it was killed; this job never ran"
        )
    children = [int(pid) for pid in (tmp_path / "children").read_text().split()]
    assert len(children) == 2  # the step did start them
    assert not _live(set(children))
    assert not _marked(marker)


# ---- the zygote only where supported --------------------------------------------------------

SWITCH_CASE = make_case(impl="jax-pmap", dtype="float32")


def _run_harness_case(monkeypatch: pytest.MonkeyPatch) -> tuple[CaseOutput, list[WorkerResult]]:
    """SWITCH_CASE through the harness's JAX runner; its output and how its worker started."""
    workers: list[WorkerResult] = []
    real = launch_workers.run_workers

    def spy(*args, **kwargs) -> list[WorkerResult]:
        results = real(*args, **kwargs)
        workers.extend(results)
        return results

    monkeypatch.setattr(launch_workers, "run_workers", spy)
    outputs: dict[Case, CaseOutput | BaseException] = {}
    [job] = jax_runner.jobs([SWITCH_CASE], TrainSettings(num_updates=1), outputs.__setitem__)
    job.run()
    monkeypatch.setattr(launch_workers, "run_workers", real)
    output = outputs[SWITCH_CASE]
    assert isinstance(output, CaseOutput), output
    return output, workers


def _same(a: CaseOutput, b: CaseOutput) -> None:
    for mine, theirs in zip([a.grads, *a.params], [b.grads, *b.params], strict=True):
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype
            assert np.array_equal(mine[key], theirs[key]), key
    assert a.metrics == b.metrics


def test_the_switch_turns_the_zygote_off_with_the_same_results(
    monkeypatch: pytest.MonkeyPatch, started: list
) -> None:
    monkeypatch.delenv(NO_FORK_SERVERS_ENV, raising=False)
    supported = unavailable() == ""
    forked, forked_workers = _run_harness_case(monkeypatch)
    assert [w.forked for w in forked_workers] == [supported]
    monkeypatch.setenv(NO_FORK_SERVERS_ENV, "1")
    assert unavailable() == f"fork servers are turned off ({NO_FORK_SERVERS_ENV}=1)"
    assert jax_runner.worker_zygote() is None
    plain, plain_workers = _run_harness_case(monkeypatch)
    assert [w.forked for w in plain_workers] == [False]  # the fallback: a plain process
    _same(plain, forked)


@pytest.mark.parametrize("name", ["waitid", "WNOWAIT", "fork"])
def test_a_platform_without_what_the_zygote_uses_gets_plain_processes(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, started: list
) -> None:
    """As on macOS, which has no os.waitid: no zygote, no error, a plain worker instead."""
    monkeypatch.delenv(NO_FORK_SERVERS_ENV, raising=False)
    monkeypatch.delattr(os, name)
    assert unavailable() == f"this platform lacks os.{name}"
    assert jax_runner.worker_zygote() is None
    with pytest.raises(ZygoteError, match=rf"^no zygote: this platform lacks os\.{name}$"):
        Zygote([], zygote_env(), tmp_path / "zygote.log")
    marker = _marker()
    [result] = run_workers(
        [_spawner(marker, tmp_path / "pids", 0, 0)],
        timeout_s=60,
        log_dir=tmp_path / "logs",
        env=zygote_env(),
        zygote=jax_runner.worker_zygote(),
    )
    assert result.returncode == 0 and not result.forked
    assert not _marked(marker)


# ---- coordinator ports ----------------------------------------------------------------------


def _launch(spec: dict, work: Path) -> list[dict[str, np.ndarray]]:
    return launch_multiprocess(
        spec,
        2,
        work,
        timeout_s=120,
        extra_xla_flags=RUNNER_XLA_FLAGS,
        zygote=jax_runner.worker_zygote(),
    )


def _spy_ports(monkeypatch: pytest.MonkeyPatch, first: Callable | None = None) -> list[int]:
    """The port of every reservation launch_multiprocess makes; `first` replaces the first."""
    ports: list[int] = []
    real = jax_multiprocess.reserve_port

    def reserve() -> worker_processes.PortReservation:
        reservation = first() if first is not None and not ports else real()
        ports.append(reservation.port)
        return reservation

    monkeypatch.setattr(jax_multiprocess, "reserve_port", reserve)
    return ports


def test_two_launches_at_once_both_succeed_on_their_own_ports(
    tmp_path: Path, started: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = smallest_multiprocess_spec(tmp_path)
    ports = _spy_ports(monkeypatch)
    jax_runner.worker_zygote()  # started before, so that both launches fork at once
    barrier = threading.Barrier(2)
    outputs: dict[str, list] = {}
    errors: dict[str, BaseException] = {}

    def launch_now(name: str) -> None:
        barrier.wait()
        try:
            outputs[name] = _launch(spec, tmp_path / name)
        except BaseException as error:  # reported below, in the main thread
            errors[name] = error

    threads = [threading.Thread(target=launch_now, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    assert len(ports) == 2 and ports[0] != ports[1]  # one attempt each, never the same port
    for process_a, process_b in zip(outputs["a"], outputs["b"], strict=True):
        assert process_a.keys() == process_b.keys()
        assert all(np.array_equal(process_a[k], process_b[k]) for k in process_a)


class _Stranger:
    """A "reservation" of a port some other process holds: what a launcher that lost the race
    for a free port would have."""

    held = False

    def __init__(self, port: int) -> None:
        self.port = port

    def __enter__(self) -> _Stranger:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_taken_coordinator_port_is_retried_on_another(
    tmp_path: Path, started: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The first launch attempt is given the taken port, as a launcher racing a stranger
        # for it would be; the retry reserves one as usual.
        ports = _spy_ports(monkeypatch, first=lambda: _Stranger(port))
        outputs = _launch(smallest_multiprocess_spec(tmp_path), tmp_path / "run")
    assert ports[0] == port and len(ports) == 2 and ports[1] != port
    first_attempt = (tmp_path / "run" / "attempt1" / "worker0.err").read_text()
    assert (
        f"process 0: the coordinator port {port} on 127.0.0.1 is taken (Address already in use)"
        "; the launch should retry on another port"
    ) in first_attempt
    assert sorted(int(process["rank"]) for process in outputs) == [0, 1]


def test_a_coordinator_that_crashed_on_a_taken_port_counts_as_a_taken_port(
    tmp_path: Path,
) -> None:
    """The port taken between process 0's check and the coordinator's bind: gRPC says so on
    stderr and XLA crashes the process (SIGSEGV); that too is retried, nothing else is."""
    (tmp_path / "worker0.err").write_text(
        "E0000 add_port.cc:83] Failed to add port to server: No address added out of total 1 "
        "resolved for '[::]:40000'\n"
    )
    crashed = LaunchError("worker(s) [0] failed", failed={0: -11})
    assert jax_multiprocess._port_taken(crashed, tmp_path)
    other = LaunchError("worker(s) [1] failed", failed={1: 3})
    assert not jax_multiprocess._port_taken(other, tmp_path)
    (tmp_path / "worker0.err").write_text("ValueError: something else\n")
    assert not jax_multiprocess._port_taken(crashed, tmp_path)


# ---- a worker killed mid-run ----------------------------------------------------------------


def test_a_worker_killed_mid_run_stops_the_launch_naming_it_and_the_signal(
    tmp_path: Path, started: list
) -> None:
    """Process 1 stops after its first update's gradients and is SIGKILLed there; process 0
    is then blocked in the next collective. The launcher must stop it and raise at once."""
    work = tmp_path / "run"
    spec = smallest_multiprocess_spec(tmp_path, num_updates=2, stall_process=1)
    killed: dict[str, float | int] = {}

    def kill_process_1() -> None:
        stalled = work / "process1.stalled"
        deadline = time.monotonic() + 120
        while not stalled.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # let process 0 enter its next collective
        killed["pid"] = int(stalled.read_text())
        killed["at"] = time.monotonic()
        os.kill(int(killed["pid"]), signal.SIGKILL)

    killer = threading.Thread(target=kill_process_1, daemon=True)
    killer.start()
    with pytest.raises(LaunchError) as error:
        _launch(spec, work)
    took = time.monotonic() - float(killed["at"])
    killer.join(10)
    print(f"a worker SIGKILLed mid-run: the launch raised {took:.2f} s later")
    assert took < 60  # the stated bound: POLL_INTERVAL_S + KILL_WAIT_S, in practice < 1 s
    message = str(error.value)
    assert message.startswith(
        "multi-process launch of 2 jax.distributed processes (worker i is process i, "
        "coordinator 127.0.0.1:"
    ), message
    assert f"worker 1 (pid {killed['pid']}) was killed by SIGKILL (signal 9)" in message, message
    assert error.value.failed[1] == -signal.SIGKILL
    assert not _live({int(killed["pid"])})


# ---- a kill in the middle of a checkpoint save ----------------------------------------------


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_and_an_exact_resume(
    tmp_path: Path,
) -> None:
    env = zygote_env(XLA_FLAGS=RUNNER_XLA_FLAGS)  # both processes alike: the same compiled code
    command = [sys.executable, "-m", "jax_checkpoint_kill"]
    with (tmp_path / "save.err").open("wb") as err:
        saver = subprocess.Popen(
            [*command, "save", str(tmp_path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        _wait_for(tmp_path / "saving", 120, "the save never reached its final rename", saver)
        os.killpg(saver.pid, signal.SIGKILL)  # in the middle of the save of ckpt-b
        assert saver.wait(timeout=30) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(saver.pid, signal.SIGKILL)
        saver.wait(timeout=30)
    unfinished = Path((tmp_path / "saving").read_text())
    # The kill left ckpt-b half-done: both items written into orbax's temporary directory,
    # not renamed to their final name. ckpt-a, the previous checkpoint, is untouched.
    assert unfinished.name == "ckpt-b.orbax-checkpoint-tmp"
    assert {"meta", "state"} <= {p.name for p in unfinished.iterdir()}
    assert any(p.is_file() for p in (unfinished / "state").rglob("*"))
    assert not (tmp_path / "ckpt-b").exists() and (tmp_path / "ckpt-a").is_dir()
    resumed = subprocess.run(
        [*command, "resume", str(tmp_path)], env=env, capture_output=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr.decode(errors="replace")[-3000:]
    with np.load(tmp_path / "baseline.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files) == ["embed", "unembed"]
        for key in a.files:
            assert a[key].dtype == b[key].dtype == np.float32
            assert np.array_equal(a[key], b[key]), key  # bit for bit
    refused = json.loads((tmp_path / "refused.json").read_text())
    ckpt_b = tmp_path / "ckpt-b"
    assert refused["ckpt-b"] == (
        f"{ckpt_b}: no checkpoint there; only unfinalized save(s) ['{unfinished.name}'] exist, "
        "which a save interrupted before orbax's final rename leaves behind, and are never "
        "restored"
    )
    assert refused[unfinished.name] == (
        f"{unfinished}: an unfinalized orbax checkpoint (a save that did not finish); refusing "
        "to restore it"
    )
    assert not _live({saver.pid})
