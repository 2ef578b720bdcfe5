"""The job's environment, from the gloo group a verify rank has already joined.

accelerate (under transformers' and TRL's trainers) and DeepSpeed find their job through
RANK, LOCAL_RANK, WORLD_SIZE and MASTER_ADDR / MASTER_PORT, and adopt a process group that is
already initialized instead of creating one: `adopt_process_group` sets those variables from
the rank's group, so every framework runs in crosscheck's ranks, on their one group. Nothing is
ever fetched from the Hugging Face hub (the models are built from configs).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def adopt_process_group() -> None:
    """Set the job's environment from this rank's initialized process group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # Read only to create a group, which the frameworks do not: the group exists.
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
