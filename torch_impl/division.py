"""Dividing a gradient by the global denominator D without rounding D.

postnorm backpropagates the unnormalized sum and divides by D once every rank's d is known
(``torch_impl.update.accumulate_postnorm``): G / D, one correctly rounded quotient per entry,
with D the exact float64 sum of the ranks' d.

On a GPU the divisor is a 0-dim tensor on the gradient's device, not the Python float: CUDA's
``div_`` by a CPU scalar computes ``a * (1 / b)`` ("may lose one bit of precision compared to
computing the division", ``div_true_kernel_cuda`` in ATen's BinaryDivTrueKernel.cu), which
is not the correctly rounded quotient; by a device tensor it divides. scripts/gpu_check.sh
compares the GPU's quotients with the CPU's, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from torch_impl.losses import accumulation_dtype


def divide_exactly(grad: torch.Tensor, D: float) -> None:
    """grad <- grad / D, the quotient taken in ``accumulation_dtype`` and then cast, in place.

    Not ``grad.div_(D)``: for a float32 gradient torch casts the Python scalar D to float32
    first, so an odd D past 2^24 (dedup-seed's 25165513) would divide as 25165512 (about
    half the entries of its gradient come out different), and a bf16 gradient fares no
    better. Here the exact float64 D divides the upcast gradient (one float64 rounding, and
    dividing rather than multiplying by 1/D keeps it one) and only the quotient is cast to the
    gradient's dtype. D = 0: every a_t was 0 and the sums are exact zeros; zero them, never
    0/0. A float32 gradient whose D is a float32 (every count below 2^24) divides in place:
    one correctly rounded division, where the detour rounds twice and copies (docs/bench.md).
    """
    if not D:
        grad.zero_()
        return
    if _divides_in_place(grad, D):
        # D is exact in grad's dtype: not rounded, and no copy is needed.
        grad.div_(_divisor(D, grad.dtype, grad.device))
    else:
        acc = accumulation_dtype(grad.device)
        grad.copy_(grad.to(acc).div_(_divisor(D, acc, grad.device)))


def _divisor(D: float, dtype: torch.dtype, device: torch.device) -> float | torch.Tensor:
    """D as ``div_`` divides by it: the Python float on the CPU (a true division there), a
    0-dim `dtype` tensor on `device` elsewhere (CUDA would multiply by a CPU scalar's
    reciprocal; see the module docstring). D is exact in `dtype`: no rounding either way."""
    return D if device.type == "cpu" else torch.tensor(D, dtype=dtype, device=device)


def _divides_in_place(grad: torch.Tensor, D: float) -> bool:
    """Whether grad / D, taken in grad's own dtype, is the correctly rounded quotient of the
    exact float64 D: grad is in the accumulation dtype, or float32 with D a float32."""
    if grad.dtype == accumulation_dtype(grad.device):
        return True
    mantissa, exponent = math.frexp(D)  # a normal float32: 24-bit significand, in range
    return (
        grad.dtype == torch.float32 and -125 <= exponent <= 128 and (mantissa * 2**24).is_integer()
    )


def divide_all_exactly(grads: Iterable[torch.Tensor], D: float) -> None:
    """`divide_exactly` of every tensor of `grads` by D, those that divide in place in one call.

    On the CPU ``torch._foreach_div_`` divides each tensor by the same Python scalar D as
    ``div_`` does (it is that very loop, in C++), so the quotients are the same bits; what it
    saves is a Python call per parameter (about 40 us for the small transformer's 21 tensors,
    a tenth of a percent of its step: ``crosscheck bench``). Elsewhere each tensor goes
    through `divide_exactly` and its device divisor.
    """
    grads = list(grads)
    if not D:
        for grad in grads:
            grad.zero_()
        return
    in_place, detour = [], []
    for grad in grads:
        fast = grad.device.type == "cpu" and _divides_in_place(grad, D)
        (in_place if fast else detour).append(grad)
    if in_place:
        torch._foreach_div_(in_place, D)
    for grad in detour:
        divide_exactly(grad, D)
