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


def _row_sharded(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every one of `tensors` is a DTensor sharded on dim 0 over one 1-D mesh (what
    FSDP2 makes of every parameter and gradient)."""
    from torch.distributed.tensor import Shard

    meshes = {id(t.device_mesh) for t in tensors.values()}
    first = next(iter(tensors.values()))
    return (
        len(meshes) == 1
        and first.device_mesh.ndim == 1
        and all(tuple(t.placements) == (Shard(0),) for t in tensors.values())
    )


def _gather_rows(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Every row-sharded DTensor of `tensors` whole, as float64 numpy, in ONE all-gather.

    A Shard(0) placement splits dim 0 as ``torch.chunk`` does: rank r holds rows
    [r c, r c + n_r) with c = ceil(n / R) and n_r <= c. Each rank sends one float64 buffer
    of a fixed size: its row counts, then each tensor's rows in a slot of c rows (the
    conversion to float64 is exact from float32 and bfloat16); the pieces are put back in
    rank order. One collective instead of one per tensor (FSDP2's ``full_tensor``): on 2
    cores a 4-rank group waits for every peer at every collective."""
    import torch.distributed as dist

    mesh = next(iter(tensors.values())).device_mesh
    group, world_size = mesh.get_group(), mesh.size()
    layout = []  # (key, this rank's shard, global shape, rows per slot, elements per row)
    for key, tensor in tensors.items():
        rows = -(-int(tensor.shape[0]) // world_size)
        per_row = int(np.prod(tensor.shape[1:], dtype=np.int64))
        local = tensor.to_local().detach()
        if local.shape[0] > rows or tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
            raise RuntimeError(
                f"{key}: a local shard of shape {tuple(local.shape)} is not a torch.chunk "
                f"piece of {tuple(tensor.shape)} over {world_size} ranks"
            )
        layout.append((key, local, tuple(tensor.shape), rows, per_row))
    header = len(layout)
    size = header + sum(rows * per_row for *_, rows, per_row in layout)
    mine = torch.zeros(size, dtype=torch.float64, device=layout[0][1].device)
    at = header
    for index, (_, local, _, rows, per_row) in enumerate(layout):
        mine[index] = local.shape[0]
        mine[at : at + local.numel()] = local.reshape(-1).to(torch.float64)
        at += rows * per_row
    pieces = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(pieces, mine, group=group)
    gathered = [piece.cpu().numpy() for piece in pieces]
    out: dict[str, np.ndarray] = {}
    at = header
    for index, (key, _, shape, rows, per_row) in enumerate(layout):
        parts = [
            piece[at : at + int(piece[index]) * per_row].reshape(-1, *shape[1:])
            for piece in gathered
        ]
        whole = np.concatenate(parts, axis=0)
        if whole.shape != shape:
            raise RuntimeError(f"{key}: gathered {whole.shape} rows, expected {shape}")
        out[key] = whole
        at += rows * per_row
    return out


def numpy_full(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float64 numpy copies of `tensors`, each whole (all ranks call: sharded DTensors are
    all-gathered, all of them in one collective where they are row-sharded as FSDP2 shards
    them, else one ``full_tensor`` each)."""
    sharded = {key: t for key, t in tensors.items() if _is_dtensor(t)}
    if sharded and _row_sharded(sharded):
        out = _gather_rows(sharded)
    else:
        out = {
            key: _full(t.detach()).to("cpu", torch.float64).numpy() for key, t in sharded.items()
        }
    for key, tensor in tensors.items():
        if key not in sharded:
            out[key] = tensor.detach().to("cpu", torch.float64).numpy().copy()
    return {key: out[key] for key in tensors}


def local_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the gradients as this rank holds them (zeros where a gradient is
    None; a shard under FSDP2), keyed by the oracle's names: taken before clipping scales
    ``.grad`` in place, made whole later by `numpy_full`."""
    out = {}
    for name, p in module.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        out[name.rsplit(".", 1)[-1]] = grad.detach().clone()
    return out


def local_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as this rank holds them (a shard under FSDP2), detached, keyed by the
    oracle's names: made whole by `numpy_full`."""
    return {name.rsplit(".", 1)[-1]: p.detach() for name, p in module.named_parameters()}


def numpy_params(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the parameters, keyed by the oracle's names (all ranks call)."""
    return numpy_full(local_params(module))


def numpy_grads(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the gradients (zeros where a gradient is None; all ranks call)."""
    return numpy_full(local_grads(module))
