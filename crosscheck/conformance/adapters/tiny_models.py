"""The tiny models the adapters train, built from a config (no download), the same every call.

``llama()`` is a two-layer ``LlamaForCausalLM`` over the fixtures' 40-token vocabulary with the
eager attention (the same arithmetic in float64 as in float32), seeded so that every call gives
the same initial weights, as ``verify --model`` requires. ``mixtral_aux()`` is a Mixtral of the
same sizes (4 experts, top 2, its experts eager) with its router load-balancing loss on, as
MoE fine-tuning runs it; ``MIXTRAL_AUX_OBJECTIVE`` is what its trainers mean: the token mean
of the cross-entropy over the update plus the router loss at its coefficient, the mean over
the update's forwards (``verify --objective``, docs/verify.md). ``logits`` is the reference's
forward (``--forward``): the model's logits of the inputs. ``tokenizer()`` is a word-level
tokenizer over the same 40 ids, built in memory, for the trainers that want a
``processing_class``.
"""

from __future__ import annotations

import warnings

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
)

#: The fixtures' vocabulary (crosscheck.fixtures.documents.VOCAB_SIZE).
VOCAB_SIZE = 40


def llama_config() -> LlamaConfig:
    """Two layers, hidden 32, grouped-query attention, eager attention."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )


def llama() -> LlamaForCausalLM:
    """A fresh tiny Llama, the same weights every call."""
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


#: The router loss's coefficient of `mixtral_aux` (Mixtral's own default is 0.001; a larger one
#: makes the term's weight plain in the gradient without changing what is checked).
ROUTER_AUX_LOSS_COEF = 0.02
MIXTRAL_AUX_OBJECTIVE = [
    {"kind": "ce"},
    {"kind": "moe_lb", "coefficient": ROUTER_AUX_LOSS_COEF, "top_k": 2, "scope": "microbatch"},
]


def mixtral_aux() -> MixtralForCausalLM:
    """A fresh tiny Mixtral (the Llama's sizes, 4 experts, top 2) whose forward adds its
    router loss (``output_router_logits``, ``router_aux_loss_coef``). Its experts run eagerly
    (``experts_implementation="eager"``; transformers' default ``grouped_mm`` refuses float64),
    so that the reference and the trainer run the model in float64 and only the trainers' own
    float32 arithmetic (the loss's upcast logits) sets the level: run in float32, TRL's fused
    log-probabilities leave a rounding of 3e-4 of their own size on the norm weights' small
    gradients, which the float32 worst-leaf test (1e-5) reads as an error."""
    torch.manual_seed(0)
    sizes = llama_config().to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keep += ("num_attention_heads", "num_key_value_heads", "max_position_embeddings")
    config = MixtralConfig(
        **{key: sizes[key] for key in keep},
        attn_implementation="eager",
        experts_implementation="eager",
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
    )
    return MixtralForCausalLM(config)


def logits(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits [B, T, V] the reference's token losses come from."""
    return model(input_ids=microbatch["inputs"]).logits


def tokenizer(eos_token: str = "t0") -> PreTrainedTokenizerFast:
    """Token ``t{i}`` is id i for i < 40, built in memory (no download); id 0 doubles as
    padding (the rows come padded to one length, and padded positions are masked out of the
    loss and the attention, so which id they carry does not matter)."""
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE)}
    core = Tokenizer(WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="t0", pad_token="t0", eos_token=eos_token
    )


def quiet_transformers() -> None:
    """Keep the frameworks' own notices out of the verify run's output: transformers' logger
    (the tokenizer's special tokens aligned to the config, and the like) at errors only, and
    its FutureWarnings about arguments the adapters do not choose (the trainers' configs
    pass deprecated ones on themselves)."""
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
