"""torch_impl: the PyTorch reference of gradweight's normalization contract.

Scheme specs (contract v2, docs/schemes-as-data.md: every scheme, v1's names included, is a
``SchemeSpec``, read by ``torch_impl.spec``; a_t and D_u by ``torch_impl.spec_counts``, with a
count pre-pass for groups and documents that span ranks), one optimizer update under
DistributedDataParallel with accumulation in two strategies (precount: all-reduce d first and
backpropagate with s / D; postnorm: a comm hook that sums gradients and carries d in the same
all-reduce; ``torch_impl.update``, guarded by ``torch_impl.guards`` and ended by
``torch_impl.optimizer_step``: clip, step, record), a probe that measures the reduce factor s,
and a launcher that runs R real gloo processes with bounded waits. Atomic per-rank checkpoints
(``torch_impl.checkpoint``) stop a run after an update or inside its accumulation window, and
``torch_impl.resume`` continues it in fresh processes, between updates possibly at another world
size. The params may be float64, float32 or bfloat16; every count, d, D, weight sum and logged
loss sum stays float64 and the division by D is taken in float64 before the cast
(``losses.accumulation_dtype``). FSDP2 lives in ``torch_impl.fsdp`` (imported on demand: it
pulls in DTensor). Written independently of the numpy oracle and of jax_impl.
"""

from torch_impl.batch import IGNORE_INDEX, BatchError, TokenBatch, rank_microbatches
from torch_impl.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.harness.launcher import LaunchTimeoutError, RankFailedError, launch
from torch_impl.losses import MicrobatchLoss, microbatch_loss, token_losses
from torch_impl.mean_loss import accumulate_mean_loss
from torch_impl.model import BilinearLM
from torch_impl.optimizer_step import UpdateMetrics, clip_and_step
from torch_impl.optimizers import OptimizerSpec, make_optimizer
from torch_impl.partial import PartialAccumulation
from torch_impl.probe import ReductionPath, probe_ddp, probe_reduction
from torch_impl.resume import load_checkpoint, restore
from torch_impl.spec import NAMED_SPECS, SchemeSpec, get_spec, parse_spec
from torch_impl.update import (
    Accumulated,
    UpdatePlan,
    accumulate_partial,
    accumulate_postnorm,
    accumulate_precount,
    layout_plans,
    layout_weights,
)

__all__ = [
    "IGNORE_INDEX",
    "NAMED_SPECS",
    "Accumulated",
    "BatchError",
    "BilinearLM",
    "CheckpointError",
    "LaunchTimeoutError",
    "MicrobatchLoss",
    "OptimizerSpec",
    "PartialAccumulation",
    "PostnormState",
    "RankFailedError",
    "ReductionPath",
    "SchemeSpec",
    "TokenBatch",
    "UpdateMetrics",
    "UpdatePlan",
    "accumulate_mean_loss",
    "accumulate_partial",
    "accumulate_postnorm",
    "accumulate_precount",
    "clip_and_step",
    "get_spec",
    "latest_checkpoint",
    "launch",
    "layout_plans",
    "layout_weights",
    "load_checkpoint",
    "make_optimizer",
    "microbatch_loss",
    "parse_spec",
    "probe_ddp",
    "probe_reduction",
    "rank_microbatches",
    "restore",
    "save_checkpoint",
    "sum_and_carry_hook",
    "token_losses",
]
