"""What the postnorm comm hook costs in torch DDP on the CPU, piece by piece.

Two gloo ranks (`torch_impl.harness.launcher.launch`), each pinned to a core where there are
two, run the same forward and backward of the small transformer in float32 (one microbatch
of 1 x 32 tokens, so that what is timed is mostly the reduction) through five DDP replicas,
interleaved update by update, rotating which goes first:

- ``default``: DDP's own C++ reduction (average);
- ``python hook``: a Python comm hook that all-reduces the bucket in place (sum);
- ``copy``: a Python comm hook that all-reduces a copy of the bucket (``clone``);
- ``postnorm, no division``: `torch_impl.comm_hooks.sum_and_carry_hook` carrying one count;
- ``postnorm``: the same and the division of every gradient by D
  (`torch_impl.division.divide_all_exactly`), as the bench's fused path does.

Prints rank 0's mean CPU time (``process_time``: every thread of the process, gloo's
included) and wall time per update, and each one's difference to ``default``. Run from the
repository root: ``python scripts/torch_hook_costs.py [UPDATES]`` (default 1000, about a
minute). docs/bench.md quotes it.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook reads the hooks'
# annotations and rejects strings.
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from crosscheck.bench.config import BenchConfig, packed_batch
from crosscheck.bench.torch_bench import pin_to_own_cores
from torch_impl.comm_hooks import PostnormState, sum_and_carry_hook
from torch_impl.division import divide_all_exactly
from torch_impl.transformer import TinyTransformer, token_losses

WARMUP = 100


def _sum_in_place(state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def _sum_of_copy(state: None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    future = dist.all_reduce(bucket.buffer().clone(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def costs(rank: int, world_size: int, updates: int) -> dict[str, tuple[float, float]]:
    """Per variant, (mean CPU s, mean wall s) of one update on this rank."""
    torch.set_num_threads(1)
    pin_to_own_cores(rank, world_size, threads=1)  # as the bench's ranks are
    batch = packed_batch(BenchConfig(rows=1, seq_len=32, accum=1), world_size)
    microbatch = [
        torch.as_tensor(batch[key][rank, 0], dtype=torch.long)
        for key in ("inputs", "targets", "segment_ids")
    ]
    state = PostnormState(rank=rank, world_size=world_size)
    models = {
        name: DistributedDataParallel(TinyTransformer(dtype=torch.float32)) for name in range(5)
    }
    models[1].register_comm_hook(None, _sum_in_place)
    models[2].register_comm_hook(None, _sum_of_copy)
    models[3].register_comm_hook(state, sum_and_carry_hook)
    models[4].register_comm_hook(state, sum_and_carry_hook)

    def update(index: int) -> None:
        model = models[index]
        if index >= 3:
            state.arm(100.0)
        token_losses(model, *microbatch).sum().backward()
        if index >= 3:
            D = sum(d for (d,) in state.take())
            if index == 4:
                with torch.no_grad():
                    divide_all_exactly([p.grad for p in model.parameters()], D)

    totals = {index: [0.0, 0.0] for index in models}
    order = list(models)
    for step in range(WARMUP + updates):
        shift = step % len(order)
        for index in order[shift:] + order[:shift]:
            models[index].zero_grad(set_to_none=True)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            update(index)
            if step >= WARMUP:
                totals[index][0] += time.process_time() - start_cpu
                totals[index][1] += time.perf_counter() - start
    names = ("default", "python hook", "copy", "postnorm, no division", "postnorm")
    return {names[i]: (cpu / updates, wall / updates) for i, (cpu, wall) in totals.items()}


def main() -> None:
    from torch_impl.harness.launcher import launch

    updates = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    result = launch(costs, 2, (updates,), timeout_s=900)[0]
    base_cpu, base_wall = result["default"]
    print(f"rank 0, mean per update over {updates} updates (ms)")
    print(f"{'variant':24s} {'CPU':>7s} {'vs default':>11s} {'wall':>7s} {'vs default':>11s}")
    for name, (cpu, wall) in result.items():
        print(
            f"{name:24s} {cpu * 1e3:7.3f} {(cpu - base_cpu) * 1e3:+11.3f} "
            f"{wall * 1e3:7.3f} {(wall - base_wall) * 1e3:+11.3f}"
        )


if __name__ == "__main__":
    main()
