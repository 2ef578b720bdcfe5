r"""The analytic bilinear language model as an ``nn.Module``.

For token t with input :math:`x_t`,

.. math::

    z_t = E[x_t]\, U

with :math:`E` = ``embed`` [V, H] and :math:`U` = ``unembed`` [H, V]: the same parameter names
and shapes as the numpy oracle and the Flax model, so one set of numpy params drives all three.
The loss (cross-entropy of :math:`z_t` against the target, float32 at least) lives in
``torch_impl.losses.token_losses``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

PARAM_NAMES: tuple[str, ...] = ("embed", "unembed")


class BilinearLM(nn.Module):
    """logits = embed[inputs] @ unembed, shape [B, T, V] for inputs [B, T]."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__()
        if vocab_size < 1 or hidden_size < 1:
            raise ValueError(
                f"BilinearLM needs vocab_size, hidden_size >= 1, got {vocab_size}, {hidden_size}"
            )
        self.embed = nn.Parameter(torch.zeros(vocab_size, hidden_size, dtype=dtype))
        self.unembed = nn.Parameter(torch.zeros(hidden_size, vocab_size, dtype=dtype))

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # A plain gather, not nn.Embedding: the parameter must be called `embed` with shape
        # [V, H] to match the oracle, and its gradient stays dense (DDP buckets need that).
        return self.embed[inputs] @ self.unembed

    @classmethod
    def from_numpy(
        cls, params: Mapping[str, np.ndarray], dtype: torch.dtype = torch.float64
    ) -> BilinearLM:
        """A model holding copies of `params` (``embed`` [V, H], ``unembed`` [H, V]) in `dtype`."""
        embed = np.asarray(params["embed"])
        model = cls(embed.shape[0], embed.shape[1], dtype)
        load_numpy_params(model, params)
        return model


def load_numpy_params(module: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Copy numpy params into `module`'s parameters of the same name, in place.

    ``torch.tensor`` copies: fixture arrays are read-only and must stay that way. Works through
    a DDP wrapper (names are matched on their last component) and leaves the tensors' identity
    unchanged, so a wrapper's buckets and hooks stay valid between cases.
    """
    own = {name.rsplit(".", 1)[-1]: p for name, p in module.named_parameters()}
    if set(own) != set(params):
        raise ValueError(f"parameter names differ: model has {sorted(own)}, got {sorted(params)}")
    with torch.no_grad():
        for name, param in own.items():
            value = torch.tensor(np.asarray(params[name]), dtype=param.dtype)
            if value.shape != param.shape:
                raise ValueError(
                    f"parameter {name!r}: model has shape {tuple(param.shape)}, "
                    f"got {tuple(value.shape)}"
                )
            if _is_dtensor(param):
                # FSDP2 shards: each rank slices its own shard locally (src_data_rank=None
                # skips the scatter; every rank already holds the full numpy value).
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(
                    value, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(value)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "placements")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded DTensor is all-gathered (a collective: call on every rank)."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def numpy_params(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the parameters, keyed by the oracle's names (all ranks call)."""
    return {
        name.rsplit(".", 1)[-1]: _full(p.detach()).to("cpu", torch.float64).numpy().copy()
        for name, p in module.named_parameters()
    }


def numpy_grads(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the gradients (zeros where a gradient is None)."""
    out = {}
    for name, p in module.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        out[name.rsplit(".", 1)[-1]] = _full(grad.detach()).to("cpu", torch.float64).numpy().copy()
    return out
