"""The CPU seconds a command reports count the processes it started, forked ones included."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time

from child_env import ROOT, TESTS


def burn(rank: int, world_size: int, seconds: float) -> float:
    """A rank's work: spin until this process has used `seconds` of CPU; how much it used."""
    while time.process_time() < seconds:
        pass
    return time.process_time()


def test_cpu_seconds_counts_the_ranks_a_zygote_forked_and_stops_nothing():
    # In a fresh process, so that its counters start with it. The ranks burn CPU and report
    # their own process time; the ranks' zygote, not this process, reaps them, so this
    # process's RUSAGE_CHILDREN never sees them while the server lives: cpu_seconds reads
    # the server's own counters instead, and leaves it running for the next launch.
    script = textwrap.dedent(
        """
        import resource
        from crosscheck.launch.cpu_time import cpu_seconds
        import os
        from torch_impl.harness.launcher import launch, rank_zygote, start_method
        from test_cpu_time import burn

        def reaped():
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            return usage.ru_utime + usage.ru_stime

        assert start_method() == "zygote", start_method()
        before, reaped_before = cpu_seconds(), reaped()
        ranks = launch(burn, 2, (0.3,), timeout_s=120)
        total = cpu_seconds() - before
        os.kill(rank_zygote().pid, 0)  # raises unless the zygote still runs
        print(sum(ranks), reaped() - reaped_before, total)
        """
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=TESTS,
        # The ranks import this module (for `burn`): tests/ on the path, after the root.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    ranks, reaped, total = map(float, completed.stdout.split())
    # Each rank burned at least 0.3 s of its own CPU (it loops until process_time says so).
    assert ranks >= 0.6
    # The ranks are invisible to the reaped-children counter (the reason for /proc), and
    # counted by cpu_seconds: a rank's CPU is never below what it measured of itself, so the
    # total holds both ranks' (and more: the server, this process); no margin is needed.
    assert reaped < ranks
    assert total >= ranks


def test_cpu_seconds_is_own_plus_reaped_children():
    own = resource.getrusage(resource.RUSAGE_SELF)
    from crosscheck.launch.cpu_time import cpu_seconds

    # A child that burns CPU, reaped by subprocess.run: counted from then on.
    before = cpu_seconds()
    subprocess.run(
        [sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"],
        check=True,
        timeout=60,
    )
    # At least the child's 0.3 s (its own process_time, which its rusage covers), plus this
    # process's CPU since `before`, which only grows.
    assert cpu_seconds() - before >= 0.3
    assert cpu_seconds() >= own.ru_utime + own.ru_stime
