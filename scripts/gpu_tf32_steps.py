"""torchtitan's step (examples/torch_torchtitan.py) with torch's TF32 matmul switch set.

``scripts/gpu_check.sh`` verifies a float32 step on a GPU twice, TF32 matmuls allowed and not,
and records the precision level each verdict is reached at. The switch is set inside the step,
on every rank, so it holds whatever the harness's rank processes inherited, and is put back
after, so that one job's setting never leaks into the next. On the CPU the switch does nothing
(it only affects CUDA matmuls): both steps then give the same gradient.

torch's default is ``torch.backends.cuda.matmul.allow_tf32 = False`` since 1.12 (the "TensorFloat-32
(TF32) on Ampere (and later) devices" section of https://pytorch.org/docs/stable/notes/cuda.html).
"""

from __future__ import annotations

import torch
from torch import nn

from examples.torch_torchtitan import step as torchtitan_step


def _with_tf32(
    allowed: bool, model: nn.Module, microbatches: list[dict[str, torch.Tensor]]
) -> None:
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_tf32
    matmul.allow_tf32 = allowed
    try:
        torchtitan_step(model, microbatches)
    finally:
        matmul.allow_tf32 = previous


def step_tf32(model: nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> None:
    """torchtitan's update with float32 matmuls on TF32 tensor cores (10-bit mantissa inputs)."""
    _with_tf32(True, model, microbatches)


def step_no_tf32(model: nn.Module, microbatches: list[dict[str, torch.Tensor]]) -> None:
    """torchtitan's update with true float32 matmuls (torch's default)."""
    _with_tf32(False, model, microbatches)
