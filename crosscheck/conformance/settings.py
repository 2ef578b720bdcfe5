"""The settings `crosscheck conformance` runs: one per framework setting, with what it promises.

Why one file: the registry is one table, read top to bottom as the conformance table is.

A `Setting` is a verify run of an adapter (`crosscheck.conformance.adapters`) on the
framework's own code: the step, the tiny model, the intended scheme (what the framework's own
documentation promises for the setting, quoted in `promise` with its file and line at the
pinned version in `source`), the fixtures and layouts, and what had to change to run it here
(`deviations`). A setting that cannot run on this machine carries `not_run` (why) and
`prediction` (what reading the code predicts); one whose second loss term verify cannot judge
yet carries `waiting`. This module is data: nothing here imports a framework.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

#: The tiny Llama every torch adapter trains, and the reference's forward for it.
LLAMA = "crosscheck.conformance.adapters.tiny_models:llama"
LLAMA_LOGITS = "crosscheck.conformance.adapters.tiny_models:logits"
MIXTRAL_AUX = "crosscheck.conformance.adapters.tiny_models:mixtral_aux"
MIXTRAL_AUX_OBJECTIVE = "crosscheck.conformance.adapters.tiny_models:MIXTRAL_AUX_OBJECTIVE"
HF = "crosscheck.conformance.adapters.hf_trainer"
SFT = "crosscheck.conformance.adapters.trl_sft"

#: The time each setting's step gets, all its cases (a real trainer's start-up is seconds).
TIMEOUT_S = 300.0
#: Clipping rescales the whole gradient and hides the weighting; every adapter turns it off.
NO_CLIPPING = "clipping off (max_grad_norm=0)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One row of the conformance table."""

    #: The distribution whose version names the row (``pip show`` name).
    framework: str
    #: Short, unique within the framework: ``--settings`` takes it.
    setting: str
    #: The setting in the framework's own words.
    title: str
    #: The verify framework of the step: "torch" or "jax".
    engine: str = "torch"
    step: str = ""
    model: str | None = None
    forward: str | None = None
    #: The intended scheme, as ``verify --scheme`` takes it.
    scheme: str = "token_mean"
    #: The intended multi-term objective, as ``verify --objective`` takes it (then in place of
    #: `scheme`): a setting whose loss has a second term.
    objective: str | None = None
    fixtures: tuple[str, ...] = ("packed", "ragged")
    world_sizes: tuple[int, ...] = (1, 2)
    accum: tuple[int, ...] = (1, 2)
    #: The level to judge at ("auto": the finest the step's noise allows).
    precision: str = "auto"
    #: The documentation's promise for the setting, quoted, and where it stands.
    promise: str = ""
    source: str = ""
    deviations: str = NO_CLIPPING
    #: Other distributions whose versions the row depends on (accelerate under the Trainer).
    also: tuple[str, ...] = ()
    #: Why the setting cannot run here (None: it runs).
    not_run: str | None = None
    #: What reading the code predicts, for a setting that does not run or waits.
    prediction: str | None = None
    #: Why the setting cannot be judged yet (None: it is judged).
    waiting: str | None = None

    @property
    def key(self) -> str:
        return f"{self.framework}:{self.setting}"

    @property
    def intended(self) -> str:
        """What the setting is held to: its objective where it has one, else its scheme."""
        return self.objective or self.scheme

    @property
    def runs(self) -> bool:
        return self.not_run is None and self.waiting is None

    def command(self) -> list[str]:
        """The ``crosscheck verify`` command line that reproduces the row alone."""
        args = ["python", "-m", "crosscheck", "verify", "--framework", self.engine]
        args += ["--step", self.step]
        if self.model:
            args += ["--model", self.model]
        if self.forward:
            args += ["--forward", self.forward]
        if self.objective:
            args += ["--objective", self.objective]
        else:
            args += ["--scheme", self.scheme]
        args += ["--fixtures", ",".join(self.fixtures)]
        args += ["--world-sizes", ",".join(map(str, self.world_sizes))]
        args += ["--accum-steps", ",".join(map(str, self.accum))]
        if self.precision != "auto":
            args += ["--precision", self.precision]
        args += ["--timeout", f"{TIMEOUT_S:g}"]
        return args

    def command_line(self) -> str:
        return shlex.join(self.command())


_TRAINER_PROMISE = (
    "average_tokens_across_devices: 'Whether or not to average tokens across devices. If "
    "enabled, will use all_reduce to synchronize num_tokens_in_batch for precise loss "
    "calculation.'"
)
_TRAINER_SOURCE = (
    "transformers 5.24.0 training_args.py (average_tokens_across_devices); trainer.py "
    "L2306-2360 _get_num_items_in_batch, L2167-2216 compute_loss, L2110-2119 training_step"
)


def _trainer(setting: str, title: str, step: str, **fields: object) -> Setting:
    defaults = {
        "model": LLAMA,
        "forward": LLAMA_LOGITS,
        "promise": _TRAINER_PROMISE,
        "source": _TRAINER_SOURCE,
        "also": ("accelerate",),
    }
    return Setting(
        framework="transformers",
        setting=setting,
        title=title,
        step=f"{HF}:{step}",
        **(defaults | fields),
    )


def _sft(setting: str, title: str, step: str, **fields: object) -> Setting:
    defaults = {
        "model": LLAMA,
        "forward": LLAMA_LOGITS,
        "promise": "loss_type 'nll': 'standard negative log-likelihood', with the Trainer's "
        "average_tokens_across_devices 'for precise loss calculation'",
        "source": "trl 1.16.0 sft_config.py L107-113; sft_trainer.py L1610-1629 compute_loss",
        "also": ("transformers", "accelerate"),
    }
    return Setting(
        framework="trl",
        setting=setting,
        title=title,
        step=f"{SFT}:{step}",
        **(defaults | fields),
    )


TITAN = "crosscheck.conformance.adapters.torchtitan_loss"
_TITAN_PROMISE = (
    "components/loss.py: 'Cross-entropy loss with sum reduction for token-based "
    "normalization.'; distributed/fsdp.py: 'Set gradient_divide_factor=1.0 to disable FSDP's "
    "automatic gradient division. We handle gradient scaling ourselves in the training loop "
    "with global token count.'"
)
_TITAN_SOURCE = (
    "torchtitan 0.3.0 trainer.py L884-903 (global_valid_tokens = dist_sum_tensor(...)), "
    "components/loss.py L337-367, distributed/fsdp.py L27-41"
)
_TITAN_DEVIATIONS = (
    f"{NO_CLIPPING}; the count and microbatch loop of train_step written out (trainer.py "
    "imports triton); the tiny HF Llama wrapped by torchtitan's apply_fsdp_to_decoder, plain "
    "CrossEntropyLoss (not the chunked wrapper, which needs torchtitan's Decoder), no mixed "
    "precision, set_force_sum_reduction_for_comms(True) (gloo lacks PREMUL_SUM), meshes "
    "built on the existing gloo group"
)

DEEPSPEED = "crosscheck.conformance.adapters.deepspeed_engine"
_DS_DEVIATIONS = (
    "gradient_clipping 0 (DeepSpeed's default is 1.0); DS_ACCELERATOR=cpu on the existing "
    "gloo group; float64 added to the CPU accelerator's supported dtypes (the reduction still "
    "runs in its float32 communication dtype); the shared-memory all-reduce kernel, which "
    "only inference uses, marked unavailable"
)


def _deepspeed(setting: str, title: str, step: str, **fields: object) -> Setting:
    return Setting(
        framework="deepspeed",
        setting=setting,
        title=title,
        step=f"{DEEPSPEED}:{step}",
        model=LLAMA,
        forward=LLAMA_LOGITS,
        promise="get_batch_info: 'train_batch_size (int): The effective training batch size. "
        "This is the amount of data samples that leads to one step of model update.'; "
        "backward: 'scale_wrt_gas: ... whether to scale gradients and return value by "
        "gradient accumulation steps'",
        source="deepspeed 0.19.8 runtime/engine.py L1304-1313, L3382-3413 (backward), "
        "L3795-3818 (allreduce_bucket)",
        **{"deviations": _DS_DEVIATIONS, **fields},
    )


GRPO = "crosscheck.conformance.adapters.trl_grpo"
GRPO_SPECS = "crosscheck.conformance.adapters.trl_grpo_specs"
_GRPO_DOCS = "trl 1.16.0 grpo_config.py L237-267 (loss_type), grpo_trainer.py L3153-3182"
_GRPO_DEVIATIONS = (
    f"{NO_CLIPPING}; on-policy (num_iterations=1), beta=0, num_generations=4, "
    "scale_rewards='none' (advantages r - mean(group) equal the fixture's row_weights), "
    "bf16=False, gradient_checkpointing=False; generation through the public rollout_func "
    "(fixed completions, fixed rewards); each row's prompt is its first token, the rest of "
    "the fixture's prompt leads the completion under env_mask (TRL left-pads prompts, and "
    "the eager float32 softmax of a float64 model turns the padding mask into NaN)"
)


def _grpo(setting: str, title: str, step: str, spec: str, promise: str, **fields: object):
    return Setting(
        framework="trl",
        setting=setting,
        title=title,
        step=f"{GRPO}:{step}",
        model=LLAMA,
        forward=LLAMA_LOGITS,
        scheme=f"{GRPO_SPECS}:{spec}",
        fixtures=("grpo-groups",),
        promise=promise,
        source=_GRPO_DOCS,
        also=("transformers", "accelerate"),
        **{"deviations": _GRPO_DEVIATIONS, **fields},
    )


_DAPO_PROMISE = (
    "'dapo': 'Aggregates token-level losses by normalizing with the number of active token "
    "in the global accumulated batch.'"
)
_SHUFFLE_OFF = (
    "; with steps_per_generation > 1, TRL's shuffle_sequence_dict (grpo_trainer.py L1543) is "
    "the identity, so that each microbatch is a whole fixture microbatch"
)

OPTAX = "crosscheck.conformance.adapters.optax_multisteps"
_OPTAX_PROMISE = (
    "MultiSteps: 'collects together the updates [...] until a given number of scheduled "
    "steps is reached'; use_grad_mean: 'if True (the default), gradients accumulated over "
    "multiple mini-steps are averaged. Otherwise, they are summed.'; the gradient "
    "accumulation guide: 'to mimic the first snippet, which performs a single step with one "
    "large batch'"
)


def _optax(setting: str, title: str, step: str, **fields: object) -> Setting:
    return Setting(
        framework="optax",
        setting=setting,
        title=title,
        engine="jax",
        step=f"{OPTAX}:{step}",
        model=f"{OPTAX}:model",
        forward=f"{OPTAX}:logits",
        promise=_OPTAX_PROMISE,
        source="optax 0.2.8 transforms/_accumulation.py L243-311 (MultiSteps), "
        "losses/_classification.py L330-406 (where=)",
        also=("flax", "jax"),
        deviations=f"{NO_CLIPPING}; the loss is the microbatch's token mean "
        "(softmax_cross_entropy_with_integer_labels with where=, / mask.sum()), as Flax's "
        "lm1b_nnx example writes it; MultiSteps' default float32 accumulator; the tiny NNX "
        "model's attention softmax and embedding kept in the params' dtype",
        **fields,
    )


#: Every valid token weighs 1, over the number of rows holding one (the rows' token sums
#: averaged over the non-empty rows): tunix's seq-mean-token-sum.
NONEMPTY_ROWS_TOKEN_SUM = {"denominator": {"kind": "groups", "group": "row"}}

TUNIX = "crosscheck.conformance.adapters.tunix_loss"
_TUNIX_SOURCE = (
    "google-tunix 0.1.7 rl/common.py L533-596 (aggregate_loss), sft/peft_trainer.py L212-215 "
    "(optax.MultiSteps for gradient_accumulation_steps), L331-359 (_train_step)"
)
_TUNIX_DEVIATIONS = (
    "the analytic model's params as nnx.Param leaves; CPU devices; data_sharding_axis="
    "('data',); no checkpoint or metrics backend; the cross-entropy stands for the GRPO "
    "token loss -A ratio at ratio 1 with unit advantages (the same gradient)"
)


def _tunix(setting: str, step: str, scheme: str, promise: str, **fields: object) -> Setting:
    return Setting(
        framework="google-tunix",
        setting=setting,
        title=f"PeftTrainer + aggregate_loss, {setting}",
        engine="jax",
        step=f"{TUNIX}:{step}",
        scheme=scheme,
        promise=promise,
        source=_TUNIX_SOURCE,
        also=("flax", "optax"),
        deviations=_TUNIX_DEVIATIONS,
        **fields,
    )


VERL = "crosscheck.conformance.adapters.verl_agg_loss"
_VERL_SOURCE = (
    "verl 0.9.1 trainer/ppo/core_algos.py L1140-1206 (agg_loss), "
    "workers/engine/fsdp/transformer_impl.py L724-777 (the counts: loss_mask summed and "
    "all-reduced over DP), trainer/config/actor/actor.yaml L85-90"
)
_VERL_DEVIATIONS = (
    f"{NO_CLIPPING}; the FSDP engine's count glue (transformer_impl.py L729-735, L749-767) "
    "written out around verl's own agg_loss, logprobs_from_logits and prepare_micro_batches "
    "(the engine calls torch.cuda); DDP's average stands for FSDP's; SGD(lr=1) for AdamW; "
    "the per-token loss -log p (the PPO loss's gradient at ratio 1, unit advantages); "
    "installed beside transformers 5.24, outside verl's transformers<5.11 pin"
)
_VERL_PROMISE = (
    "agg_loss: 'Aggregate the loss across global batch to ensure the loss is invariant to "
    "fsdp/megatron parallelism'"
)


def _verl(setting: str, step: str, scheme: str, **fields: object) -> Setting:
    return Setting(
        framework="verl",
        setting=setting,
        title=f"agg_loss, loss_agg_mode={setting}",
        step=f"{VERL}:{step}",
        model=LLAMA,
        forward=LLAMA_LOGITS,
        scheme=scheme,
        promise=_VERL_PROMISE,
        source=_VERL_SOURCE,
        deviations=_VERL_DEVIATIONS,
        **fields,
    )


SETTINGS: tuple[Setting, ...] = (
    _trainer("trainer-default", "Trainer, defaults (M = 1, 2)", "step_default"),
    _trainer("trainer-default-m4", "Trainer, defaults (M = 4)", "step_default", accum=(4,)),
    _trainer(
        "trainer-local-tokens",
        "Trainer, average_tokens_across_devices=False",
        "step_local_tokens",
    ),
    _trainer(
        "trainer-no-loss-kwargs",
        "Trainer, a model whose accepts_loss_kwargs is False",
        "step_no_loss_kwargs",
    ),
    _trainer(
        "trainer-moe-aux",
        "Trainer, Mixtral with output_router_logits and router_aux_loss_coef > 0",
        "step_default",
        model=MIXTRAL_AUX,
        objective=MIXTRAL_AUX_OBJECTIVE,
        source="transformers 5.24.0 modeling_mixtral.py L626-633 (the router loss added to the "
        "model's loss), trainer.py L2208-2216 (loss x num_processes), L2110-2119 (no division "
        "by GA once num_items_in_batch is used)",
        deviations=f"{NO_CLIPPING}; the Mixtral's experts run eagerly (experts_implementation="
        "'eager'), as transformers' default grouped_mm refuses float64",
    ),
    _sft(
        "sft-nll",
        "SFTTrainer, loss_type=nll, defaults (bf16 autocast)",
        "step_nll",
        precision="bfloat16",
        deviations=f"{NO_CLIPPING}; SFTConfig's default bf16=True autocasts on the CPU: "
        "judged at bf16-level",
    ),
    _sft("sft-nll-fp32", "SFTTrainer, loss_type=nll, bf16=False", "step_nll_float32"),
    _sft(
        "sft-nll-local-tokens",
        "SFTTrainer, loss_type=nll, average_tokens_across_devices=False (bf16 autocast)",
        "step_nll_local_tokens",
        precision="bfloat16",
        deviations=f"{NO_CLIPPING}; SFTConfig's default bf16=True autocasts on the CPU: "
        "judged at bf16-level",
    ),
    Setting(
        framework="trl",
        setting="sft-dft",
        title="SFTTrainer, loss_type=dft",
        also=("transformers", "accelerate"),
        promise="'dft': Dynamic Fine-Tuning, as described in arXiv 2508.05629",
        source="trl 1.16.0 sft_config.py L107-113; sft_trainer.py L1613-1615",
        waiting="dft's per-token loss is -p_t log p_t (the probability detached), not the "
        "cross-entropy the verify reference computes",
        prediction="the same count and scale as nll: the global token mean of the dft loss",
    ),
    _sft(
        "sft-moe-aux",
        "SFTTrainer, loss_type=nll, a MoE model's router aux loss, bf16=False",
        "step_nll_float32",
        model=MIXTRAL_AUX,
        objective=MIXTRAL_AUX_OBJECTIVE,
        promise="sft_trainer.py L1625-1626: 'The MoE aux loss is a per-micro-batch mean that "
        "DDP averages across ranks. With `num_items_in_batch`, `Trainer` leaves gradient "
        "accumulation to the loss, so average it over the accumulation steps'",
        source="trl 1.16.0 sft_trainer.py L1196-1211 (aux_loss_enabled), L1615-1629 compute_loss",
        deviations=f"{NO_CLIPPING}; the Mixtral's experts run eagerly (experts_implementation="
        "'eager'), as transformers' default grouped_mm refuses float64",
    ),
    _grpo(
        "grpo-grpo",
        "GRPOTrainer, loss_type=grpo",
        "step_grpo",
        "GRPO_INTENDED",
        "'grpo': 'Aggregates token-level losses by normalizing over sequence length.'",
    ),
    _grpo(
        "grpo-bnpo",
        "GRPOTrainer, loss_type=bnpo",
        "step_bnpo",
        "BNPO_INTENDED",
        "'bnpo': 'Aggregates token-level losses by normalizing with the number of active "
        "token in the local batch. Note that normalization is performed over the local batch "
        "only, so results may slightly vary depending on the local batch size'",
    ),
    _grpo(
        "grpo-dr_grpo",
        "GRPOTrainer, loss_type=dr_grpo",
        "step_dr_grpo",
        "DR_GRPO_INTENDED",
        "'dr_grpo': 'Aggregates token-level losses by normalizing with a global constant. "
        "[...] The value of the constant corresponds to max_completion_length.' (the Dr. GRPO "
        "objective: rows x max_completion_length)",
    ),
    _grpo(
        "grpo-dapo",
        "GRPOTrainer, loss_type=dapo (default)",
        "step_dapo",
        "DAPO_INTENDED",
        _DAPO_PROMISE,
    ),
    _grpo(
        "grpo-dapo-spg1",
        "GRPOTrainer, dapo, steps_per_generation=1 < gradient_accumulation_steps",
        "step_dapo_spg1",
        "DAPO_INTENDED",
        _DAPO_PROMISE,
        world_sizes=(1,),
    ),
    _grpo(
        "grpo-dapo-spg-double",
        "GRPOTrainer, dapo, steps_per_generation = 2 x gradient_accumulation_steps",
        "step_dapo_spg_double",
        "DAPO_INTENDED",
        _DAPO_PROMISE,
        accum=(1,),
        deviations=_GRPO_DEVIATIONS + _SHUFFLE_OFF,
    ),
    _grpo(
        "grpo-cispo",
        "GRPOTrainer, loss_type=cispo, epsilon_high at its default",
        "step_cispo",
        "CISPO_INTENDED",
        "'cispo': '[...] normalizing with the number of active tokens in the global "
        "accumulated batch'; epsilon_high: 'If not specified, it defaults to the same value "
        "as [...] epsilon [...] recommended value is 5.0' (grpo_config.py L184-188)",
    ),
    _grpo(
        "grpo-cispo-eps5",
        "GRPOTrainer, loss_type=cispo, epsilon_high=5.0",
        "step_cispo_eps5",
        "CISPO_INTENDED",
        "'cispo': '[...] normalizing with the number of active tokens in the global "
        "accumulated batch'",
    ),
    _grpo(
        "grpo-sapo",
        "GRPOTrainer, loss_type=sapo",
        "step_sapo",
        "SAPO_INTENDED",
        "the docs name no aggregation for sapo; the code groups it with grpo (a per-sequence "
        "mean, as the SAPO paper's objective)",
    ),
    _grpo(
        "grpo-vespo",
        "GRPOTrainer, loss_type=vespo",
        "step_vespo",
        "VESPO_INTENDED",
        "the docs name no aggregation for vespo; the code normalizes it as dapo's",
    ),
    _grpo(
        "grpo-luspo",
        "GRPOTrainer, loss_type=luspo (importance_sampling_level=sequence)",
        "step_luspo",
        "LUSPO_INTENDED",
        "'luspo': 'A sequence-level loss that scales each sequence's loss by its length.'",
    ),
    Setting(
        framework="trl",
        setting="grpo-entropy",
        title="GRPOTrainer, entropy_coef > 0 (an entropy bonus)",
        also=("transformers", "accelerate"),
        promise="the bonus 'is always the mean per-token entropy regardless of loss_type'",
        source="trl 1.16.0 grpo_trainer.py L3189-3211",
        waiting="a second loss term (the entropy bonus): verify judges one term until it "
        "takes multi-term objectives",
        prediction="entropy summed over the microbatch / its own token count / GA, DDP "
        "averaged: a per-microbatch mean (microbatch-mean for that term)",
    ),
    _optax(
        "multisteps-jit-mean",
        "MultiSteps(use_grad_mean=True), jit with the batch sharded (NamedSharding)",
        "step_jit_mean",
    ),
    _optax(
        "multisteps-jit-sum",
        "MultiSteps(use_grad_mean=False), jit with the batch sharded (NamedSharding)",
        "step_jit_sum",
    ),
    _optax(
        "multisteps-shard-map-mean",
        "MultiSteps(use_grad_mean=True), shard_map with each device's mean loss pmean'd",
        "step_shard_map_mean",
    ),
    _optax(
        "multisteps-shard-map-sum",
        "MultiSteps(use_grad_mean=False), shard_map with each device's mean loss pmean'd",
        "step_shard_map_sum",
    ),
    _optax(
        "nnx-optimizer-mean",
        "flax nnx.Optimizer(MultiSteps(use_grad_mean=True)), nnx.jit, batch sharded",
        "step_nnx_mean",
    ),
    _optax(
        "nnx-optimizer-sum",
        "flax nnx.Optimizer(MultiSteps(use_grad_mean=False)), nnx.jit, batch sharded",
        "step_nnx_sum",
    ),
    Setting(
        framework="torchtitan",
        setting="fsdp",
        title="loss / global_valid_tokens, FSDP2 (data_parallel_shard_degree = R)",
        step=f"{TITAN}:step",
        model=LLAMA,
        forward=LLAMA_LOGITS,
        promise=_TITAN_PROMISE,
        source=_TITAN_SOURCE,
        deviations=_TITAN_DEVIATIONS,
    ),
    Setting(
        framework="torchtitan",
        setting="replicate",
        title="loss / global_valid_tokens, data_parallel_replicate_degree = R (HSDP, one "
        "rank per shard group)",
        step=f"{TITAN}:step_replicate",
        model=LLAMA,
        forward=LLAMA_LOGITS,
        promise=_TITAN_PROMISE,
        source=_TITAN_SOURCE + "; models/llama3/parallelize.py L69-70",
        deviations=_TITAN_DEVIATIONS,
    ),
    _deepspeed(
        "engine-loop",
        "engine(...).loss (a microbatch token mean), engine.backward, engine.step; ZeRO 0",
        "step_engine_loop",
    ),
    _deepspeed(
        "trainer-normalized",
        "sum / global num_items_in_batch x R, engine.backward(scale_wrt_gas=False); ZeRO 0",
        "step_trainer_normalized",
        deviations=f"{_DS_DEVIATIONS}; the count and the x R of transformers' "
        "Trainer (trainer.py L2306-2360, L2207-2215) written out, not the Trainer itself",
    ),
    _deepspeed(
        "model-loss-scale-wrt-gas-false",
        "the model's own loss, normalized by the global count, straight to "
        "engine.backward(loss, scale_wrt_gas=False); ZeRO 0",
        "step_unscaled_model_loss",
        deviations=f"{_DS_DEVIATIONS}; num_items_in_batch = the global count / R, so that "
        "the model's loss already carries the x R",
    ),
    _tunix(
        "token-mean",
        "step_token_mean",
        "token_mean",
        "'sum all the token loss, and average by total number of completion tokens in the "
        "batch' (common.py L555-559)",
    ),
    _tunix(
        "sequence-mean-token-mean",
        "step_sequence_mean_token_mean",
        "row_mean",
        "each sequence's token mean over the non-empty rows (common.py L560-565); GRPO's "
        "default (grpo_learner.py L54-57)",
    ),
    _tunix(
        "seq-mean-token-sum",
        "step_seq_mean_token_sum",
        "crosscheck.conformance.settings:NONEMPTY_ROWS_TOKEN_SUM",
        "'1) sum token losses within each sequence 2) average only across sequences that "
        "have at least one valid token' (common.py L575-580)",
    ),
    _tunix(
        "sequence-mean-token-scale",
        "step_sequence_mean_token_scale",
        "configured_rows_sum:2904",
        "'Scale by maximum response length instead of actual response length' (common.py "
        "L566-574): each row's token sum / T, over the non-empty rows (ragged: 24 x 121)",
        fixtures=("ragged",),
    ),
    _verl("token-mean", "step_token_mean", "token_mean"),
    _verl("token-sum", "step_token_sum", "sum"),
    _verl(
        "seq-mean-token-sum",
        "step_seq_mean_token_sum",
        "configured_rows_sum:144",
        fixtures=("ragged",),
    ),
    _verl(
        "seq-mean-token-mean",
        "step_seq_mean_token_mean",
        "configured_rows_mean:144",
        fixtures=("ragged",),
    ),
    _verl(
        "seq-mean-token-sum-norm",
        "step_seq_mean_token_sum_norm",
        "configured_rows_sum:3456",
        fixtures=("ragged",),
    ),
    Setting(
        framework="megatron-core",
        setting="schedules-per-token",
        title="forward_step_calc_loss, calculate_per_token_loss=False",
        source="megatron-core 0.16.1 pipeline_parallel/schedules.py forward_step_calc_loss",
        not_run="CUDA is hard-coded in the schedules (device='cuda', grad buffers on "
        "torch.cuda.current_device()); 0.17+ needs Python >= 3.12",
        prediction="output / num_tokens / num_microbatches with the local count: "
        "microbatch-mean (and the count is CP-shard-local, Megatron-LM#7513)",
    ),
    Setting(
        framework="maxtext",
        setting="gradient-accumulation",
        title="gradient_accumulation.py",
        engine="jax",
        source="MaxText 0.2.5 gradient_accumulation.py",
        not_run="MaxText 0.2.5 needs Python >= 3.12; this machine runs 3.11",
        prediction="raw gradients summed over microbatches and divided by the total weights: "
        "the global token mean; aux losses divided by the accumulation steps",
    ),
)


def find_settings(frameworks: list[str] | None, settings: list[str] | None) -> list[Setting]:
    """The settings named by ``--frameworks`` and ``--settings`` (all when neither is given);
    ValueError naming an unknown one and the known ones."""
    known_frameworks = sorted({s.framework for s in SETTINGS})
    for name in frameworks or []:
        if name not in known_frameworks:
            raise ValueError(f"unknown framework {name!r}; known: {', '.join(known_frameworks)}")
    chosen = [s for s in SETTINGS if not frameworks or s.framework in frameworks]
    for name in settings or []:
        if not any(name in (s.setting, s.key) for s in chosen):
            names = ", ".join(s.setting for s in chosen)
            raise ValueError(f"unknown setting {name!r}; known here: {names}")
    if settings:
        chosen = [s for s in chosen if s.setting in settings or s.key in settings]
    return chosen
