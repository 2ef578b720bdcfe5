r"""The small decoder-only transformer in torch: pre-LN, segment-aware causal attention.

For a row of tokens :math:`x_t` with segment ids :math:`s_t` (packed documents; 0 = padding):

.. math::

    h^0_t &= E[x_t] + P[\mathrm{pos}_t] \qquad \mathrm{pos}_t = t - (\text{start of } t\text{'s
    run of equal } s) \text{, and } 0 \text{ on padding}\\
    h &\leftarrow h + \mathrm{Attn}(\mathrm{LN}_1(h))\, W_{out}, \qquad
    h \leftarrow h + \mathrm{gelu}(\mathrm{LN}_2(h)\, W_{up})\, W_{down}
    \quad \text{(per layer)}\\
    z_t &= \mathrm{LN}_f(h_t)\, U

with :math:`q, k, v = \mathrm{split}(\mathrm{LN}_1(h) W_{qkv})` over ``heads`` heads,
scores :math:`q_i k_j^T / \sqrt{W / \text{heads}}`, and token i attending to token j iff
:math:`j \le i` and :math:`s_i = s_j`; a padding token (segment 0) attends only to itself, so
no softmax row is empty. :math:`\mathrm{LN}(z) = (z - \bar z) / \sqrt{\mathrm{var}(z) +
\epsilon}\, \gamma + \beta` with the biased variance, and
:math:`\mathrm{gelu}(z) = \tfrac12 z (1 + \tanh(\sqrt{2/\pi}(z + 0.044715 z^3)))`.

The parameters are registered so that ``named_parameters()`` gives exactly the names of the
shared weights file (``crosscheck.fixtures.transformer_weights``): ``embed``, ``positions``,
``layer0.ln1.scale``, ..., ``unembed``. That module is data only (the configuration and the
float64 initial weights); the math here is written for torch, independently of the JAX model
and of the numpy oracle, so that comparing them can find a bug in any one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from crosscheck.fixtures.transformer_weights import (
    TRANSFORMER_CONFIG,
    TransformerConfig,
    initial_weights,
    weight_shapes,
)
from torch_impl.batch import IGNORE_INDEX, TokenBatch, context_positions

#: The prefix DistributedDataParallel (and torch.compile) put before the module's own names.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class LayerNorm(nn.Module):
    """(z - mean) / sqrt(var + eps) * scale + bias over the last axis, biased variance."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(width, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(width, dtype=dtype))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        centred = z - z.mean(dim=-1, keepdim=True)
        variance = (centred * centred).mean(dim=-1, keepdim=True)
        return centred / torch.sqrt(variance + self.eps) * self.scale + self.bias


def gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    """0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), written out (not F.gelu's switch)."""
    return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))


class Block(nn.Module):
    """One pre-LN layer: x + attention(LN1(x)) @ out, then x + gelu(LN2(x) @ up) @ down."""

    def __init__(self, config: TransformerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        W, F = config.width, config.mlp
        self.heads = config.heads
        self.ln1 = LayerNorm(W, config.ln_eps, dtype)
        self.qkv = nn.Parameter(torch.zeros(W, 3 * W, dtype=dtype))
        self.out = nn.Parameter(torch.zeros(W, W, dtype=dtype))
        self.ln2 = LayerNorm(W, config.ln_eps, dtype)
        self.up = nn.Parameter(torch.zeros(W, F, dtype=dtype))
        self.down = nn.Parameter(torch.zeros(F, W, dtype=dtype))

    def forward(
        self, x: torch.Tensor, allowed: torch.Tensor, context: ContextShard | None = None
    ) -> torch.Tensor:
        B, T, W = x.shape
        head = W // self.heads
        q, k, v = (self.ln1(x) @ self.qkv).split(W, dim=-1)
        if context is not None:  # this shard's queries against every shard's keys and values
            k, v = context.gather(k), context.gather(v)
        # [B, T, W] -> [B, heads, T, head]: every head attends on its own slice of the width.
        q, k, v = (y.view(B, -1, self.heads, head).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head)
        # -inf where j may not be seen: exp gives exactly 0 there, and its gradient is 0 too.
        scores = scores.masked_fill(~allowed[:, None], -math.inf)
        mixed = torch.softmax(scores, dim=-1) @ v
        x = x + mixed.transpose(1, 2).reshape(B, T, W) @ self.out
        return x + gelu_tanh(self.ln2(x) @ self.up) @ self.down


class _GatherPositions(torch.autograd.Function):
    """[B, T/C, W] of every context rank, concatenated in rank order along the positions;
    backward: the gradient of the whole summed over the context ranks (each rank's loss reads
    every rank's keys and values), and this rank's slice of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width = group, rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # reduced in place: never autograd's own buffer
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.rank * ctx.width
        return grad[:, start : start + ctx.width], None, None


class ContextShard(NamedTuple):
    """This process's share of every row under context parallel: `positions` [T/C] of the
    row's T (increasing), its context rank, and the process group of the row's C context
    ranks (`torch_impl.batch.context_positions` gives every rank's positions)."""

    positions: torch.Tensor
    rank: int
    group: dist.ProcessGroup

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T/C, ...] of every context rank in rank order, differentiably."""
        return _GatherPositions.apply(x, self.group, self.rank)

    def whole_rows(self, segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(segment ids of the whole rows [B, T] in position order, the position of each
        gathered key [T]): labels only, no gradient."""
        C = dist.get_world_size(self.group)
        parts = [torch.empty_like(segment_ids) for _ in range(C)]
        dist.all_gather(parts, segment_ids.contiguous(), group=self.group)
        positions = [torch.empty_like(self.positions) for _ in range(C)]
        dist.all_gather(positions, self.positions.contiguous(), group=self.group)
        gathered_positions = torch.cat(positions)
        whole = torch.empty_like(torch.cat(parts, dim=1))
        whole[:, gathered_positions] = torch.cat(parts, dim=1)
        return whole, gathered_positions


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """pos_t: t minus the start of t's run of equal segment ids along the row; 0 on padding."""
    T = segment_ids.shape[1]
    index = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    # The latest run start at or before t: a running max of the start indices.
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return torch.where(segment_ids == 0, torch.zeros_like(index), index - run_start)


def attention_allowed(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool: i sees j iff j <= i and s_i = s_j != 0; padding sees itself only."""
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    in_document = (segment_ids != 0)[:, :, None]
    itself = torch.eye(T, dtype=torch.bool, device=segment_ids.device)
    return (causal & same & in_document) | itself


class TinyTransformer(nn.Module):
    """logits [B, T, V] = TinyTransformer(...)(inputs [B, T], segment_ids [B, T]).

    `weights` (npz name -> array) default to the committed initial weights; parameters are
    held in `dtype` (float64 by default, as the reference checks need).
    """

    def __init__(
        self,
        config: TransformerConfig = TRANSFORMER_CONFIG,
        weights: Mapping[str, np.ndarray] | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        self.config = config
        W = config.width
        self.embed = nn.Parameter(torch.zeros(config.vocab, W, dtype=dtype))
        self.positions = nn.Parameter(torch.zeros(config.max_positions, W, dtype=dtype))
        for i in range(config.layers):
            self.add_module(f"layer{i}", Block(config, dtype))
        self.final_ln = LayerNorm(W, config.ln_eps, dtype)
        self.unembed = nn.Parameter(torch.zeros(W, config.vocab, dtype=dtype))
        if weights is None:
            if config != TRANSFORMER_CONFIG:
                raise ValueError(
                    "TinyTransformer: the committed initial weights are TRANSFORMER_CONFIG's; "
                    f"a model of {config} needs its own `weights`"
                )
            weights = initial_weights()
        load_weights(self, weights)

    def blocks(self) -> list[Block]:
        return [getattr(self, f"layer{i}") for i in range(self.config.layers)]

    def forward(
        self, inputs: torch.Tensor, segment_ids: torch.Tensor, context: ContextShard | None = None
    ) -> torch.Tensor:
        """logits [B, T, V]; under context parallel (`context`) the logits of this shard's
        positions [B, T/C, V], attending to every shard's keys and values of the rows (the
        positions and the attention mask are the whole rows'), as torchtitan's context
        parallel does."""
        self._check(inputs, segment_ids)
        if context is not None:
            T = inputs.shape[1] * dist.get_world_size(context.group)
            if self.config.max_positions < T:
                raise ValueError(
                    f"TinyTransformer.forward: rows of {T} tokens (every context shard's) "
                    f"exceed the {self.config.max_positions} positions the model has"
                )
        if context is None:
            positions, allowed = segment_positions(segment_ids), attention_allowed(segment_ids)
        else:
            whole, key_positions = context.whole_rows(segment_ids)
            positions = segment_positions(whole)[:, context.positions]
            # Rows: this shard's queries; columns: the gathered keys, in their gathered order.
            allowed = attention_allowed(whole)[:, context.positions][:, :, key_positions]
        # A plain gather, not nn.Embedding: the gradient stays dense (DDP's buckets need it).
        x = self.embed[inputs] + self.positions[positions]
        for block in self.blocks():
            x = block(x, allowed, context)
        return self.final_ln(x) @ self.unembed

    def _check(self, inputs: torch.Tensor, segment_ids: torch.Tensor) -> None:
        """Refuse, naming the array and why, what would otherwise fail deep inside or
        silently (a position past the table would be an index error; a float id a cast)."""
        where = "TinyTransformer.forward"
        for name, ids in (("inputs", inputs), ("segment_ids", segment_ids)):
            if ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"{where}: {name} must be an integer tensor (int64 or int32), got {ids.dtype}"
                )
        if inputs.dim() != 2 or segment_ids.shape != inputs.shape:
            raise ValueError(
                f"{where}: inputs and segment_ids must both be [B, T], got "
                f"{tuple(inputs.shape)} and {tuple(segment_ids.shape)}"
            )
        if inputs.shape[1] > self.config.max_positions:
            raise ValueError(
                f"{where}: rows of {inputs.shape[1]} tokens exceed the "
                f"{self.config.max_positions} positions the model has"
            )
        bad = (inputs < 0) | (inputs >= self.config.vocab)
        if bool(bad.any()):
            row, pos = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(
                f"{where}: input token {int(inputs[row, pos])} at row {row}, position {pos} "
                f"is outside the vocabulary [0, {self.config.vocab})"
            )
        if bool((segment_ids < 0).any()):
            row, pos = (int(i) for i in torch.nonzero(segment_ids < 0)[0])
            raise ValueError(
                f"{where}: segment id {int(segment_ids[row, pos])} at row {row}, position "
                f"{pos} is negative (0 is padding, documents are 1, 2, ...)"
            )


def token_losses(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor
) -> torch.Tensor:
    r"""l_t = logsumexp(z_t) - z_t[y_t] [B, T], exactly 0 where y_t = IGNORE_INDEX (-100).

    `model` is a TinyTransformer or a wrapper of one (DDP): it is called, so the wrapper's
    hooks run. Computed in float32 at least (a bf16 model's logits are upcast first).
    """
    logits = model(inputs, segment_ids)
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return cross_entropy(
        upcast.flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view_as(targets)


def microbatch_token_losses(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
    """`token_losses` of one microbatch: the ``per_token_losses`` an update step takes
    (``torch_impl.update``) to train this model."""
    return token_losses(model, batch.inputs, batch.targets, batch.segment_ids)


def context_parallel_token_losses(
    groups: Mapping[int, dist.ProcessGroup], order: str
) -> Callable[[nn.Module, TokenBatch], torch.Tensor]:
    """The ``per_token_losses`` of a context-parallel update: each microbatch
    (`torch_impl.batch.context_microbatches`, marked with its context rank) through the model
    with its `ContextShard`; `groups` maps a data rank to its C context ranks' group."""

    def losses(model: nn.Module, batch: TokenBatch) -> torch.Tensor:
        C = batch.context_size
        T = batch.targets.shape[1] * C
        positions = torch.as_tensor(context_positions(T, C, order)[batch.context_rank])
        shard = ContextShard(positions, batch.context_rank, groups[batch.rank // C])
        logits = model(batch.inputs, batch.segment_ids, shard)
        upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return cross_entropy(
            upcast.flatten(0, 1),
            batch.targets.flatten(),
            reduction="none",
            ignore_index=IGNORE_INDEX,
        ).view_as(batch.targets)

    return losses


def transformer_param_name(npz_key: str) -> str:
    """The torch parameter name of a weights-file key: the same string (nested modules)."""
    if npz_key not in weight_shapes(TRANSFORMER_CONFIG):
        raise ValueError(f"{npz_key!r} is not a parameter of the transformer")
    return npz_key


def _own_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def load_weights(module: nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Copy `weights` (npz name -> array) into the module's parameters in place.

    Works through a DDP wrapper and keeps the tensors' identity (the wrapper's buckets and
    hooks stay valid between cases); names and shapes must match exactly.
    """
    own = {_own_name(name): p for name, p in module.named_parameters()}
    if set(own) != set(weights):
        raise ValueError(
            f"transformer weights: missing {sorted(set(own) - set(weights))}, unknown "
            f"{sorted(set(weights) - set(own))}"
        )
    with torch.no_grad():
        for name, param in own.items():
            value = torch.tensor(np.asarray(weights[name]), dtype=param.dtype)
            if value.shape != param.shape:
                raise ValueError(
                    f"transformer weights: {name} has shape {tuple(value.shape)}, the model "
                    f"needs {tuple(param.shape)}"
                )
            param.copy_(value)


def named_weights(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the parameters, keyed by the weights file's names."""
    return {
        _own_name(name): p.detach().to(torch.float64).numpy().copy()
        for name, p in module.named_parameters()
    }


def named_grads(module: nn.Module) -> dict[str, np.ndarray]:
    """float64 numpy copies of the gradients, keyed like `named_weights` (0 where None)."""
    return {
        _own_name(name): (torch.zeros_like(p) if p.grad is None else p.grad)
        .detach()
        .to(torch.float64)
        .numpy()
        .copy()
        for name, p in module.named_parameters()
    }
