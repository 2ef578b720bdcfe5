"""The transformer's shared initial weights: the committed file, its names, shapes and dtype,
regenerated from its script to the same values, and a wrong file refused by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from child_env import ROOT

from crosscheck.fixtures.transformer_weights import (
    TRANSFORMER_CONFIG,
    WEIGHTS_PATH,
    initial_weights,
    weight_shapes,
)


def test_the_committed_weights_have_every_name_shape_and_float64() -> None:
    weights = initial_weights()
    shapes = weight_shapes(TRANSFORMER_CONFIG)
    assert list(weights) == list(shapes)
    assert len(shapes) == 2 + 8 * TRANSFORMER_CONFIG.layers + 3
    assert shapes["layer1.qkv"] == (128, 384) and shapes["unembed"] == (128, 40)
    for name, value in weights.items():
        assert value.dtype == np.float64 and value.shape == shapes[name], name
        assert np.isfinite(value).all() and np.abs(value).max() > 0, name


def test_the_script_regenerates_the_committed_values(tmp_path) -> None:
    out = tmp_path / "again.npz"
    script = ROOT / "scripts" / "make_transformer_weights.py"
    run = subprocess.run(
        [sys.executable, str(script), "--out", str(out)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,  # numpy's import and 300k normal draws: about a second
    )
    assert run.returncode == 0, run.stderr[-2000:]
    again, committed = initial_weights(out), initial_weights(WEIGHTS_PATH)
    assert all(np.array_equal(again[k], committed[k]) for k in committed)


def test_a_file_of_another_shape_is_refused_by_name(tmp_path) -> None:
    weights = initial_weights()
    weights["layer0.up"] = weights["layer0.up"][:, :10]
    path = tmp_path / "wrong.npz"
    np.savez(path, **weights)
    with pytest.raises(ValueError, match=r"layer0.up is float64 \(128, 10\), .* \(128, 256\)"):
        initial_weights(path)
    del weights["layer0.up"]
    np.savez(path, **weights)
    with pytest.raises(ValueError, match=r"lacks \['layer0.up'\]"):
        initial_weights(path)
