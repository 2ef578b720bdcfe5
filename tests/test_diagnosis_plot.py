"""`Diagnosis.plot`, the picture behind `verify --plot`: what it draws from, and what it leaves
alone. The oracle's own gradients stand in for a step's (no process starts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import matplotlib
import pytest
from PIL import Image

from crosscheck.contract.oracle import loss_and_grad
from crosscheck.diagnosis.diagnose import diagnose
from crosscheck.fixtures.builtin import builtin_fixture


def _diagnosis(fixture: str, produced: str, intended: str, R: int, M: int):
    data = builtin_fixture(fixture)
    return diagnose(data, R, M, loss_and_grad(data, produced, R, M).grads, intended)


def test_the_picture_names_the_pattern_and_its_ratio_and_is_always_a_png(tmp_path: Path):
    seed = _diagnosis("seed", "rank_mean", "token_mean", 2, 1)
    written = seed.plot(tmp_path / "seed.jpg", "my.step")  # the name's suffix is not a format
    with Image.open(written) as image:
        assert image.format == "PNG"
        title = image.text["Title"]
    assert title.startswith("my.step: rank-mean, weight ratio 9x"), title
    assert title.endswith("seed, R=2, M=1; intended token_mean"), title


def test_signed_weights_are_drawn_below_zero_and_the_backend_is_left_alone(tmp_path: Path):
    signed = _diagnosis("rollouts", "signed_row_weight_mean", "signed_row_weight_mean", 2, 2)
    assert min(g.weight for g in signed.groups) < 0  # what the axis must reach
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a backend of the caller's that is not the Agg the picture uses
    try:
        signed.plot(tmp_path / "signed.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    with Image.open(tmp_path / "signed.png") as image:
        assert image.text["Title"].startswith("matches signed_row_weight_mean")


def test_a_gradient_holding_nan_has_nothing_to_draw(tmp_path: Path):
    packed = _diagnosis("packed", "microbatch_mean", "token_mean", 2, 2)
    broken = replace(packed, unusable="embed holds NaN at [0, 1]")
    with pytest.raises(ValueError, match=r"packed R=2 M=2: nothing to draw: embed holds NaN"):
        broken.plot(tmp_path / "broken.png")
    assert not (tmp_path / "broken.png").exists()
