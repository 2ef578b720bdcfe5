"""`torch_impl.division`: G / D for every gradient of a model, the same bits one by one or
all at once, and the device path a GPU takes (run here on the meta device: no numbers, but
the divisor a GPU gets must be a tensor of the quotient's dtype beside the gradient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_impl.division import _divisor, divide_all_exactly, divide_exactly

#: Counts in float32 (in place), past 2^24 and odd (float32's float64 detour), a fraction.
DENOMINATORS = (3.0, 1477.0, 25165513.0, 1.5)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@pytest.mark.parametrize("D", DENOMINATORS)
def test_all_at_once_gives_the_bits_of_one_by_one(D: float) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4097, generator=gen).to(dtype) for dtype in DTYPES for _ in range(2)]
    one_by_one = [grad.clone() for grad in grads]
    for grad in one_by_one:
        divide_exactly(grad, D)
    together = [grad.clone() for grad in grads]
    divide_all_exactly(together, D)
    for dtype, want, got in zip([g.dtype for g in grads], one_by_one, together, strict=True):
        assert got.dtype == dtype
        assert np.array_equal(got.float().numpy(), want.float().numpy()), (dtype, D)
    # And float64's is numpy's correctly rounded quotient.
    assert np.array_equal(together[2].numpy(), grads[2].numpy() / D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DENOMINATORS)
def test_every_quotient_is_the_correctly_rounded_quotient_of_the_exact_denominator(
    dtype: torch.dtype, D: float
) -> None:
    """G / D rounded once to the gradient's dtype, D never rounded first: 25165513 (25 bits)
    divides as itself, not as float32's 25165512. The float64 quotient cast to `dtype` is
    that once-rounded quotient: float64 carries more than twice the bits of float32 or bf16
    plus two, so rounding it again cannot differ from rounding the exact quotient."""
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(4097, generator=gen).to(dtype)
    want = (grad.double() / D).to(dtype)
    one, together = grad.clone(), [grad.clone()]
    divide_exactly(one, D)
    divide_all_exactly(together, D)
    for got in (one, together[0]):
        assert got.dtype == dtype
        assert torch.equal(got, want), (dtype, D, int((got != want).sum()))


def test_a_zero_denominator_zeros_every_gradient_never_nan() -> None:
    grads = [torch.ones(5), torch.full((3,), 2.0, dtype=torch.float64)]
    divide_all_exactly(grads, 0.0)
    assert all(not grad.any() for grad in grads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DENOMINATORS)
def test_off_the_cpu_the_division_runs_with_a_device_divisor(dtype: torch.dtype, D: float) -> None:
    meta = torch.device("meta")
    divisor = _divisor(D, dtype, meta)  # CUDA's div_ by a Python float: a * (1 / D)
    assert isinstance(divisor, torch.Tensor) and divisor.shape == ()
    assert divisor.dtype == dtype and divisor.device == meta
    assert _divisor(D, dtype, torch.device("cpu")) == D  # the CPU divides by the float
    grads = [torch.empty(7, dtype=dtype, device="meta") for _ in range(2)]
    divide_all_exactly(grads, D)
    divide_exactly(grads[0], D)
    assert all(grad.dtype == dtype and grad.device.type == "meta" for grad in grads)
