"""Run every row's reproduction command alone and check that it gives the table's verdict.

    python scripts/check_conformance_commands.py TABLE.json

TABLE.json is what ``crosscheck conformance --json`` wrote. Each row that ran is run again as
its printed ``crosscheck verify`` command, in a fresh process (the command line as the row
shows it, with ``--json`` added), and its verdict (``pass`` when it matched, else the name that
explains every case, or the names the run cannot tell apart) is compared with the row's.
Prints one line per row and exits 1 when any verdict differs, 0 when all agree.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rerun(command: str) -> tuple[str, float]:
    """The verdict of `command` run alone, and its wall time."""
    args = shlex.split(command)
    if args[:3] != ["python", "-m", "crosscheck"]:
        raise ValueError(f"not a crosscheck command: {command}")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, *args[1:], "--json", str(report)],
            cwd=ROOT,
            capture_output=True,
            timeout=900,
            check=False,
        )
        wall = time.perf_counter() - started
        if not report.exists():
            return "no report", wall
        record = json.loads(report.read_text())
    if record["ok"]:
        return "pass", wall
    diagnosis = record["diagnosis"]
    # As the table words it (crosscheck.conformance.runner.verdict_of): a run that cannot
    # tell its names apart gives each of them.
    if diagnosis["best_match"] == "ambiguous":
        return " or ".join(diagnosis["matches"]), wall
    return diagnosis["best_match"], wall


def main(path: str) -> int:
    rows = [row for row in json.loads(Path(path).read_text())["rows"] if row["command"]]
    differing = 0
    for row in rows:
        verdict, wall = rerun(row["command"])
        same = verdict == row["verdict"]
        differing += not same
        print(
            f"{'same' if same else 'DIFFERS':8} {row['framework']}:{row['setting']}: table "
            f"{row['verdict']}, alone {verdict} ({wall:.0f} s)",
            flush=True,
        )
    print(f"{len(rows) - differing} of {len(rows)} commands give the table's verdict")
    return 1 if differing else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
