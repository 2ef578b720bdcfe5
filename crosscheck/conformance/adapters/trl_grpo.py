"""TRL 1.16.0's real ``GRPOTrainer``, one optimizer update per verify step, one step per setting.

Why one file: the steps share one set-up (the rollout hook, the reward function, the
layout checks); a setting is a few keyword arguments of it.

``trainer.train()`` runs with ``max_steps=1``: TRL's own sampler, dataloader, generation-batch
buffering, reward and advantage code, ``_compute_loss`` and normalization, transformers'
training loop (gradient accumulation, ``no_sync``), accelerate's DDP over the ranks' existing
gloo group, and the ``SGD(lr=1)`` the harness hands the step. The harness reads the update.

How the fixture ``grpo-groups`` goes in (``crosscheck/fixtures/groups.py``): generation is
replaced by TRL's public ``rollout_func=`` hook (experimental in 1.16.0, grpo_trainer.py:258),
which returns the fixture's prompt and completion token ids for the prompts TRL's sampler
handed this rank; a reward function returns the fixed rewards ``GRPO_REWARDS`` (each row's
``row_weights`` plus its group's mean reward, exactly a reward of ``GRPO_REWARDS``), and with
``scale_rewards="none"`` TRL's advantages are ``r - mean(group)`` = the fixture's
``row_weights``, exactly (multiples of 1/16). The dataset holds one placeholder prompt per group
(``shuffle_dataset=False``); TRL's ``RepeatSampler`` repeats each ``num_generations=4`` times,
and accelerate gives rank r the r-th block of ``per_device_train_batch_size x
steps_per_generation`` rows of each generation batch; the rollout maps each position to rank
r's microbatch m of gradweight's layout. The adapter all-gathers every rank's group ids first
and raises when a generation batch would not hold whole prompt groups in TRL's order, and it
checks, in ``compute_loss``, that accumulation step m of rank r saw exactly the completion
tokens (and advantages) of gradweight's microbatch m (raise otherwise).

The normalizations (trl/trainer/grpo_trainer.py of trl 1.16.0, ``_compute_loss``):

* grpo, sapo (3153-3157): ``((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
  / current_gradient_accumulation_steps``;
* bnpo (3158-3162): ``(per_token_loss * mask).sum() / mask.sum().clamp(min=1) / GA``;
* dr_grpo (3163-3167): ``(per_token_loss * mask).sum() / (B * max_completion_length) / GA``;
* cispo, dapo, vespo (3168-3174): ``(per_token_loss * mask).sum() / (num_items_in_batch /
  num_processes * GA / steps_per_generation)``, ``num_items_in_batch`` the generation batch's
  completion tokens on all ranks (2498); the ``GA / steps_per_generation`` factor is trl#6024's
  fix of trl#5619;
* luspo (3175-3182): ``(per_token_loss * mask).sum(-1).mean() / GA``;
* per-token losses (3109-3138): cispo ``-clamp(ratio, max=epsilon_high).detach() * A *
  logp`` (3109-3111; ``epsilon_high`` defaults to ``epsilon`` = 0.2, 946); grpo/bnpo/dr_grpo/
  dapo/luspo ``-min(ratio * A, clip(ratio) * A)``; sapo ``-sigmoid(tau (ratio - 1)) 4 / tau * A``;
  vespo ``-phi(w) * A * logp`` with phi(1) = 1. With ``old_per_token_logps = per_token_logps
  .detach()`` (3066) the ratio is 1 with gradient ``grad logp``.
* The entropy bonus (3189-3211) is a second term, off by default (``entropy_coef=0.0``):
  ``- entropy_coef * (entropies * mask).sum() / mask.sum() / GA``, a per-microbatch token mean
  of the entropies whatever ``loss_type`` is (waiting for multi-term verify; not run here).

Deviations, all the same in every step (none touches the loss or its normalization):

* CPU, gloo, float64 model: ``use_cpu=True``, ``bf16=False`` (GRPOConfig defaults to
  ``bf16=True``), ``gradient_checkpointing=False`` (defaults to True; recomputation only);
* gradient clipping off (``max_grad_norm=0``); the harness's ``SGD(lr=1)`` with a constant
  ``LambdaLR`` schedule; ``report_to="none"``, no saving, telemetry off (``HF_HUB_OFFLINE``);
* generation by ``rollout_func`` (no vLLM, no ``model.generate``), ``logprobs: None``;
* when ``steps_per_generation > 1``, TRL shuffles the rows of a rank's generation batch
  (``shuffle_sequence_dict``, grpo_trainer.py:1543) before splitting it into
  ``steps_per_generation`` microbatches. That random split cannot be undone by ordering the
  data (the advantages need every prompt group's rows together before the shuffle), so the
  adapter replaces that one call by the identity for the duration of ``train()``: which rows
  form a microbatch is then gradweight's layout. With ``steps_per_generation = 1`` nothing is
  replaced (the shuffle only reorders rows inside the one microbatch).

* TRL's prompt is each row's first token, and the rest of the fixture's prompt leads the
  completion, masked out of the loss by ``rollout_func``'s documented ``env_mask`` (environment
  tokens, grpo_trainer.py:2272; TRL's loss mask is then ``completion_mask * tool_mask``,
  3027, and ``num_items_in_batch`` counts the same, 2498). Why: TRL left-pads prompts of
  different lengths (the fixture's have 3 to 5 tokens), and with the tiny Llama's eager
  attention in float64 a left-padded row's leading pads have no key to attend to; transformers
  5.24's eager softmax runs in float32 (models/llama/modeling_llama.py:197), where the float64
  mask minimum becomes -inf, so those positions are NaN, and 0 x NaN carries it into every
  later position of the row (NaN gradients; float32 and sdpa do not do this). With a one-token
  prompt nothing is left-padded, every row starts at position 0 as in the reference, and the
  scored tokens and their counts are the fixture's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from transformers import PreTrainedModel, PrinterCallback, ProgressCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer as grpo_trainer_module

from crosscheck.conformance.adapters.process_group import adopt_process_group
from crosscheck.conformance.adapters.tiny_models import quiet_transformers, tokenizer
from crosscheck.conformance.adapters.trl_grpo_specs import MAX_COMPLETION_LENGTH
from crosscheck.fixtures.groups import GRPO_GROUP_SIZE, GRPO_REWARDS

quiet_transformers()

IGNORE_INDEX = -100

Microbatch = dict[str, torch.Tensor]
#: (prompt + completion token ids, prompt length, fixed reward, advantage) of a fixture row.
Row = tuple[tuple[int, ...], int, float, float]


def _rows(batch: Microbatch) -> list[Row]:
    """Each row's (prompt + completion ids, prompt length, fixed reward, advantage) of a
    grpo-groups microbatch: the completion is the row's valid targets, the prompt the inputs up
    to and including the position that predicts the first of them."""
    rows = []
    for b in range(batch["targets"].shape[0]):
        targets, inputs = batch["targets"][b], batch["inputs"][b]
        valid = (targets != IGNORE_INDEX).nonzero().flatten().tolist()
        if not valid or valid != list(range(valid[0], valid[-1] + 1)):
            raise ValueError("trl_grpo: a row's valid targets must be one contiguous completion")
        first, length = valid[0], len(valid)
        completion = tuple(targets[first : first + length].tolist())
        # The fixture's inputs are prompt + completion[:-1]: check it is one sequence.
        if tuple(inputs[first + 1 : first + length].tolist()) != completion[:-1]:
            raise ValueError("trl_grpo: a row's inputs are not its prompt + completion")
        advantage = float(batch["row_weights"][b])
        group = int(batch["group_ids"][b])
        rewards = GRPO_REWARDS[group]
        reward = advantage + sum(rewards) / len(rewards)
        if reward not in rewards:
            raise ValueError(
                "trl_grpo: runs on the fixture grpo-groups only (its rows' row_weights are "
                "r - mean(group) of GRPO_REWARDS)"
            )
        rows.append(
            (tuple(inputs[: first + 1].tolist()) + completion, first + 1, reward, advantage)
        )
    return rows


def _truncated(row: Row) -> Row:
    """A row of a later update (a generation batch longer than the update): the same prompt
    and reward, its completion cut to one token, so the generation batch counts other
    tokens than the update."""
    sequence, prompt_length, reward, advantage = row
    return sequence[: prompt_length + 1], prompt_length, reward, advantage


class _Layout:
    """Which row TRL's sampler asks rank r for at each position of each generation batch."""

    def __init__(
        self, microbatches: list[Microbatch], steps_per_generation: int, world_size: int
    ) -> None:
        self.rank = dist.get_rank()
        self.world_size = world_size
        self.steps_per_generation = steps_per_generation
        self.accum = len(microbatches)
        self.batch_size = microbatches[0]["targets"].shape[0]
        self.microbatches = [_rows(batch) for batch in microbatches]
        # Generation batches that one update reaches: one when steps_per_generation >= M.
        self.generations = -(-self.accum // steps_per_generation)
        groups = [[int(g) for g in batch["group_ids"]] for batch in microbatches]
        self._check_groups(groups)

    def row(self, generation: int, position: int) -> Row:
        step = generation * self.steps_per_generation + position // self.batch_size
        row = self.microbatches[step % self.accum][position % self.batch_size]
        return row if step < self.accum else _truncated(row)

    def rows_per_generation(self) -> int:
        return self.steps_per_generation * self.batch_size

    def num_prompts(self) -> int:
        """Dataset prompts one update's generation batches take (one per prompt group)."""
        rows = self.generations * self.rows_per_generation() * self.world_size
        if rows % GRPO_GROUP_SIZE:
            raise ValueError(
                f"trl_grpo: a generation batch of {rows} rows does not hold whole prompt groups "
                f"of {GRPO_GROUP_SIZE}"
            )
        return rows // GRPO_GROUP_SIZE

    def _check_groups(self, groups: list[list[int]]) -> None:
        """Raise unless every generation batch, in TRL's order (rank 0's rows, then rank 1's),
        is whole prompt groups of 4 consecutive rows: TRL computes advantages over
        ``rewards.view(-1, num_generations)``, so only then are they the fixture's."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, groups)
        for generation in range(self.generations):
            keys = []
            for rank_groups in everyone:
                for position in range(self.rows_per_generation()):
                    step = generation * self.steps_per_generation + position // self.batch_size
                    group = rank_groups[step % self.accum][position % self.batch_size]
                    # A row of a later update is its own group (copied from this update's).
                    keys.append((group,) if step < self.accum else ("later", step, group))
            chunks = [keys[i : i + GRPO_GROUP_SIZE] for i in range(0, len(keys), GRPO_GROUP_SIZE)]
            whole = all(len(set(chunk)) == 1 and len(chunk) == GRPO_GROUP_SIZE for chunk in chunks)
            if not whole or len({chunk[0] for chunk in chunks}) != len(chunks):
                raise ValueError(
                    f"trl_grpo: at this layout (R={self.world_size}, M={self.accum}, "
                    f"steps_per_generation={self.steps_per_generation}) TRL's generation batch "
                    f"{generation} would not hold the fixture's prompt groups as 4 consecutive "
                    "rows: its advantages would not be the fixture's row_weights"
                )


def _rollout(layout: _Layout) -> Callable[[list[Any], GRPOTrainer], dict[str, Any]]:
    """TRL's ``rollout_func``: this rank's prompts -> the fixture's ids and fixed rewards."""

    def rollout(prompts: list[Any], trainer: GRPOTrainer) -> dict[str, Any]:
        # Generation happens at accumulation step `_step`, a multiple of steps_per_generation.
        generation = trainer._step // layout.steps_per_generation
        if len(prompts) != layout.rows_per_generation():
            raise AssertionError(f"trl_grpo: TRL asked for {len(prompts)} completions")
        offset = (generation * layout.world_size + layout.rank) * len(prompts)
        rows = [layout.row(generation, j) for j in range(len(prompts))]
        for j, prompt in enumerate(prompts):
            # The sampler's order: prompt group k's 4 rows are consecutive, no shuffle.
            if prompt != f"g{(offset + j) // GRPO_GROUP_SIZE}":
                raise AssertionError(f"trl_grpo: row {offset + j} got prompt {prompt!r}")
        # TRL's prompt is the row's first token; the rest of the fixture's prompt leads the
        # completion, masked out of the loss by env_mask (see the module docstring).
        return {
            "prompt_ids": [list(sequence[:1]) for sequence, _, _, _ in rows],
            "completion_ids": [list(sequence[1:]) for sequence, _, _, _ in rows],
            "env_mask": [
                [0] * (prompt - 1) + [1] * (len(sequence) - prompt)
                for sequence, prompt, _, _ in rows
            ],
            "logprobs": None,
            "gw_reward": [reward for _, _, reward, _ in rows],  # forwarded to the reward function
        }

    return rollout


def fixed_reward(completions: list[Any], gw_reward: list[float], **kwargs: Any) -> list[float]:
    """The fixed reward of each completion (GRPO_REWARDS), handed over by the rollout."""
    return list(gw_reward)


def _watch_loss(trainer: GRPOTrainer, layout: _Layout) -> list[str]:
    """Wrap ``compute_loss`` to check that accumulation step m saw gradweight's microbatch m:
    the same (prompt, completion, advantage) rows, in any order. Returns the problems found."""
    original = trainer.compute_loss
    problems: list[str] = []
    seen = [0]

    @functools.wraps(original)
    def compute_loss(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        step = seen[0]
        seen[0] += 1
        fed = []
        for b in range(inputs["completion_ids"].shape[0]):
            prompt = inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()]
            completion = inputs["completion_ids"][b]
            sequence = torch.cat([prompt, completion[inputs["completion_mask"][b].bool()]])
            # The tokens the loss scores: completion_mask x tool_mask (the env_mask).
            scored = completion[(inputs["completion_mask"][b] * inputs["tool_mask"][b]).bool()]
            advantage = float(inputs["advantages"][b])
            fed.append((tuple(sequence.tolist()), tuple(scored.tolist()), advantage))
        expected = [
            (sequence, sequence[prompt:], advantage)
            for sequence, prompt, _, advantage in layout.microbatches[step % layout.accum]
        ]
        if step >= layout.accum or sorted(fed) != sorted(expected):
            problems.append(
                f"rank {layout.rank} accumulation step {step}: the loss saw other rows than "
                f"gradweight's microbatch {step}"
            )
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    trainer._gw_steps_seen = seen
    return problems


@contextlib.contextmanager
def _unshuffled(steps_per_generation: int) -> Iterator[None]:
    """The identity for TRL's shuffle of a generation batch when it spans several
    microbatches (see the module docstring); untouched otherwise."""
    if steps_per_generation == 1:
        yield
        return
    original = grpo_trainer_module.shuffle_sequence_dict
    grpo_trainer_module.shuffle_sequence_dict = lambda seq_dict: seq_dict
    try:
        yield
    finally:
        grpo_trainer_module.shuffle_sequence_dict = original


def _distributed_env() -> None:
    """accelerate reads the job from the environment (`adopt_process_group`) and reuses the
    ranks' initialized gloo group."""
    adopt_process_group()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    # One rank process runs several layouts: a fresh Accelerator for each, same process group.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def run_grpo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
    steps_per_generation: int | None = None,
    **config: Any,
) -> PreTrainedModel:
    """One ``GRPOTrainer.train()`` of ``max_steps=1`` on this rank's microbatches; `config`
    is the setting's GRPOConfig fields (loss_type, epsilon_high, ...)."""
    _distributed_env()
    model = model_factory()
    world_size = dist.get_world_size()
    accum = len(microbatches)
    spg = accum if steps_per_generation is None else steps_per_generation
    layout = _Layout(microbatches, spg, world_size)
    dataset = Dataset.from_dict({"prompt": [f"g{k}" for k in range(layout.num_prompts())]})
    with tempfile.TemporaryDirectory(prefix="gradweight-trl-grpo-") as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            max_steps=1,
            per_device_train_batch_size=layout.batch_size,
            gradient_accumulation_steps=accum,
            # None: TRL's own default (= gradient_accumulation_steps), as a user gets it.
            steps_per_generation=steps_per_generation,
            num_generations=GRPO_GROUP_SIZE,
            num_iterations=1,
            beta=0.0,
            scale_rewards="none",
            max_completion_length=MAX_COMPLETION_LENGTH,
            shuffle_dataset=False,
            max_grad_norm=0.0,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            ddp_backend="gloo",
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            # The Trainer sets transformers' log level on every rank: errors only.
            log_level="error",
            log_level_replica="error",
            ddp_find_unused_parameters=False,  # every parameter gets a gradient
            dataloader_num_workers=0,
            seed=0,
            **config,
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=fixed_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer(eos_token="t1"),
            optimizers=(optimizer, schedule),
            rollout_func=_rollout(layout),
        )
        # The ranks' stdout is the verify run's: no per-log prints or progress bars.
        for callback in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(callback)
        problems = _watch_loss(trainer, layout)
        with _unshuffled(args.steps_per_generation):
            trainer.train()
    if trainer._gw_steps_seen[0] != accum:
        problems.append(f"{trainer._gw_steps_seen[0]} accumulation steps ran, not {accum}")
    if problems:
        raise AssertionError("trl_grpo: wrong layout: " + "; ".join(problems))
    return model


def step_grpo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="grpo"``."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="grpo")


def step_bnpo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="bnpo"``."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="bnpo")


def step_dr_grpo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="dr_grpo"``, ``max_completion_length=20``."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="dr_grpo")


def step_dapo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="dapo"`` (the default), ``steps_per_generation`` left at its default (= GA)."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="dapo")


def step_dapo_spg1(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="dapo"``, ``steps_per_generation=1``: a generation batch per accumulation
    step, so GA / steps_per_generation = M (trl#5619 / trl#6024). Runs where every rank's
    microbatch m together holds whole prompt groups (R=1, or M=1)."""
    return run_grpo(
        model_factory, microbatches, optimizer, steps_per_generation=1, loss_type="dapo"
    )


def step_dapo_spg_double(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="dapo"``, ``steps_per_generation = 2 x GA``: the generation batch also holds
    the next update's rows (this update's, completions cut to one token), which count in
    ``num_items_in_batch``."""
    return run_grpo(
        model_factory,
        microbatches,
        optimizer,
        steps_per_generation=2 * len(microbatches),
        loss_type="dapo",
    )


def step_cispo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="cispo"``, ``epsilon_high`` left at its default (falls back to epsilon=0.2)."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="cispo")


def step_cispo_eps5(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="cispo"``, ``epsilon_high=5.0`` as the docs recommend for cispo."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="cispo", epsilon_high=5.0)


def step_sapo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="sapo"`` (default temperatures)."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="sapo")


def step_vespo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="vespo"`` (default k, lambda; it requires ``importance_sampling_level="token"``,
    the default)."""
    return run_grpo(model_factory, microbatches, optimizer, loss_type="vespo")


def step_luspo(
    model_factory: Callable[[], PreTrainedModel],
    microbatches: list[Microbatch],
    optimizer: torch.optim.Optimizer,
) -> PreTrainedModel:
    """``loss_type="luspo"`` with ``importance_sampling_level="sequence"``, which it requires."""
    return run_grpo(
        model_factory,
        microbatches,
        optimizer,
        loss_type="luspo",
        importance_sampling_level="sequence",
    )
