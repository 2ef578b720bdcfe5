r"""The intended gradient and the group basis of a user's own torch model (``verify --model``).

A model factory ``MODULE:FACTORY`` returns a fresh, unwrapped ``nn.Module`` with the same
initial weights on every call. Here, in one process, at those weights and in float64 where the
model allows (``.to(torch.float64)``), the per-token loss of the global batch [N, T] is

.. math::  l_t = -\log \operatorname{softmax}(z_t)_{y_t}, \qquad z = \text{forward}(model, batch),

the cross-entropy of the model's logits against ``targets`` (-100: no loss). ``forward``
defaults to ``model(batch["inputs"])`` (its ``.logits`` where the output has them). Rows
must be independent (no batch statistics), so any subset of rows may be evaluated alone:

* the intended gradient :math:`\nabla_\theta \sum_t w_t l_t`, :math:`w_t = a_t / D` the
  intended scheme's effective weight of every token: one backward over the whole batch;
* the group basis :math:`b_g = \nabla_\theta \sum_{t \in g} u_t l_t` for every (row, segment)
  group g: one forward per row and one backward per group of that row.

Parameters are named as ``named_parameters`` names them on the unwrapped model; the flattened
vectors follow the names in sorted order (``crosscheck.diagnosis.group_basis.GroupBasis``).
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

IGNORE_INDEX = -100
Forward = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


class ModelSetupError(ValueError):
    """The model factory or forward cannot be used: missing, wrong type, or not repeatable."""


def load_callable(spec: str, cwd: str, what: str) -> Callable[..., Any]:
    """``MODULE:NAME`` imported with `cwd` first on sys.path; ModelSetupError says why not."""
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ModelSetupError(f"cannot import the {what} {spec!r}: {error!r}") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise ModelSetupError(f"the {what} {spec!r}: {module_name} has no callable {name!r}")
    return found


def fresh_model(factory: Callable[[], Any], spec: str, dtype: torch.dtype) -> nn.Module:
    """``factory()`` as `dtype`; ModelSetupError unless it is an ``nn.Module``."""
    model = factory()
    if not isinstance(model, nn.Module):
        raise ModelSetupError(
            f"the model factory {spec!r} returned a {type(model).__name__}, not a torch nn.Module"
        )
    return model.to(dtype)


def check_repeatable(factory: Callable[[], Any], spec: str) -> None:
    """ModelSetupError unless two calls of `factory` give equal state dicts: the step and the
    reference must start from the same weights (seed the factory, e.g. torch.manual_seed)."""
    first = fresh_model(factory, spec, torch.float64).state_dict()
    second = fresh_model(factory, spec, torch.float64).state_dict()
    if list(first) != list(second):
        raise ModelSetupError(f"two calls of the model factory {spec!r} gave different parameters")
    for name, value in first.items():
        if not torch.equal(value, second[name]):
            raise ModelSetupError(
                f"two calls of the model factory {spec!r} gave different values of {name!r}: "
                "it must return the same initial weights every call (seed it, e.g. "
                "torch.manual_seed(0) before building the model)"
            )


def default_forward(model: nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(inputs)``, or its ``.logits`` when the output has them (Hugging Face)."""
    out = model(microbatch["inputs"])
    return out.logits if hasattr(out, "logits") else out


def token_losses(
    model: nn.Module, forward: Forward, microbatch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """l_t [B, T] in the logits' dtype (float64 on a float64 model); 0 where target is -100."""
    logits = forward(model, microbatch)
    targets = microbatch["targets"]
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"the forward returned logits of shape {tuple(logits.shape)}; expected "
            f"{tuple(targets.shape)} + (vocab,) for targets of shape {tuple(targets.shape)}"
        )
    losses = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return losses.reshape(targets.shape)


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _flat_grad(loss: torch.Tensor, params: list[nn.Parameter], retain: bool) -> np.ndarray:
    """The gradient of `loss`, flattened over `params` in order (zeros where it does not reach)."""
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return np.concatenate(
        [
            (torch.zeros_like(p) if g is None else g).detach().to(torch.float64).reshape(-1).numpy()
            for p, g in zip(params, grads, strict=True)
        ]
    )


def _rows(batch: Mapping[str, np.ndarray], rows: slice) -> dict[str, torch.Tensor]:
    """Rows of the global batch as the step gets them: int64 ids, float64 weights."""
    return {
        key: torch.as_tensor(
            np.array(value[rows], dtype=np.float64 if value.dtype.kind == "f" else np.int64)
        )
        for key, value in batch.items()
    }


def intended_gradient(
    model: nn.Module,
    forward: Forward,
    batch: Mapping[str, np.ndarray],
    token_weights: np.ndarray,
) -> dict[str, np.ndarray]:
    """grad of sum_t w_t l_t over the global batch [N, T] (float64 numpy per parameter)."""
    named = _named(model)
    weights = torch.as_tensor(token_weights, dtype=torch.float64)
    losses = token_losses(model, forward, _rows(batch, slice(None)))
    flat = _flat_grad((losses.to(torch.float64) * weights).sum(), [p for _, p in named], False)
    out, start = {}, 0
    for name, param in named:
        out[name] = flat[start : start + param.numel()].reshape(tuple(param.shape))
        start += param.numel()
    return out


def group_basis(
    model: nn.Module,
    forward: Forward,
    batch: Mapping[str, np.ndarray],
    group_of: np.ndarray,
    units: np.ndarray,
) -> tuple[np.ndarray, tuple[tuple[str, tuple[int, ...]], ...]]:
    """(B [K, P], the parameter shapes in sorted-name order): b_g for every group of
    `group_of` [N, T] (-1: no group), one forward per row and one backward per group."""
    named = _named(model)
    params = [p for _, p in named]
    num_groups = int(group_of.max(initial=-1)) + 1
    size = sum(p.numel() for p in params)
    basis = np.zeros((num_groups, size))
    for row in range(group_of.shape[0]):
        groups = np.unique(group_of[row][group_of[row] >= 0])
        if groups.size == 0:
            continue
        losses = token_losses(model, forward, _rows(batch, slice(row, row + 1)))[0]
        losses = losses.to(torch.float64)
        for index, group in enumerate(groups):
            mask = torch.as_tensor(np.where(group_of[row] == group, units[row], 0.0))
            last = index == groups.size - 1  # the row's graph is freed after its last group
            basis[group] = _flat_grad((losses * mask).sum(), params, retain=not last)
    shapes = tuple((name, tuple(param.shape)) for name, param in named)
    return basis, shapes


def default_aux_loss(model: nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own auxiliary loss of one forward: ``model(input_ids=inputs,
    output_router_logits=True).aux_loss``, a Hugging Face MoE model's router load-balancing
    loss (Switch's E sum_e f_e P_e over the forward's tokens, f a count without gradient)."""
    out = model(input_ids=microbatch["inputs"], output_router_logits=True)
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        raise ValueError(
            f"the model's forward returned no aux_loss ({type(out).__name__}): a moe_lb term "
            "with --model needs a model whose forward returns its router loss (a Hugging Face "
            "MoE model: Mixtral, Qwen-MoE, ...)"
        )
    return aux


def aux_gradients(
    model: nn.Module, batch: Mapping[str, np.ndarray], slices: list[tuple[int, int]]
) -> list[np.ndarray]:
    r""":math:`\nabla_\theta A(\text{rows } [a, b))` for every slice: the model's own
    auxiliary loss of one forward over those rows (`default_aux_loss`), flattened over the
    parameters in sorted-name order. A microbatch of a layout is such a slice of the global
    batch (rank-major rows), so one backward per distinct slice serves every layout."""
    params = [p for _, p in _named(model)]
    out = []
    for start, stop in slices:
        aux = default_aux_loss(model, _rows(batch, slice(start, stop)))
        out.append(_flat_grad(aux.to(torch.float64), params, retain=False))
    return out


def compute_reference(rank: int, world_size: int, request: dict[str, Any]) -> dict[str, Any]:
    """A ``launch`` target (one process): the reference of ``crosscheck verify --model``.

    `request` holds ``model`` and ``forward`` (``MODULE:NAME``, forward may be ""), ``cwd``,
    ``fixtures`` {name: (batch arrays, group_of, units)}, ``weightings`` [(fixture, token
    weights)] and, for a moe_lb term, ``aux_slices`` {name: [(start, stop)]}. Returns
    ``{"bases": {name: (B, shapes)}, "intended": [grads per weighting], "aux": {name: [flat
    gradient per slice]}}``,
    or ``{"setup_error": message}`` / ``{"error": message}``; never raises.
    """
    try:
        factory = load_callable(request["model"], request["cwd"], "model factory")
        forward = (
            load_callable(request["forward"], request["cwd"], "forward")
            if request["forward"]
            else default_forward
        )
        check_repeatable(factory, request["model"])
    except ModelSetupError as error:
        return {"setup_error": str(error)}
    except Exception as error:
        return {"setup_error": f"calling the model factory {request['model']!r} raised {error!r}"}
    try:
        dtype, refused = _finest_dtype(factory, request, forward)
        model = fresh_model(factory, request["model"], dtype)
        bases = {
            name: group_basis(model, forward, batch, group_of, units)
            for name, (batch, group_of, units) in request["fixtures"].items()
        }
        intended = [
            intended_gradient(model, forward, request["fixtures"][name][0], weights)
            for name, weights in request["weightings"]
        ]
        # A moe_lb term's reference: the model's own router loss per microbatch slice.
        aux = {
            name: aux_gradients(model, request["fixtures"][name][0], slices)
            for name, slices in request.get("aux_slices", {}).items()
        }
    except Exception as error:
        frames = "".join(traceback.format_exception(error)[-6:])
        return {"error": f"the model's reference gradient raised {error!r}\n{frames}"}
    out = {"bases": bases, "intended": intended, "dtype": str(dtype).removeprefix("torch.")}
    if aux:
        out["aux"] = aux
    if refused:
        out["refused"] = refused
    return out


def _finest_dtype(
    factory: Callable[[], Any], request: dict[str, Any], forward: Forward
) -> tuple[torch.dtype, str]:
    """float64 when the model's forward runs in it, else float32 with the reason: a model whose
    kernels refuse float64 (transformers' ``grouped_mm`` MoE experts: "Expected mat_a to be
    Float32, BFloat16 or Float16 matrix, got Double") is still verified, at float32-level.
    Tried on one row of the first fixture; a float32 failure is the model's own, raised."""
    if not request["fixtures"]:  # nothing to compute: no dtype to choose
        return torch.float64, ""
    batch = next(iter(request["fixtures"].values()))[0]
    row = _rows(batch, slice(0, 1))
    try:
        # A model of its own, dropped after: a forward in train mode may change a model's
        # state (a buffer, running statistics), and the reference starts from the factory's.
        with torch.no_grad():
            forward(fresh_model(factory, request["model"], torch.float64), row)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        return torch.float32, reason
    return torch.float64, ""
