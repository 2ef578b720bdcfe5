r"""The torch side of the bench: one DDP rank, three ways to weight its update, timed in turn.

Runs in every rank process of a `torch_impl.harness.launcher.launch` (gloo on the CPU, or an
NCCL group of one GPU per rank). Each path is one update of M microbatches of the small
transformer (`torch_impl.transformer`, float32): forward and backward of every microbatch,
the gradient all-reduce in the last backward (the others under ``no_sync()``), the
normalization; no optimizer step (the same for every path, so it is left out of the time).
With G_{rm} the gradient of the summed token losses of rank r's microbatch m, n_r rank r's
valid targets over its M microbatches and N = sum_r n_r:

naive
    backpropagate (sum of token losses) / n_r; DDP averages: (1/R) sum_r G_r / n_r.
precount
    one all-reduce of n_r first gives N; backpropagate (sum) * R / N; DDP averages:
    sum_r G_r / N.
fused
    backpropagate the plain sum; the postnorm comm hook (`torch_impl.comm_hooks`) sums the
    bucket and carries n_r in the same all-reduce; divide the gradient by N.

Before timing, each path's gradient is judged against the references (`crosscheck.bench.checks`)
and a path that fails is not timed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from crosscheck.bench.checks import float64_tree, refusals
from crosscheck.bench.config import IGNORE_INDEX, BenchConfig, packed_batch
from crosscheck.bench.memory import peak_rss_delta, rss_supported
from crosscheck.launch.processes import usable_cores
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.division import divide_all_exactly
from torch_impl.transformer import TinyTransformer, token_losses
from torch_impl.update import sync_context

PATHS = ("naive", "precount", "fused")
Microbatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, targets, segment_ids


class Paths:
    """The three update paths of one rank, over the same microbatches and initial weights."""

    def __init__(
        self, microbatches: Sequence[Microbatch], device: torch.device, group: object
    ) -> None:
        self.microbatches = list(microbatches)
        self.group = group
        self.world_size = dist.get_world_size(group)
        ids = [device.index] if device.type == "cuda" else None

        def replica() -> nn.Module:
            return TinyTransformer(dtype=torch.float32).to(device)

        # naive and precount share DDP's default (averaging) reducer; fused needs its own
        # DDP, whose reducer runs the postnorm hook instead (a hook cannot be unregistered).
        self.averaging = DistributedDataParallel(replica(), device_ids=ids, process_group=group)
        self.hook_state = PostnormState(
            rank=dist.get_rank(group), world_size=self.world_size, process_group=group
        )
        self.carrying = DistributedDataParallel(replica(), device_ids=ids, process_group=group)
        self.carrying.register_comm_hook(self.hook_state, sum_and_carry_hook)
        self.reference = replica()  # no DDP: this rank's own, unreduced gradient
        self.run: dict[str, Callable[[], None]] = {
            "naive": self.naive,
            "precount": self.precount,
            "fused": self.fused,
        }

    def local_count(self) -> int:
        """n_r: valid targets of this rank over its M microbatches (labels only)."""
        return sum(int((targets != IGNORE_INDEX).sum()) for _, targets, _ in self.microbatches)

    def _backward_all(self, model: nn.Module, scale: float | None) -> None:
        """Forward and backward every microbatch; only the last one synchronizes."""
        last = len(self.microbatches) - 1
        for m, (inputs, targets, segment_ids) in enumerate(self.microbatches):
            with sync_context(model, m == last):
                loss_sum = token_losses(model, inputs, targets, segment_ids).sum()
                (loss_sum if scale is None else loss_sum * scale).backward()

    def naive(self) -> None:
        """(1/R) sum_r G_r / n_r: this rank's own mean, DDP's average over ranks."""
        self._backward_all(self.averaging, 1.0 / self.local_count())

    def precount(self) -> None:
        """sum_r G_r / N: N all-reduced first, then sum * R / N under DDP's average."""
        count = torch.tensor([self.local_count()], dtype=torch.int64, device=self._device())
        dist.all_reduce(count, group=self.group)  # the one extra, scalar collective
        # DDP averages the gradient (divides by R), so s = R puts back the sum over ranks.
        self._backward_all(self.averaging, self.world_size / int(count.item()))

    def fused(self) -> None:
        """sum_r G_r / N: the plain sum, n_r carried in the gradient's all-reduce, then / N."""
        self.hook_state.arm(self.local_count())  # carried in the last backward's all-reduce
        self._backward_all(self.carrying, None)
        total = math.fsum(n for (n,) in self.hook_state.take())
        with torch.no_grad():
            divide_all_exactly((param.grad for param in self.carrying.parameters()), total)

    def _device(self) -> torch.device:
        return next(self.reference.parameters()).device

    def zero_grads(self) -> None:
        for model in (self.averaging, self.carrying, self.reference):
            model.zero_grad(set_to_none=True)

    def grads(self, path: str) -> dict[str, np.ndarray]:
        """The gradient `path` leaves, by parameter name, as float64 numpy."""
        model = self.carrying if path == "fused" else self.averaging
        return {
            name: param.grad.detach().to("cpu", torch.float64).numpy()
            for name, param in model.module.named_parameters()
        }

    def references(self) -> dict[str, dict[str, np.ndarray]]:
        """intended = sum_r G_r / N and rank_mean = (1/R) sum_r G_r / n_r, in float64."""
        self.reference.zero_grad(set_to_none=True)
        self._backward_all(self.reference, None)
        n_local = self.local_count()
        count = torch.tensor([n_local], dtype=torch.int64, device=self._device())
        dist.all_reduce(count, group=self.group)
        intended, rank_mean = {}, {}
        for name, param in self.reference.named_parameters():
            local = param.grad.detach().to(torch.float64)
            total, own_mean = local.clone(), local / n_local
            dist.all_reduce(total, group=self.group)
            dist.all_reduce(own_mean, group=self.group)
            intended[name] = (total / int(count.item())).cpu().numpy()
            rank_mean[name] = (own_mean / self.world_size).cpu().numpy()
        return {"intended": intended, "rank_mean": rank_mean}


def bench_rank(rank: int, world_size: int, job: dict) -> dict:
    """A launch target: judge, time and measure the three paths on this rank.

    `job` holds the `BenchConfig` and the threads per rank; the [R, M, B, T] batch is built
    here from the config (`crosscheck.bench.config.packed_batch`, deterministic). Returns
    per-round step times (the slowest rank's wall time, and the CPU time of all ranks:
    ``process_time``, every thread of the process, gloo's included), the refused paths with
    their reasons, and the peak memory of one update of each path (the largest over ranks),
    on every rank alike.
    """
    config: BenchConfig = job["config"]
    torch.set_num_threads(job["threads"])
    if config.device == "cpu":
        pin_to_own_cores(rank, world_size, job["threads"])
    torch.manual_seed(config.seed)
    if config.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        # The launcher's default group is gloo; the gradients go over NCCL between GPUs.
        group = dist.new_group(backend="nccl")
    else:
        device, group = torch.device("cpu"), None
    batch = packed_batch(config, world_size)
    microbatches = [
        tuple(
            torch.as_tensor(batch[key][rank, m], dtype=torch.long, device=device)
            for key in ("inputs", "targets", "segment_ids")
        )
        for m in range(config.accum)
    ]
    paths = Paths(microbatches, device, group)
    counts = torch.zeros(world_size, dtype=torch.int64, device=device)
    counts[rank] = paths.local_count()
    dist.all_reduce(counts, group=group)

    path_grads = {}
    for path in PATHS:
        paths.zero_grads()
        paths.run[path]()
        path_grads[path] = float64_tree(paths.grads(path))
    # Every rank holds the same reduced gradients and references, so every rank refuses the
    # same paths and the ranks stay in step through the timing below.
    refused = refusals(path_grads, paths.references(), counts.tolist())
    timed = [p for p in PATHS if p not in refused]

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    wall: dict[str, list[float]] = {path: [] for path in timed}
    cpu: dict[str, list[float]] = {path: [] for path in timed}
    for round_index in range(config.warmup + config.torch_rounds):
        # Interleaved, and each round starts one path later (ABC, BCA, CAB, ...), so that no
        # path always runs first, right after the barrier that follows the previous round.
        shift = round_index % len(timed) if timed else 0
        for path in timed[shift:] + timed[:shift]:
            paths.zero_grads()
            synchronize()
            dist.barrier(group=group)  # every rank starts the path together
            start, start_cpu = time.perf_counter(), time.process_time()
            paths.run[path]()
            synchronize()
            if round_index >= config.warmup:
                wall[path].append(time.perf_counter() - start)
                cpu[path].append(time.process_time() - start_cpu)
    # A step lasts as long as its slowest rank, and costs the CPU time of all of them.
    slowest = torch.tensor([wall[p] for p in timed], dtype=torch.float64, device=device)
    cpu_total = torch.tensor([cpu[p] for p in timed], dtype=torch.float64, device=device)
    if timed:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(cpu_total, op=dist.ReduceOp.SUM, group=group)

    peaks, how = _peak_memory(paths, timed, device, group)
    return {
        "times": dict(zip(timed, slowest.cpu().tolist(), strict=True)),
        "cpu_times": dict(zip(timed, cpu_total.cpu().tolist(), strict=True)),
        "refused": refused,
        "peak_mem_bytes": peaks,
        "memory_method": how,
        "rank_counts": counts.tolist(),
        "torch_version": torch.__version__,
        "backend": dist.get_backend(group),
    }


def pin_to_own_cores(rank: int, world_size: int, threads: int) -> None:
    """Keep this rank on cores of its own (`threads` of them) where there are enough for every
    rank: ranks that the scheduler moves between cores lose their caches and take turns on a
    core with the other rank's gloo threads (on 2 cores the step's median fell by about 5% and
    its scatter narrowed). With fewer cores than ranks x threads, nothing is pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cores = usable_cores()
    if len(cores) >= world_size * threads:
        os.sched_setaffinity(0, cores[rank * threads : (rank + 1) * threads])


def _peak_memory(
    paths: Paths, timed: Sequence[str], device: torch.device, group: object
) -> tuple[dict[str, int | None], str]:
    """Per path, the peak memory one update adds, the largest over ranks; and how measured."""
    if device.type == "cuda":
        how = "torch.cuda.max_memory_allocated over one update, minus the allocation before"

        def measure(path: str) -> int:
            paths.zero_grads()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            paths.run[path]()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before
    else:
        why_not = rss_supported()
        if why_not:
            return {p: None for p in timed}, f"not measured: {why_not}"
        how = "peak RSS (VmHWM) over one update minus the RSS before, after malloc_trim"

        def measure(path: str) -> int:
            paths.zero_grads()
            return peak_rss_delta(paths.run[path])

    local = torch.tensor([measure(path) for path in timed], dtype=torch.int64, device=device)
    if timed:
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(timed, (int(v) for v in local.tolist()), strict=True)), how
