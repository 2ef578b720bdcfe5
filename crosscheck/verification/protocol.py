"""The step protocol: how `crosscheck verify` calls a user's training step, in each framework.

A step is named ``MODULE:FUNCTION`` (importable from the current directory); it computes the
gradient of one optimizer update the way the user's own code does, and the harness compares
that gradient with the oracle's for the scheme the user intends, on several fixtures and
layouts, and diagnoses it.

**torch.** ``step(model, microbatches)`` is called on every rank of a real gloo process group
(``torch.distributed`` is initialized; ``dist.get_rank()`` and ``dist.get_world_size()`` tell
where it is). ``model`` is the analytic model (``torch_impl.model.BilinearLM``: ``logits =
embed[inputs] @ unembed``, float64) wrapped in ``DistributedDataParallel``; ``microbatches`` is
this rank's list of M dicts of [B, T] tensors: ``inputs`` and ``targets`` (int64, ignored
targets are -100), ``segment_ids`` (int64, 0 is padding) and ``weights`` (float64), and on a
fixture of contract v2 its fields (``group_ids`` [B], ``document_ids`` [B, T], ``row_weights``
[B], ``sample_mask`` [B]; docs/schemes-as-data.md; on every fixture, with their defaults,
when the intended scheme is a spec). The step
runs forward and backward over all M microbatches (``no_sync`` or not, as the user's loop
does); the harness then reads the gradient from the parameters' ``.grad``. Variants, chosen by
the function's signature:

* a step whose first parameter is named ``model_factory`` gets a zero-argument callable that
  returns a fresh *unwrapped* model, wraps it itself (DDP, FSDP2, anything) and returns the
  wrapped model; the harness reads that model's gradients (DTensors gathered in full);
* a step that accepts an ``optimizer`` argument is given ``torch.optim.SGD(params, lr=1.0)``
  and may call ``optimizer.step()``: the harness then reads the update it applied, which for
  SGD with learning rate 1 is the gradient: the ``.grad`` left in place when it agrees with
  params before minus params after to within the one rounding of ``after`` (exact), else that
  difference (``torch_impl.harness.step_gradient``).

**JAX.** ``step(params, apply_fn, batch, mesh)`` runs in a worker process with 8 CPU devices
and ``jax_enable_x64``. ``params`` is ``{"embed": [V, H], "unembed": [H, V]}`` (float64
``jax.Array``); ``apply_fn(params, inputs)`` returns logits [..., V] (the Flax model's
``apply``, parameters passed as the plain dict above); ``batch`` holds the laid-out global
batch as numpy arrays of shape [R, M, B, T] (rank r's microbatch m is ``[r, m]``: ``inputs``,
``targets``, ``segment_ids``, ``weights``, and a v2 fixture's fields laid out the same way,
[R, M, B] per row); ``mesh`` is a 1-D ``jax.sharding.Mesh`` over R
devices with axis name ``"data"``. The step may use pmap, shard_map or jit inside and returns
the gradient as a dict with the params' keys and shapes (a leading device axis of size R, as
pmap returns, is accepted when every replica is identical). A step that accepts an
``optimizer`` argument is given ``optax.sgd(1.0)`` and returns the optax *updates* (minus the
gradient).

Either way, a step that raises, returns the wrong keys or shapes, or does not finish within
the time limit gets a `StepError` naming the fixture, layout and (for torch) rank.

**Your own model.** ``verify --model MODULE:FACTORY`` hands the step the user's model instead
of the analytic one. torch: ``FACTORY()`` returns a fresh unwrapped ``nn.Module`` with the same
initial weights every call (two calls' state dicts must be equal, else a `StepSetupError`);
the step gets it wrapped in DDP, or the factory for a ``model_factory`` step, in the job's
dtype, and the gradient is read by parameter name. JAX: ``FACTORY()`` returns ``(apply_fn,
params)``; the step is called as above with them, and returns a tree of the params' structure.
The reference is then the same model's float64 gradient (float32, with the step's model too,
for a torch model whose forward refuses float64), computed in one extra process
(`crosscheck.verification.model_basis`): the intended gradient, one backward of
``sum_t w_t l_t`` over the global batch, and the group basis the diagnosis fits on, one
backward per (row, segment) group; :math:`l_t` is the cross-entropy of the logits of
``--forward`` (default ``model(inputs)``, its ``.logits`` if any; JAX ``apply_fn(params,
inputs)``) against ``targets``. Rows must be independent (no batch statistics).

**A multi-term objective.** ``verify --objective`` (docs/objectives.md) hands the step the
multi-term model family instead: only the params the objective's terms read (``embed``;
``unembed`` for ce, z_loss, entropy and ref_kl; ``mtp_unembed`` for mtp; ``router`` for moe_lb;
the frozen ``ref_embed`` and ``ref_unembed`` for ref_kl), and for an mtp term the shifted
targets ``mtp_targets`` (y'_t = targets[t+1] inside the segment, else -100) beside the others.
torch: ``model`` is ``DistributedDataParallel(torch_impl.objective.ObjectiveLM)``, whose
``model(inputs, heads)`` returns ``{head: logits [B, T, out]}`` for heads among ``unembed``,
``mtp_unembed``, ``router`` and ``ref`` (the frozen reference's logits, without gradient); the
gradient is read from the trained params' ``.grad``. JAX: ``params`` holds those params and
``apply_fn(params, inputs, head="unembed")`` returns ``embed[inputs] @ params[head]``
(``head="ref"``: the reference's logits); the step returns the trained params' gradient (a
frozen param's entry, if any, is ignored).

**Params dtype.** ``verify --dtype bfloat16`` (or float32) hands the step the model (torch)
or params (JAX) in that dtype instead of float64; the gradient is read back as float64 and
judged at the precision its own noise shows (``crosscheck.diagnosis.verdict``).

**Context parallel.** A step that declares a parameter named ``context`` is a
context-parallel step: every row's T positions are split over C context ranks, contiguously
or in the load-balanced zigzag order (`crosscheck.contract.layout.Layout`,
docs/contract.md#context-parallel), and the step is called with ``context=`` on top of its
usual arguments, at every layout (C = 1 too, where the one context rank holds every position).
torch: the step runs on R x C processes, process r C + c holding data rank r's rows at context
rank c's positions; ``model`` is wrapped in DDP over all R C processes (so DDP's averaging
divides by R C); ``microbatches`` hold [B, T/C] tensors, the process's shard of each row; and
``context`` is a ``torch_impl.harness.user_step.ContextGroup``: ``size`` (C), ``rank`` (c),
``order``, ``positions`` (the [T/C] row positions the shard holds, increasing), ``mesh`` (the
2-D ("dp", "cp") ``DeviceMesh``), ``group`` (the C processes that share this process's rows)
and ``data_group`` (the R processes at this context rank). JAX: ``mesh`` is a 2-D ``Mesh`` of R
x C devices with axes ``("data", "context")``; every token array of ``batch`` is laid out [R, C,
M, B, T/C] (context rank c's positions of rank r's rows at ``[r, c]``), every row field [R, C,
M, B]; and ``context`` is a `ContextAxis` (``size``, ``order``, ``positions`` [C, T/C], ``axis``
``"context"``). Either way the intended gradient is the one without the split: the count of a
token-level scheme is reduced over data x context ranks, a segment's or group's over the
context ranks its positions lie on. A leading device axis on a returned leaf is accepted with
R C replicas.

**The logged denominator.** Two bugs can give the same gradient and differ only in what the
step believes D is (missing-world-size divides by D under an averaging reduction;
double-reduce-count divides by R D). A step can say what it divided by, where a training
loop would log it::

    from crosscheck import log_denominator
    ...
    log_denominator(global_valid_tokens)   # a number, or a 0-d tensor / concrete jax.Array

Call it once per update, outside any jit, on any rank; rank 0's last value of the call is
used (a torch step's ranks each call it with their own value, as a loop logs per rank). The
diagnosis then rules out the patterns that would have logged something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from crosscheck.contract.layout import Layout

#: What the step in this process logged since the harness last asked (see the docstring).
_logged_denominators: list[float] = []


def log_denominator(value: Any) -> None:
    """Record the denominator D the step divided this update's loss by (see the docstring)."""
    try:
        number = float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"log_denominator takes a number or a scalar tensor, got {type(value).__name__}: "
            f"{error} (inside jax.jit, return D and log it outside)"
        ) from None
    _logged_denominators.append(number)


def take_logged_denominator() -> float | None:
    """The last denominator logged since the previous call, or None; forgets them all."""
    value = _logged_denominators[-1] if _logged_denominators else None
    _logged_denominators.clear()
    return value


class StepError(RuntimeError):
    """The user's step could not be verified: it raised, returned the wrong thing, or hung."""


@dataclass(frozen=True, kw_only=True, slots=True, order=True)
class VerifyJob:
    """One call of the user's step: a fixture laid out as (world_size, accum_steps)."""

    fixture: str
    world_size: int
    accum_steps: int
    #: The dtype of the model / params handed to the step.
    dtype: str = "float64"
    #: Hand the step contract v2's four fields on every fixture (their defaults where the
    #: fixture gives none): verify sets it when the intended scheme is a spec, whose step
    #: reads them. Otherwise only the fields a fixture gives are handed on.
    row_fields: bool = False
    #: For a multi-term objective (``verify --objective``): the params handed to the step, those
    #: of the multi-term model family (docs/objectives.md) that the objective's terms read;
    #: the batch then holds ``mtp_targets`` too when ``mtp_unembed`` is among them. () for a
    #: single scheme, whose step gets the analytic model's ``embed`` and ``unembed``.
    objective_params: tuple[str, ...] = ()
    #: Context-parallel ranks C splitting every row's positions in `context_order`
    #: (`crosscheck.contract.layout.Layout`): the step runs on R x C processes (torch) or
    #: devices (JAX). 1: no split.
    context_size: int = 1
    context_order: str = "contiguous"

    @property
    def layout(self) -> Layout:
        return Layout(self.world_size, self.accum_steps, self.context_size, self.context_order)

    @property
    def processes(self) -> int:
        """R x C: the torch processes, or JAX devices, one call of the step runs on."""
        return self.world_size * self.context_size

    def describe(self) -> str:
        dtype = "" if self.dtype == "float64" else f" {self.dtype}"
        return f"{self.fixture} {self.layout.spelled()}{dtype}"


@dataclass(frozen=True, slots=True)
class ContextAxis:
    """What a JAX context-parallel step is handed as ``context`` (see the docstring): the mesh
    axis its shards lie along, how many there are and which positions of a row each holds."""

    #: C, the size of the mesh's ``axis``.
    size: int
    #: "contiguous" or "zigzag" (docs/contract.md#context-parallel).
    order: str
    #: [C, T/C] int64: row position of every slot of context rank c's shard, increasing.
    positions: np.ndarray
    #: The mesh axis name of the context ranks (the data-parallel one is "data").
    axis: str = "context"


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    """What the harness read from the step: the synchronized gradient, float64 numpy, and
    the denominator the step logged (rank 0's), if it did."""

    grads: dict[str, np.ndarray]
    logged_denominator: float | None = None
    #: The level of the coarsest floating dtype the step's gradient came back in, before the
    #: float64 copy (``crosscheck.diagnosis.verdict.level_of_dtypes``: "bfloat16" for a bf16
    #: or float16 one), or None where the harness cannot tell.
    #: A step that casts its model to bf16 itself returns a bf16 gradient: judged as a bf16
    #: step (``crosscheck.diagnosis.verdict.auto_levels``) whatever dtype it was handed.
    returned_dtype: str | None = None
