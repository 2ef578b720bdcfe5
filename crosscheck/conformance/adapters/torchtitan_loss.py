r"""torchtitan's loss, its global valid-token count and its FSDP2 wrapping, one update, as a step.

``crosscheck verify --framework torch --step crosscheck.conformance.adapters.torchtitan_loss:step
--model crosscheck.conformance.adapters.tiny_models:llama --forward
crosscheck.conformance.adapters.tiny_models:logits --scheme token_mean``

Two settings, two steps. ``step``: FSDP (``data_parallel_shard_degree`` = R, torchtitan's
default, -1 = "leftover ranks"). ``step_replicate``: ``data_parallel_replicate_degree`` = R,
``data_parallel_shard_degree`` = 1, which ``torchtitan/config/configs.py`` L113-122 calls DDP
("When this value is greater than 1, weights will be replicated across
`data_parallel_replicate_degree` ranks. If `data_parallel_shard_degree` is also greater than 1,
the parallelism method used is HSDP (Hybrid Sharded Data Parallelism). Otherwise, the
parallelism method used is DDP (Distributed Data Parallelism)."). 0.3.0 has no ``replicate`` /
``DistributedDataParallel`` path left: ``parallelize_llama`` runs ``fully_shard`` on the
``["dp_replicate", "fsdp"]`` mesh whatever the degrees (``models/llama3/parallelize.py``
L69-70: "Always run apply_fsdp_to_decoder -- with shard_degree=1 it is a no-op for the
all-gather but still installs the MixedPrecisionPolicy"), i.e. HSDP with one rank per shard
group: gradients all-reduced over the replicas, with the same divide factor 1.0.

Each step runs one ``Trainer.train_step`` of torchtitan 0.3.0 (``torchtitan/trainer.py``
L871-950) on the tiny Llama it is handed, with torchtitan's own pieces doing every part that
weights a token:

* the count, L884-893: ``local_valid_tokens += (labels != IGNORE_INDEX).sum()`` over the
  window's ``gradient_accumulation_steps`` microbatches, before any forward;
* the global count, L897-903: ``dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)``
  when ``parallel_dims.dp_enabled`` (``torchtitan/distributed/utils.py`` L155-163: a SUM
  ``funcol.all_reduce`` over the mesh, ``_dist_reduce_tensor`` L98-132), the local count
  otherwise;
* the loss, ``_forward_backward_body`` L806-831 (``fwd_bwd_fn``, L612): ``pred =
  model(inputs)``, ``loss, _ = self.loss_fn(pred, labels, global_valid_tokens)``,
  ``loss.backward()``, once per microbatch (no ``no_sync``: FSDP2 reduce-scatters and
  accumulates every backward). The loss is
  ``torchtitan.components.loss.CrossEntropyLoss`` (L337-367): ``cross_entropy_loss`` (L32-65,
  ``F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
  ignore_index=-100)``) then ``loss = loss / global_valid_tokens`` (L364);
* the data-parallel wrapping, ``torchtitan/models/llama3/parallelize.py`` L69-90:
  ``apply_fsdp_to_decoder`` (``torchtitan/distributed/fsdp.py`` L110-316: ``fully_shard`` on the
  token embedding, on ``[norm, lm_head]``, on every transformer block and on the root), which
  ends with ``disable_fsdp_gradient_division`` (L27-41, ``set_gradient_divide_factor(1.0)`` on
  every FSDP module): the gradients are *summed* over the ranks;
* the optimizer steps the sharded parameters (L948), with clipping off (below).

What the docs promise: the token mean over the whole window on all ranks.
``torchtitan/components/loss.py`` L38 / L338: "Cross-entropy loss with sum reduction for
token-based normalization."; ``torchtitan/distributed/fsdp.py`` L31-32 (``disable_fsdp_gradient_
division``): "Set gradient_divide_factor=1.0 to disable FSDP's automatic gradient division. We
handle gradient scaling ourselves in the training loop with global token count.";
``torchtitan/trainer.py`` L830: "The returned loss here is local SUM loss / global_valid_tokens",
and L963-966: "For global_avg_loss, we want the average loss across all ranks: accumulated_loss =
local_loss_sum / global_valid_tokens; global_avg_loss = sum(local_loss_sum) /
global_valid_tokens". Every valid token of the window, on every rank, weighs 1 / (the window's
valid tokens on all ranks): the intended scheme is ``token_mean``.

Set-up choices and deviations, none of which touches the normalization:

* Imports. torchtitan 0.3.0 is installed with ``--no-deps`` plus, with ``--no-deps`` each, what
  the modules used here import: ``spmd_types==0.2.3`` (torchtitan pins it), ``tyro==1.0.17``
  (imported by ``torchtitan.config``), ``docstring_parser==0.18.0`` and ``typeguard==4.6.1``
  (tyro's). ``torchtitan.trainer`` itself cannot be imported on this CPU machine: it imports
  ``torchtitan.models.common.decoder`` -> ``moe`` -> ``token_dispatcher`` ->
  ``distributed/minimal_async_ep/kernels.py``, which imports ``triton`` (so do
  ``torchtitan.models.llama3`` and torchtitan's own Llama); it also needs ``torchdata``. So the
  step imports only ``torchtitan.components.loss``, ``torchtitan.distributed.fsdp`` and
  ``torchtitan.distributed.utils``, and writes out ``train_step``'s count-and-loop (the lines
  cited above, a dozen lines with no arithmetic of their own besides the count) around them.
* The model: the tiny Hugging Face Llama of ``tiny_models`` (torchtitan's own Llama needs
  ``triton``, above). ``apply_fsdp_to_decoder`` reads a torchtitan ``Decoder``'s
  ``tok_embeddings``, ``norm``, ``lm_head``, ``layers`` (a dict) and ``enable_weight_tying``:
  the step names the HF model's modules so for the duration of the call (`_decoder_names`) and
  removes the names again, so that the parameters keep the HF names the harness reads. The
  forward is ``model(input_ids=inputs).logits`` (torchtitan's ``Decoder`` returns the logits
  itself), as the reference's ``--forward`` takes them.
* The loss is ``CrossEntropyLoss``, as in the ``llama3_debugmodel_ce_loss`` config
  (``torchtitan/models/llama3/config_registry.py`` L174-181); the other llama3 configs wrap it
  in ``ChunkedLossWrapper`` (L37-41), which needs a ``Decoder`` forward with ``_skip_lm_head``
  and splits the same per-chunk ``CrossEntropyLoss(..., global_valid_tokens)`` over sequence
  chunks: the same weights, not run here.
* The mesh: the legacy (``partial_dtensor``) path of ``parallelize_llama`` (L74-78): a 1-D
  ``fsdp`` mesh over the data-parallel ranks, which here is also the ``batch`` mesh (dp_shard =
  R, no replicate / CP / TP / PP). ``ParallelDims.build_mesh`` would unflatten a world mesh and
  create a process group per axis; the step instead builds both meshes with
  ``DeviceMesh.from_group`` on the rank's existing gloo group (no group is created).
  ``step_replicate``'s (R, 1) mesh is unflattened from that world mesh as ``build_mesh`` does
  (``parallel_dims.py`` L249-267, L330-334, ``DeviceMesh._unflatten``), which creates a gloo
  subgroup per axis of the existing group (no second default group).
  ``spmd_backend`` is set to ``"partial_dtensor"`` to match (``dist_utils.set_spmd_backend``,
  as ``Trainer.__init__`` L319 does; the default ``"spmd_types"`` path would wrap the same
  modules on a multi-axis mesh with ``DataParallelMeshDims``, which needs torchtitan's
  ``Decoder.parallelize``). At R = 1 torchtitan still applies ``fully_shard`` on a size-1 mesh
  (``parallel_dims.py`` L191-195, "Always keep fsdp mesh with real backend so fully_shard() can
  apply MixedPrecisionPolicy even at degree 1") and, ``dp_enabled`` being False, normalizes by
  the local count (L902-903), as the step does.
* Mixed precision: ``param_dtype`` = ``reduce_dtype`` = the model's dtype (float64 by default;
  ``--dtype float32`` is torchtitan's ``mixed_precision_param="float32"``,
  ``torchtitan/config/configs.py`` L85-97, whose default is bfloat16). The loss is float32
  whatever the model (``pred.float()``): float32-level at best.
* gloo has no ``PREMUL_SUM``: with a divide factor of 1.0 and a float32 / bfloat16 reduce dtype
  FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM(1 / 1.0)``
  (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`` ``_get_gradient_divide_
  factors``), which gloo rejects. The step therefore calls
  ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (as torchtitan's own
  ``enable_fsdp_symm_mem``, ``fsdp.py`` L44-51, does), after which FSDP2 reduces with
  ``ReduceOp.SUM`` and divides by nothing (its post-factor is the divide factor 1.0, skipped):
  the same sum. With a float64 reduce dtype FSDP2 already takes the SUM path ("overflow risk"),
  so the setting changes nothing there.
* The optimizer: torchtitan builds its optimizer after the parallelisms (``trainer.py``
  L548-549, "build optimizer after applying parallelisms to the model"), on the sharded DTensor
  parameters that ``fully_shard`` puts in place of the module's. The harness's ``SGD(lr=1)``
  was built on the parameters before wrapping, so the step points its parameter groups at the
  sharded parameters that replaced them (matched by name; SGD without momentum has no state),
  which is the optimizer torchtitan would have built; the harness reads the update from the
  returned model's parameters, gathered in full. Constant learning rate, no scheduler.
* Gradient clipping is off: ``train_step`` calls ``dist_utils.clip_grad_norm_(...,
  training.max_norm)`` (L939-946, default ``max_norm`` 1.0, ``configs.py`` L55); the step does
  not call it.
* The data: torchtitan's text dataloader yields ``({"input": tokens[:-1], "positions": ...},
  tokens[1:])`` (``torchtitan/hf_datasets/text_datasets.py`` L142-143, L166), labels aligned
  with the inputs, and the step feeds this rank's microbatches in order, one per accumulation
  step (``local_batch_size`` = the microbatch's rows, ``global_batch_size`` = R M rows, so
  ``gradient_accumulation_steps`` = M, ``trainer.py`` L414-433); the fixtures' targets are
  already aligned and go in as the labels. No positions are passed (the reference's forward
  passes none; they would move RoPE, not any token's weight).
* The denominator the step believes in, ``global_valid_tokens``, is logged
  (``crosscheck.log_denominator``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from transformers import LlamaForCausalLM

from crosscheck.verification.protocol import log_denominator

Microbatch = dict[str, torch.Tensor]

#: The attributes ``apply_fsdp_to_decoder`` reads on a torchtitan ``Decoder``.
_DECODER_NAMES = ("tok_embeddings", "norm", "layers", "enable_weight_tying")


@contextlib.contextmanager
def _decoder_names(model: LlamaForCausalLM) -> Iterator[None]:
    """Name the HF Llama's modules as torchtitan's ``Decoder`` names them, for the call only.

    ``lm_head`` is already the HF name. ``layers`` is a ``ModuleDict`` keyed by the layer index,
    as ``Decoder.layers`` is. The names are removed afterwards, so that ``named_parameters``
    gives the HF names only (an alias would also put each parameter twice in a state dict)."""
    if any(name in vars(model) or name in model._modules for name in _DECODER_NAMES):
        raise RuntimeError("the model already has an attribute torchtitan's Decoder names")
    model.tok_embeddings = model.model.embed_tokens
    model.norm = model.model.norm
    model.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(model.model.layers)})
    model.enable_weight_tying = bool(model.config.tie_word_embeddings)
    try:
        yield
    finally:
        for name in _DECODER_NAMES:
            delattr(model, name)


def data_parallel_mesh(name: str) -> DeviceMesh:
    """A 1-D mesh over every rank on the rank's existing gloo group (no group is created)."""
    return DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=(name,))


def replicate_mesh() -> DeviceMesh:
    """``ParallelDims``' legacy dense mesh at dp_replicate = R, dp_shard = 1, sliced as
    ``parallelize_llama`` L74-77 slices it: ``["dp_replicate", "fsdp"]``, shape (R, 1). The
    world mesh (the existing group) is unflattened as ``build_mesh`` does (``parallel_dims.py``
    L254-267), which creates a gloo subgroup per axis."""
    world = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("world",))
    dense = world._unflatten(0, (dist.get_world_size(), 1), ("dp_replicate", "fsdp"))
    return dense["dp_replicate", "fsdp"]


def apply_torchtitan_fsdp(model: LlamaForCausalLM, dp_mesh: DeviceMesh | None = None) -> None:
    """``parallelize_llama``'s data parallelism: ``apply_fsdp_to_decoder`` on `dp_mesh` (default:
    the 1-D ``fsdp`` mesh), in the model's dtype, which ends with
    ``disable_fsdp_gradient_division`` (factor 1.0)."""
    dtype = next(model.parameters()).dtype
    with _decoder_names(model):
        apply_fsdp_to_decoder(
            model,  # type: ignore[arg-type]  # a Decoder by the names above
            data_parallel_mesh("fsdp") if dp_mesh is None else dp_mesh,
            param_dtype=dtype,
            reduce_dtype=dtype,
            pp_enabled=False,
        )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Deviation (gloo has no PREMUL_SUM): reduce with SUM; the divide factor stays 1.0.
            module.set_force_sum_reduction_for_comms(True)
            if module._get_fsdp_state()._fsdp_param_group is not None:
                # torchtitan's setting must have reached every parameter group.
                group = module._get_fsdp_state()._fsdp_param_group
                if group.gradient_divide_factor != 1.0:
                    raise RuntimeError("disable_fsdp_gradient_division did not set 1.0")


def adopt_sharded_params(
    optimizer: torch.optim.Optimizer,
    before: dict[int, str],
    model: nn.Module,
) -> None:
    """Point the optimizer's groups at the parameters ``fully_shard`` put in place of the ones it
    was built on (``before``: id of an old parameter -> its name), as if it had been built after
    wrapping, as torchtitan builds it."""
    after = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [after[before[id(param)]] for param in group["params"]]
    if optimizer.state:
        raise RuntimeError("the optimizer already holds state for the unwrapped parameters")


def global_valid_tokens(microbatches: list[Microbatch]) -> torch.Tensor:
    """``train_step`` L884-903: this rank's valid labels over the window, summed over the batch
    mesh with torchtitan's ``dist_sum_tensor`` when data parallelism is on."""
    local_valid_tokens = torch.tensor(0, dtype=torch.int64)
    for batch in microbatches:
        local_valid_tokens += (batch["targets"] != IGNORE_INDEX).sum()
    if dist.get_world_size() > 1:  # parallel_dims.dp_enabled: dp_shard = R
        return dist_utils.dist_sum_tensor(local_valid_tokens, data_parallel_mesh("batch"))
    return local_valid_tokens


def train_step(
    model: nn.Module,
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> None:
    """``Trainer.train_step`` for one update: the count before any forward, then torchtitan's
    loss and a backward per microbatch, then the optimizer (no clipping)."""
    optimizer.zero_grad()
    count = global_valid_tokens(microbatches)
    log_denominator(float(count))
    loss_fn = CrossEntropyLoss.Config().build()
    for batch in microbatches:
        pred = forward(model, batch["inputs"])
        loss, _ = loss_fn(pred, batch["targets"], count)
        del pred
        loss.backward()
    optimizer.step()


def hf_logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The logits [B, T, V] of the HF model, what torchtitan's ``Decoder`` forward returns."""
    return model(input_ids=inputs).logits


def step(
    model_factory: Callable[[], LlamaForCausalLM],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """torchtitan 0.3.0's update under FSDP2: global valid tokens, sum / count, SGD(lr=1)."""
    return _run(model_factory, microbatches, optimizer, replicate=False)


def step_replicate(
    model_factory: Callable[[], LlamaForCausalLM],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> nn.Module:
    """The same update with ``data_parallel_replicate_degree`` = R, ``data_parallel_shard_degree``
    = 1 (what torchtitan's config calls DDP): ``fully_shard`` on the (R, 1) mesh, i.e. HSDP whose
    shard axis has one rank: the gradients are all-reduced (summed) over the replicas."""
    return _run(model_factory, microbatches, optimizer, replicate=True)


def _run(
    model_factory: Callable[[], LlamaForCausalLM],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    replicate: bool,
) -> nn.Module:
    dist_utils.set_spmd_backend("partial_dtensor")
    model = model_factory()
    names = {id(param): name for name, param in model.named_parameters()}
    apply_torchtitan_fsdp(model, replicate_mesh() if replicate else None)
    adopt_sharded_params(optimizer, names, model)
    train_step(model, microbatches, optimizer, hf_logits)
    return model
