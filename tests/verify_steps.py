"""Training steps that break the step protocol, for tests/test_torch_verify.py.

The tests import them as ``verify_steps:NAME`` with ``tests/`` as the working directory (the
ranks find them through the current directory, as a user's own module). Each misbehaves in
one way a real loop can, and otherwise computes the global token mean like
``examples.torch_torchtitan`` (repeated here: ``examples`` is not importable from ``tests/``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel

Microbatches = list[dict[str, torch.Tensor]]


def token_mean_backward(model: nn.Module, microbatches: Microbatches, *, sync: bool = True) -> None:
    """The correct accumulation (sum / global valid count, times R for DDP's average)."""
    count = sum((batch["targets"] != -100).sum() for batch in microbatches)
    count = torch.as_tensor(count, dtype=torch.int64)
    dist.all_reduce(count)
    for index, batch in enumerate(microbatches):
        last = sync and index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"])
            loss = cross_entropy(
                logits.view(-1, logits.size(-1)), batch["targets"].view(-1), reduction="sum"
            )
            (loss / int(count) * dist.get_world_size()).backward()


def raise_on_rank1_when_accumulating(model: nn.Module, microbatches: Microbatches) -> None:
    """Rank 1 raises before its first backward when M > 1 (rank 0 is then in an all-reduce)."""
    if len(microbatches) > 1 and dist.get_rank() == 1:
        raise ValueError("rank 1 cannot accumulate")
    token_mean_backward(model, microbatches)


def never_synchronized(model: nn.Module, microbatches: Microbatches) -> None:
    """Every backward under no_sync (an off-by-one in the last-microbatch test): no all-reduce."""
    token_mean_backward(model, microbatches, sync=False)


def hang_everywhere(model: nn.Module, microbatches: Microbatches) -> None:
    """Never returns on any rank (a dataloader waiting for ever, say)."""
    time.sleep(600)


def hang_in_collective_on_rank1(model: nn.Module, microbatches: Microbatches) -> None:
    """When M > 1, rank 1 logs a metric with an all-reduce that no other rank joins."""
    token_mean_backward(model, microbatches)
    if len(microbatches) > 1 and dist.get_rank() == 1:
        dist.all_reduce(torch.zeros(1))


class PaddedLM(nn.Module):
    """The bilinear model with its vocabulary padded to a multiple of 16 (as LLM code does)."""

    def __init__(self, embed: torch.Tensor, unembed: torch.Tensor) -> None:
        super().__init__()
        vocab, hidden = embed.shape
        padded = -(-vocab // 16) * 16
        self.embed = nn.Parameter(torch.zeros(padded, hidden, dtype=embed.dtype))
        self.unembed = nn.Parameter(torch.zeros(hidden, padded, dtype=embed.dtype))
        with torch.no_grad():
            self.embed[:vocab] = embed
            self.unembed[:, :vocab] = unembed

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.embed[inputs] @ self.unembed


def misbehaving_factory_step(
    model_factory: Callable[[], nn.Module], microbatches: Microbatches
) -> nn.Module | None:
    """A model_factory step that goes wrong differently per accumulation steps M.

    M = 1: forgets to return the model. M = 2: returns a model with a padded vocabulary
    (wrong parameter shapes). M = 3: drops the embedding's gradient after backward.
    """
    base = model_factory()
    if len(microbatches) == 2:
        model = DistributedDataParallel(PaddedLM(base.embed.detach(), base.unembed.detach()))
    else:
        model = DistributedDataParallel(base)
    token_mean_backward(model, microbatches)
    if len(microbatches) == 1:
        return None
    if len(microbatches) == 3:
        model.module.embed.grad = None
    return model


def _summed_loss_backward(model: nn.Module, microbatches: Microbatches, divide_by: float) -> None:
    """Every microbatch's summed token loss divided by `divide_by`, under DDP's averaging."""
    for index, batch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"])
            loss = cross_entropy(
                logits.view(-1, logits.size(-1)), batch["targets"].view(-1), reduction="sum"
            )
            (loss / divide_by).backward()


def _global_count(microbatches: Microbatches) -> int:
    count = sum((batch["targets"] != -100).sum() for batch in microbatches)
    count = torch.as_tensor(count, dtype=torch.int64)
    dist.all_reduce(count)
    return int(count)


#: The fixed normalizer of `constant_normalizer` (verify it with --scheme constant:1000).
CONSTANT_C = 1000.0


def constant_normalizer(model: nn.Module, microbatches: Microbatches) -> None:
    """Sum of token losses over a normalizer fixed in advance, C = 1000, times R for DDP."""
    _summed_loss_backward(model, microbatches, CONSTANT_C / dist.get_world_size())


def averaged_grads_logged(model: nn.Module, microbatches: Microbatches) -> None:
    """The global count D, but no x R under DDP's averaging (missing-world-size); logs D."""
    from crosscheck import log_denominator

    count = _global_count(microbatches)
    log_denominator(count)
    _summed_loss_backward(model, microbatches, count)


def averaged_grads_unlogged(model: nn.Module, microbatches: Microbatches) -> None:
    """The same gradient as `averaged_grads_logged`, with nothing logged."""
    _summed_loss_backward(model, microbatches, _global_count(microbatches))


def cli_signal_child_then_hang(model: nn.Module, microbatches: Microbatches) -> None:
    """Starts a child process (a data-loader worker, say), then never returns, on every rank.

    For tests/test_cli_hardening.py: SIGTERM or Ctrl-C to ``python -m crosscheck verify`` must
    leave neither the ranks nor this child alive. The child's command line carries
    ``gradweight-cli-hang-child`` so that the test can see it has started.
    """
    import subprocess  # here, not at the top: appended to a shared module
    import sys

    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", "gradweight-cli-hang-child"]
    )
    time.sleep(600)


def _bf16_model_step(model_factory: Callable[[], nn.Module], microbatches: Microbatches, *,
                     per_microbatch: bool) -> nn.Module:  # fmt: skip
    """The model cast to bf16 by the step itself (a bf16 training loop), wrapped in DDP; the
    global token mean, or each microbatch's own mean (`per_microbatch`: microbatch-mean)."""
    model = DistributedDataParallel(model_factory().to(torch.bfloat16))
    count = _global_count(microbatches)
    M = len(microbatches)
    for index, batch in enumerate(microbatches):
        last = index == M - 1
        with contextlib.nullcontext() if last else model.no_sync():
            logits = model(batch["inputs"]).float()
            loss = cross_entropy(
                logits.view(-1, logits.size(-1)), batch["targets"].view(-1), reduction="sum"
            )
            if per_microbatch:  # the usual mean-loss loop: mean / M, DDP's average over R
                own = max(int((batch["targets"] != -100).sum()), 1)
                (loss / own / M).backward()
            else:  # the global count, times R against DDP's average
                (loss / count * dist.get_world_size()).backward()
    return model


def bf16_model(model_factory: Callable[[], nn.Module], microbatches: Microbatches) -> nn.Module:
    """Correct token mean, computed by a model the step casts to bf16."""
    return _bf16_model_step(model_factory, microbatches, per_microbatch=False)


def bf16_model_microbatch_mean(
    model_factory: Callable[[], nn.Module], microbatches: Microbatches
) -> nn.Module:
    """The same bf16 loop, each microbatch divided by its own count: microbatch-mean."""
    return _bf16_model_step(model_factory, microbatches, per_microbatch=True)


def autocast_bf16(model: nn.Module, microbatches: Microbatches) -> None:
    """Correct token mean under torch.autocast(bfloat16): the params stay as given, the
    matmuls compute in bf16."""
    count = _global_count(microbatches)
    for index, batch in enumerate(microbatches):
        last = index == len(microbatches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(batch["inputs"])
            loss = cross_entropy(
                logits.float().view(-1, logits.size(-1)), batch["targets"].view(-1),
                reduction="sum",
            )  # fmt: skip
            (loss / count * dist.get_world_size()).backward()
