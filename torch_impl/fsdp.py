"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as a second front-end, on CPU with gloo.

FSDP2 reduce-scatters gradients and divides them by R by default: the same averaging reduction
as DDP, so precount needs s = R. ``set_gradient_divide_factor(1.0)`` makes it a plain sum and
precount needs s = 1; torchtitan's ``disable_fsdp_gradient_division`` does exactly that before
dividing by the global token count itself. Either way ``torch_impl.probe`` measures the factor.
Accumulation uses ``set_requires_gradient_sync(False)`` on all but the last microbatch
(``torch_impl.update.sync_context``). Parameters and gradients are DTensors sharded on dim 0;
``torch_impl.model.numpy_full`` all-gathers them for comparison (one collective for every
tensor of an update). The
reduce-scatter runs in the params' dtype (bf16 params: bf16 on gloo); D never enters it
(precount takes D from its own float64 count collective).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_fsdp2(
    module: nn.Module,
    *,
    world_size: int,
    divide_factor: float | None = None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard `module` in place over a 1-D mesh of `world_size` ranks and return it.

    The mesh is of the params' device type (CPU with gloo; CUDA with NCCL, each rank's current
    GPU), or `mesh` when given: under context parallel the data and context dimensions of a
    2-D mesh flattened into one (`context_parallel_mesh`), whose ranks all hold the same model
    and different tokens. `divide_factor` None keeps FSDP2's default (divide by the mesh's
    size: a mean); 1.0 makes it a sum.
    """
    if mesh is None:
        mesh = init_device_mesh(next(module.parameters()).device.type, (world_size,))
    elif mesh.ndim != 1 or mesh.size() != world_size:
        raise ValueError(
            f"shard_fsdp2: a mesh of {world_size} ranks on one dimension is needed, got "
            f"shape {tuple(mesh.shape)}"
        )
    fully_shard(module, mesh=mesh)
    if divide_factor is not None:
        module.set_gradient_divide_factor(divide_factor)
        # For float32/bf16 gradients FSDP2 implements a custom factor with
        # ReduceOp.PREMUL_SUM, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo");
        # forcing SUM makes it reduce-scatter with SUM and divide separately (here by 1).
        module.set_force_sum_reduction_for_comms(True)
    return module


def context_parallel_mesh(data_parallel: int, context_parallel: int, device_type: str = "cpu"):
    """(the 2-D ("dp", "cp") mesh of R x C ranks, its dimensions flattened into "dp_cp").

    Rank r C + c sits at [r, c], as process r C + c of the contract's layout. The gradient of a
    context-parallel step is reduced over "dp_cp", every process holding the same parameters
    (as torchtitan's FSDP over its flattened "dp_shard_cp" mesh), and its counts are taken
    over the same group. Flattening is DeviceMesh's ``_flatten``, the call torchtitan makes:
    torch 2.13 has no public one.
    """
    mesh = init_device_mesh(
        device_type, (data_parallel, context_parallel), mesh_dim_names=("dp", "cp")
    )
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")
