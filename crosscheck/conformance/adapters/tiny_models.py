"""The tiny models the adapters train, built from a config (no download), the same every call.

``llama()`` is a two-layer ``LlamaForCausalLM`` over the fixtures' 40-token vocabulary with the
eager attention (the same arithmetic in float64 as in float32), seeded so that every call gives
the same initial weights, as ``verify --model`` requires. ``logits`` is the reference's forward
(``--forward``): the model's logits of the inputs. ``tokenizer()`` is a word-level tokenizer
over the same 40 ids, built in memory, for the trainers that want a ``processing_class``.
"""

from __future__ import annotations

import warnings

import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
