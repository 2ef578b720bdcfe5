r"""What a user's step left behind, read as the gradient of one update (float64 numpy).

Without an optimizer the gradient is the parameters' ``.grad``; with one (SGD, learning rate
1, given to the step) it is what the step applied,

.. math::  g = \theta_{\text{before}} - \theta_{\text{after}},

exact up to one rounding. Parameters are matched on their last name component (``embed``,
``unembed``), wrapped or not; a sharded (FSDP2) parameter or gradient is gathered in full,
every rank alike. What cannot be read as a gradient is a `StepResultError` saying why.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from torch_impl.model import PARAM_NAMES


class StepResultError(ValueError):
    """The step returned, but what it left behind cannot be read as a gradient."""


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # A sharded DTensor (FSDP2) is all-gathered: a collective, which every rank reaches alike.
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


#: Name prefixes a wrapper adds to its module's parameters: DDP's ``module.``,
#: ``torch.compile``'s ``_orig_mod.``.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _unwrapped_name(name: str) -> str:
    """A parameter's name on the unwrapped model."""
    while name.startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def gradient_dtypes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[str, ...]:
    """The dtypes ("float32", "bfloat16", ...) of the gradient the step left: of the trained
    parameters' ``.grad`` (or, with an optimizer, of the parameters it stepped). A frozen
    parameter is no part of the gradient, and its dtype says nothing about it."""
    held = (
        None
        if optimizer is None
        else {id(p) for group in optimizer.param_groups for p in group["params"]}
    )
    return tuple(
        sorted(
            {
                str(tensor.dtype).removeprefix("torch.")
                for param in model.parameters()
                if param.requires_grad and (held is None or id(param) in held)
                if (tensor := param if optimizer is not None else param.grad) is not None
            }
        )
    )


def _applied_update(param: nn.Parameter, before: np.ndarray) -> np.ndarray:
    """What SGD(lr=1) applied to `param`: its ``.grad`` when that is what the step applied,
    else ``before - after``.

    ``after = fl(before - g)`` rounds once in the parameter's dtype, so ``before - after``
    (exact in float64) is g up to half a unit in the last place of ``after``: in a float32
    model that is eps32 |theta| per entry, which for a small gradient entry next to a large
    parameter (an expert few tokens reach) is a relative error far above float32-level, and
    the step would be judged by the read-back's rounding instead of its own. When the
    ``.grad`` left in place agrees with ``before - after`` to within that rounding everywhere,
    it is the update SGD applied, read exactly; otherwise (the step changed or cleared
    ``.grad`` after stepping) the difference is all there is.
    """
    after = _full(param.detach()).to("cpu", torch.float64)
    delta = torch.from_numpy(before) - after
    if param.grad is not None:
        grad = _full(param.grad.detach()).to("cpu", torch.float64)
        # One rounding of `after`: at most half its ulp, and ulp(x) <= eps |x| (+ the
        # smallest subnormal at 0): a bound with a factor 2 to spare.
        info = torch.finfo(param.dtype)
        bound = info.eps * after.abs() + info.smallest_normal
        if bool(((delta - grad).abs() <= bound).all()):
            return grad.numpy().copy()
    return delta.numpy()


def read_grads(
    model: nn.Module,
    params: Mapping[str, np.ndarray],
    optimizer: torch.optim.Optimizer | None,
    full_names: bool = False,
) -> dict[str, np.ndarray]:
    """The gradient the step left in `model`, float64 numpy, or StepResultError saying why not.

    Parameters are matched on their last name component (``module.embed`` under DDP); with
    `full_names` (a user's model, ``verify --model``) on their whole name less the prefixes a
    wrapper adds (`_unwrapped_name`). With an optimizer the gradient is ``params - after``
    (SGD, learning rate 1).
    """
    named: dict[str, nn.Parameter] = {}
    for name, param in model.named_parameters():
        if full_names and not param.requires_grad:  # frozen: no part of the gradient
            continue
        short = _unwrapped_name(name) if full_names else name.rsplit(".", 1)[-1]
        if short in named:
            raise StepResultError(f"the model holds two parameters named {short!r}")
        named[short] = param
    expected_names = sorted(params) if full_names else list(PARAM_NAMES)
    if set(named) != set(expected_names):
        missing, extra = sorted(set(expected_names) - set(named)), sorted(set(named) - set(params))
        raise StepResultError(
            f"the model's parameters are not the factory's: missing {missing[:5]}, unexpected "
            f"{extra[:5]}"
            if full_names
            else f"the model's parameters are {sorted(named)}, expected {list(PARAM_NAMES)}"
        )
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(id(p) not in held for p in named.values()):
            raise StepResultError(
                "the optimizer given to the step does not hold the returned model's parameters: "
                "the wrapper replaced them (fully_shard does); such a step must build its own "
                "optimizer after wrapping and take no optimizer argument"
            )
    grads = {}
    for name in expected_names:  # a fixed order: gathering a DTensor is a collective
        param, expected = named[name], np.asarray(params[name]).shape
        if tuple(param.shape) != expected:
            raise StepResultError(
                f"parameter {name!r} has shape {tuple(param.shape)}, expected {expected}"
            )
        if optimizer is not None:
            grads[name] = _applied_update(param, np.asarray(params[name], dtype=np.float64))
        elif param.grad is None:
            raise StepResultError(
                f"parameter {name!r} has no gradient (no backward reached it, or the step set "
                "it to None)"
            )
        else:
            grads[name] = _full(param.grad.detach()).to("cpu", torch.float64).numpy().copy()
    unchanged = optimizer is not None and not any(g.any() for g in grads.values())
    # Each rank looks at its own shard of a DTensor: no collective on a path one may skip.
    has_grads = any(p.grad is not None and bool(_local(p.grad).any()) for p in named.values())
    if unchanged and has_grads:
        raise StepResultError(
            "the parameters did not change although they have gradients: the step takes "
            "an optimizer but did not call optimizer.step()"
        )
    return grads
