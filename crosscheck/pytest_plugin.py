"""The pytest plugin: check a training step's loss weighting from a library's own test suite.

Installing gradweight registers it (the ``pytest11`` entry point ``crosscheck.pytest_plugin``);
from a checkout, ``pytest -p crosscheck.pytest_plugin`` loads it, and
``-p no:crosscheck.pytest_plugin`` turns it off. It adds the fixture `gradweight`::

    def test_loss_weighting(gradweight):
        gradweight.assert_weighting("mypkg.train:step", framework="torch", scheme="token_mean")

which runs `crosscheck.verify` on the step (its default fixtures and layouts: several ranks R
and microbatches M, so that a per-rank or per-microbatch mean cannot hide), writes the report
as JSON under the test's ``tmp_path`` (the record of ``crosscheck verify --json``), and, unless
the intended scheme explains every case, fails the test with AssertionError whose message is
the table and diagnosis ``crosscheck verify`` prints: the name of what the step computes (e.g.
microbatch-mean), the weight ratio it gives two tokens that should weigh alike, and the fix.
A step that does not exist is a set-up error: `crosscheck.StepSetupError` (a ValueError), raised
before any process starts. Any keyword of `crosscheck.verify` passes through (``fixtures``,
``world_sizes``, ``accum_steps``, ``precision``, ``dtype``, ``timeout_s``).

The step runs in fresh processes that import it by name, with the test process's working
directory first on their path: run pytest from the project root, or install the project.

Options: ``--gradweight-timeout SECONDS`` (the step's time per framework, all its cases; default
`crosscheck.verification.verifier.DEFAULT_TIMEOUT_S`) and ``--gradweight-json-dir DIR`` (also
write each report there, named after the test, for CI to keep as an artifact).

Loading the plugin imports pytest and the standard library only: numpy and rich load when a
test uses the fixture, torch or JAX only in the processes that run the step.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from crosscheck.contract.spec import SchemeSpec
    from crosscheck.verification.objective_verify import ObjectiveReport
    from crosscheck.verification.report import VerifyReport
    from crosscheck.verification.verifier import Framework

#: Width of the table in a failure message: the wide layout where it fits, else the compact one.
MESSAGE_WIDTH = 120


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gradweight", "gradweight: loss weighting under data parallelism")
    group.addoption(
        "--gradweight-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a verified step gets per framework, all its cases (default: verify's)",
    )
    group.addoption(
        "--gradweight-json-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write every gradweight report here, named after its test",
    )


def _file_name(text: str) -> str:
    """`text` as a file name: runs of characters outside [A-Za-z0-9._-] become one '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "report"


class GradWeight:
    """The `gradweight` fixture: `verify` and `assert_weighting` for one test."""

    def __init__(
        self,
        report_dir: Path,
        test_name: str,
        timeout_s: float | None = None,
        json_dir: Path | None = None,
    ) -> None:
        self.report_dir = report_dir
        self.test_name = test_name
        self.timeout_s = timeout_s
        self.json_dir = json_dir
        #: Every JSON report this test wrote, in order.
        self.reports: list[Path] = []

    def verify(
        self,
        step: str | Callable[..., Any],
        *,
        framework: Framework,
        scheme: str | SchemeSpec | None = None,
        **options: Any,
    ) -> VerifyReport | ObjectiveReport:
        """`crosscheck.verify(step, framework=..., scheme=..., **options)`, its report written
        as JSON (see `reports`); ``objective=`` in place of `scheme` verifies a multi-term
        objective (an `ObjectiveReport`). Raises what `verify` raises (ValueError for a bad
        argument, `crosscheck.StepSetupError` for a step that does not exist); a mismatch is
        the report's ``ok`` being False, not an exception."""
        from crosscheck.verification.verifier import verify

        if self.timeout_s is not None:
            options.setdefault("timeout_s", self.timeout_s)
        started = time.perf_counter()
        report = verify(step, framework=framework, scheme=scheme, **options)
        record = report.to_json()
        record["wall_time_s"] = time.perf_counter() - started
        step_file = report.step.replace(":", ".")
        name = _file_name(f"{step_file}.{report.framework}.{report.intended_name}") + ".json"
        text = json.dumps(record, indent=2, allow_nan=False) + "\n"
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self.reports.append(self._write(self.report_dir / name, text))
        if self.json_dir is not None:
            self.json_dir.mkdir(parents=True, exist_ok=True)
            self._write(self.json_dir / f"{_file_name(self.test_name)}.{name}", text)
        return report

    def assert_weighting(
        self,
        step: str | Callable[..., Any],
        *,
        framework: Framework,
        scheme: str | SchemeSpec | None = None,
        **options: Any,
    ) -> VerifyReport | ObjectiveReport:
        """`verify`, raising AssertionError with the diagnosis and the table unless every case
        matches the intended `scheme` (or ``objective=``) (`failure_message`); the report when
        it does."""
        __tracebackhide__ = True  # pytest shows the test's line, not this one
        report = self.verify(step, framework=framework, scheme=scheme, **options)
        if not report.ok:
            raise AssertionError(failure_message(report, self.reports[-1]))
        return report

    @staticmethod
    def _write(path: Path, text: str) -> Path:
        # A second verify of the same step in one test keeps the first report.
        stem, number = path.stem, 2
        while path.exists():
            path = path.with_name(f"{stem}-{number}.json")
            number += 1
        path.write_text(text)
        return path


def failure_message(report: VerifyReport | ObjectiveReport, json_path: Path | None = None) -> str:
    """What ``crosscheck verify`` prints for `report`, as plain text, the verdict first (the
    line pytest's summary shows): the verdict, the name of what the step computes and the fix,
    then the table (one row per fixture and layout) and where the JSON report is."""
    from rich.console import Console

    from crosscheck.cli.verify_report import report_table

    out = io.StringIO()
    console = Console(file=out, width=MESSAGE_WIDTH, color_system=None, highlight=False)
    console.print(report.message(), markup=False, soft_wrap=True)
    table = report_table(console, report)
    table.title_justify = "left"
    console.print(table)
    if json_path is not None:
        console.print(f"JSON report: {json_path}", markup=False, soft_wrap=True)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


@pytest.fixture
def gradweight(request: pytest.FixtureRequest, tmp_path: Path) -> GradWeight:
    """Verify a training step's loss weighting in this test (see `crosscheck.pytest_plugin`)."""
    config = request.config
    json_dir = config.getoption("gradweight_json_dir")
    return GradWeight(
        tmp_path / "gradweight",
        request.node.name,
        timeout_s=config.getoption("gradweight_timeout"),
        # Relative to where pytest was started, even if a test changes directory.
        json_dir=None if json_dir is None else config.invocation_params.dir / json_dir,
    )
