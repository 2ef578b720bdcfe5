"""`crosscheck verify` and `run` under an existing launcher, and the device choice (docs/gpu.md).

Real launches on the CPU: ``torchrun`` (torch's ``torch.distributed.run``, two ranks on gloo)
and two-process ``jax.distributed`` jobs (gloo collectives, one CPU device per process, or
two), each process running ``python -m crosscheck verify ... --json`` (or ``run``). The seven
launches (a passing and a failing step in each framework, `crosscheck run`'s torch rows under
torchrun, its jax-multiprocess rows in a JAX job at R = 2 and 4) start at once in one module
fixture: most of their time is start-up and waiting on peers, not CPU. Every wait is bounded
and every launch is a session of its own, killed whole if it outlives its bound, so nothing
is left running.

Where no GPU is (here), ``--device cuda`` must be refused with exit 2 and a message naming
what is missing; the choice ``auto`` makes is checked with the GPU count given.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from child_env import ROOT

from crosscheck import exit_codes
from crosscheck.cli.commands import main
from crosscheck.launch.devices import DeviceError, jax_platform_env, resolve_torch_device
from crosscheck.launch.external import (
    JaxMultiHost,
    LauncherError,
    TorchLaunch,
    jax_multihost,
    torch_launch,
)
from crosscheck.launch.worker_processes import reserve_port
from jax_impl.harness.multiprocess import worker_env

#: Each launch's bound: five start together on two shared cores; alone, a torchrun launch
#: took 12 s and a two-process JAX job 45 s (its six default jobs; these run one or two).
LAUNCH_TIMEOUT_S = 300
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
VERIFY = ["-m", "crosscheck", "verify", "--scheme", "token_mean", "--timeout", "120"]
JAX_RUN = [sys.executable, "-m", "crosscheck", "run", "--fixtures", "packed"]
JAX_RUN += ["--schemes", "token_mean,sequence_mean,rank_mean", "--accum-steps", "1,2"]


@dataclass
class Finished:
    """What one launched process left: its exit status, output and --json report."""

    returncode: int
    output: str
    report: dict


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # A session of its own: killpg reaches torchrun's ranks too, should the bound pass.
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(process: subprocess.Popen, log: Path, report: Path | None) -> Finished:
    try:
        code = process.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # its ranks, whatever it did
        process.wait()
    data = json.loads(report.read_text()) if report is not None and report.exists() else {}
    return Finished(code, log.read_text(), data)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Finished]]:
    """Five launches at once; per launch, what each of its (top-level) processes left."""
    tmp = tmp_path_factory.mktemp("launched")
    started: dict[str, list[tuple[subprocess.Popen, Path, Path | None]]] = {}
    torch_steps = {
        "torch-pass": "examples.torch_torchtitan:step",
        "torch-fail": "examples.torch_nanogpt:step",
    }
    reservations = []
    try:
        for name, step in torch_steps.items():
            report, log = tmp / f"{name}.json", tmp / f"{name}.log"
            command = [*TORCHRUN, *VERIFY, "--framework", "torch", "--step", step]
            started[name] = [(_start([*command, "--json", str(report)], _env(), log), log, report)]
        # The matrix's torch rows, their launch run inside torchrun's two ranks.
        report, log = tmp / "torch-run.json", tmp / "torch-run.log"
        command = [*TORCHRUN, "-m", "crosscheck", "run", "--impls", "oracle,torch-ddp"]
        command += ["--fixtures", "packed", "--schemes", "token_mean,rank_mean"]
        command += ["--accum-steps", "1,2"]
        started["torch-run"] = [
            (_start([*command, "--json", str(report)], _env(), log), log, report)
        ]
        jax_verify = [sys.executable, *VERIFY, "--framework", "jax", "--fixtures", "packed"]
        # name -> (command, CPU devices per process). The matrix's jax-multiprocess rows run
        # at one device per process (R = 2) and two (R = 4: a process holds two consecutive
        # ranks).
        jax_jobs = {
            "jax-pass": (
                [*jax_verify, "--step", "examples.jax_token_weighted:step", "--accum-steps", "1,2"],
                1,
            ),
            "jax-fail": (
                [*jax_verify, "--step", "examples.jax_optax_multisteps:step", "--accum-steps", "2"],
                1,
            ),
            "jax-run": (JAX_RUN, 1),
            "jax-run-4": (JAX_RUN, 2),
        }
        for name, (options, devices) in jax_jobs.items():
            # Held until the coordinator takes it over
            # (crosscheck.launch.worker_processes.PortReservation).
            reservation = reserve_port()
            reservations.append(reservation)
            started[name] = []
            for process_id in range(2):
                report, log = tmp / f"{name}-{process_id}.json", tmp / f"{name}-{process_id}.log"
                command = [*options, "--json", str(report)]
                command += ["--coordinator", f"127.0.0.1:{reservation.port}"]
                command += ["--num-processes", "2", "--process-id", str(process_id)]
                env = worker_env(_env())  # JAX on the CPU, `devices` CPU devices per process
                env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(
                    "device_count=1", f"device_count={devices}"
                )
                started[name].append((_start(command, env, log), log, report))
        return {name: [_finish(*entry) for entry in entries] for name, entries in started.items()}
    finally:
        for reservation in reservations:
            reservation.close()
        for entries in started.values():
            for process, _, _ in entries:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _default_cases(report: dict) -> list[tuple[str, int, int]]:
    return [(c["fixture"], c["world_size"], c["accum_steps"]) for c in report["cases"]]


def test_torchrun_runs_a_passing_step_at_its_world_size(launched: dict) -> None:
    (run,) = launched["torch-pass"]
    assert run.returncode == exit_codes.OK, run.output[-3000:]
    assert run.report["ok"] is True and run.report["launched_world_size"] == 2
    # The launcher's R only, each M the default layouts pair with it, on both default fixtures.
    expected = [(f, 2, M) for f in ("packed", "ragged") for M in (1, 2, 4)]
    assert _default_cases(run.report) == expected
    # float64 tolerance 1e-12; the worst seen here is 8.7e-16.
    assert all(c["ok"] and c["max_rel_err"] < 1e-12 for c in run.report["cases"])
    assert run.output.count("2 launched ranks") == 1  # rank 0 alone prints the report


def test_torchrun_names_a_failing_step_and_every_rank_exits_alike(launched: dict) -> None:
    (run,) = launched["torch-fail"]
    assert run.report["ok"] is False, run.output[-3000:]
    assert run.report["diagnosis"]["best_match"] == "microbatch-mean"
    # torchrun exits 1 when a rank does. Its summary lists each rank's status: 1, or SIGTERM
    # for a rank torchrun stopped because a peer exited first (it stops the rest at the first
    # non-zero exit), after the agreement: never another status.
    assert run.returncode == 1
    statuses = re.findall(r"exitcode\s+: (-?\d+)", run.output)
    assert len(statuses) == 2 and set(statuses) <= {"1", "-15"}, run.output[-3000:]
    assert "1" in statuses


def test_torchrun_runs_the_matrix_torch_rows_in_its_own_ranks(launched: dict) -> None:
    (run,) = launched["torch-run"]
    assert run.returncode == exit_codes.OK, run.output[-3000:]
    assert run.report["ok"] is True and run.report["plan"]["world_sizes"] == [2]
    ddp = [row for row in run.report["results"] if row["impl"] == "torch-ddp"]
    # token_mean by both strategies at M = 1, 2; rank_mean's plain mean loop at M = 1.
    assert sorted((r["scheme"], r["strategy"], r["accum_steps"]) for r in ddp) == [
        ("rank_mean", "naive", 1),
        ("token_mean", "postnorm", 1),
        ("token_mean", "postnorm", 2),
        ("token_mean", "precount", 1),
        ("token_mean", "precount", 2),
    ]
    assert all(r["world_size"] == 2 and r["ok"] for r in ddp)
    assert run.output.count("rows, 0 failed") == 1  # rank 0 alone prints the summary


def test_a_multi_host_jax_job_verifies_over_every_process_device(launched: dict) -> None:
    for process_id, run in enumerate(launched["jax-pass"]):
        assert run.returncode == exit_codes.OK, run.output[-3000:]
        if process_id == 0:  # process 0 alone prints and writes the report
            assert run.report["ok"] is True and run.report["launched_world_size"] == 2
            assert _default_cases(run.report) == [("packed", 2, 1), ("packed", 2, 2)]
            # float64 tolerance 1e-12; the worst seen here is 6.2e-16.
            assert all(c["max_rel_err"] < 1e-12 for c in run.report["cases"])
        else:
            assert run.report == {} and "launched ranks" not in run.output


def test_a_multi_host_jax_job_names_a_failing_step_on_every_process(launched: dict) -> None:
    codes = [run.returncode for run in launched["jax-fail"]]
    assert codes == [exit_codes.MISMATCH] * 2, launched["jax-fail"][0].output[-3000:]
    assert launched["jax-fail"][0].report["diagnosis"]["best_match"] == "microbatch-mean"


@pytest.mark.parametrize(("name", "world_size"), [("jax-run", 2), ("jax-run-4", 4)])
def test_a_multi_host_jax_job_runs_the_matrix_jax_rows_in_its_own_processes(
    launched: dict, name: str, world_size: int
) -> None:
    first, second = launched[name]
    assert [first.returncode, second.returncode] == [exit_codes.OK] * 2, first.output[-3000:]
    assert first.report["ok"] is True and first.report["plan"]["world_sizes"] == [world_size]
    rows = [row for row in first.report["results"] if row["impl"] == "jax-multiprocess"]
    # The intended schemes by both strategies at M = 1, 2 (jax-multiprocess runs no accident).
    assert sorted((r["scheme"], r["strategy"], r["accum_steps"]) for r in rows) == [
        (scheme, strategy, M)
        for scheme in ("sequence_mean", "token_mean")
        for strategy in ("postnorm", "precount")
        for M in (1, 2)
    ]
    # float64 tolerance 1e-12, every rank's metrics there (each process sent its own ranks').
    assert all(r["world_size"] == world_size and r["ok"] for r in rows), rows
    assert all(r["max_rel_err"] < 1e-12 for r in rows)
    assert any(r["impl"] == "oracle" for r in first.report["results"])
    assert first.output.count("rows, 0 failed") == 1
    assert second.report == {} and "rows, 0 failed" not in second.output


def test_a_multi_host_jax_run_refuses_what_it_cannot_run_before_joining(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = ["run", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "0"]
    out = _refusal([*job, "--impls", "oracle,jax-pmap"], capsys)
    assert "only the oracle and jax-multiprocess run (not jax-pmap)" in out
    out = _refusal([*job, "--dtypes", "float32"], capsys)
    assert "--dtypes float32: a multi-host JAX job runs float64 only" in out
    out = _refusal(["run", "--coordinator", "127.0.0.1:9", "--num-processes", "2"], capsys)
    assert "missing: JAX_PROCESS_ID" in out


# ---- the environment a launcher leaves, read without joining anything ------------------------

TORCHRUN_ENV = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_torch_launch_is_read_from_the_launchers_variables() -> None:
    assert torch_launch({}) is None
    assert torch_launch(TORCHRUN_ENV) == TorchLaunch(1, 2, 1, "127.0.0.1", 29500)
    with pytest.raises(LauncherError, match="MASTER_ADDR, MASTER_PORT are not set"):
        torch_launch({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(LauncherError, match=r"RANK=2 must be in \[0, 2\)"):
        torch_launch({**TORCHRUN_ENV, "RANK": "2"})
    with pytest.raises(LauncherError, match="WORLD_SIZE='two' is not an integer"):
        torch_launch({**TORCHRUN_ENV, "WORLD_SIZE": "two"})


def test_a_jax_multi_host_start_takes_options_over_the_environment() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4"}
    assert jax_multihost(environ={}) is None
    assert jax_multihost(process_id=3, environ=env) == JaxMultiHost("10.0.0.1:1234", 4, 3)
    with pytest.raises(LauncherError, match="missing: JAX_PROCESS_ID"):
        jax_multihost(environ=env)
    with pytest.raises(LauncherError, match="must be HOST:PORT"):
        jax_multihost("10.0.0.1", 2, 0, environ={})
    with pytest.raises(LauncherError, match=r"JAX_PROCESS_ID=2 must be in \[0, 2\)"):
        jax_multihost("h:1", 2, 2, environ={})


# ---- the device choice ------------------------------------------------------------------------


def test_auto_takes_the_gpus_only_when_there_is_one_per_rank() -> None:
    assert resolve_torch_device("auto", 4, gpus=8) == "cuda"
    assert resolve_torch_device("auto", 4, gpus=4) == "cuda"
    assert resolve_torch_device("auto", 4, gpus=2) == "cpu"  # never a mix of devices
    assert resolve_torch_device("auto", 1, gpus=0) == "cpu"
    assert resolve_torch_device("cpu", 4, gpus=8) == "cpu"
    assert resolve_torch_device("cuda", 2, gpus=2) == "cuda"
    with pytest.raises(DeviceError, match="need 4 ranks, one GPU each, and torch sees 2"):
        resolve_torch_device("cuda", 4, gpus=2)
    with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
        resolve_torch_device("cuda", 1, gpus=0)


def test_counting_gpus_imports_torch_only_where_a_gpu_could_be() -> None:
    """Without a GPU's device files torch sees none: the count is 0 and this process pays no
    import of torch for it; with one, the count is torch's own."""
    code = (
        "import os, sys\n"
        "from crosscheck.launch.devices import GPU_DEVICE_FILES, visible_gpus\n"
        "count = visible_gpus()\n"
        "files = any(map(os.path.exists, GPU_DEVICE_FILES))\n"
        "print(count, files, 'torch' in sys.modules)\n"
        "if files:\n"
        "    import torch\n"
        "    assert count == (torch.cuda.device_count() if torch.cuda.is_available() else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    count, files, imported = proc.stdout.split()
    if files == "False":
        assert (count, imported) == ("0", "False")
    else:
        assert imported == "True"


def test_the_launcher_reads_the_device_the_run_sets() -> None:
    from crosscheck.launch import devices
    from torch_impl.harness import launcher

    # Spelled out on both sides (torch_impl does not import crosscheck): one name.
    assert launcher.DEVICE_ENV == devices.DEVICE_ENV


def test_a_jax_platform_sets_the_workers_jax_platforms() -> None:
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1"}
    assert jax_platform_env("cpu", env)["XLA_FLAGS"] == env["XLA_FLAGS"]
    gpu = jax_platform_env("gpu", env)
    assert gpu["JAX_PLATFORMS"] == "cuda" and gpu["XLA_FLAGS"] == "--xla_cpu_foo=1"
    with pytest.raises(DeviceError, match="--platform must be one of cpu, gpu, tpu"):
        jax_platform_env("metal", env)


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a refused command printed on stderr ('' for none); stdout holds nothing."""
    assert main(argv) == exit_codes.SETUP_ERROR
    captured = capsys.readouterr()
    assert captured.out == "", captured.out
    lines = captured.err.splitlines()
    assert len(lines) <= 1, lines
    return lines[0] if lines else ""


def test_an_accelerator_that_is_not_here_is_refused_before_any_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    assert not torch.cuda.is_available(), "this test is for a machine without a GPU"
    step = ["--framework", "torch", "--step", "examples.torch_torchtitan:step"]
    out = _refusal(["verify", *step, "--scheme", "token_mean", "--device", "cuda"], capsys)
    assert "--device cuda: torch sees no CUDA GPU here" in out
    run = ["run", "--impls", "oracle,torch-ddp", "--world-sizes", "1", "--device", "cuda"]
    out = _refusal(run, capsys)
    assert "crosscheck run: --device cuda: torch sees no CUDA GPU here" in out
    # JAX on a platform it cannot start: probed once, refused, not a bare error per job.
    jax_step = ["--framework", "jax", "--step", "examples.jax_token_weighted:step"]
    out = _refusal(["verify", *jax_step, "--scheme", "token_mean", "--platform", "gpu"], capsys)
    assert "--platform gpu: JAX cannot run on cuda here (no cuda device or plugin" in out


def test_a_half_set_launcher_environment_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    step = ["--framework", "torch", "--step", "examples.torch_torchtitan:step"]
    out = _refusal(["verify", *step, "--scheme", "token_mean"], capsys)
    assert "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in out
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    out = _refusal(["verify", *step, "--scheme", "token_mean", "--world-sizes", "4"], capsys)
    assert out == ""  # rank 1 refuses silently: rank 0 prints the one line


def test_the_gpu_check_script_is_clean_shell() -> None:
    """scripts/gpu_check.sh needs a GPU to run; here it must at least parse, and pass
    shellcheck where shellcheck is installed."""
    script = str(ROOT / "scripts" / "gpu_check.sh")
    parsed = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    if shutil.which("shellcheck"):
        checked = subprocess.run(["shellcheck", script], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout
