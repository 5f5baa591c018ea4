"""Causal language models for both presets, through one loading path.

`load_causal_lm(preset)` always ends in `AutoModelForCausalLM.from_pretrained(source,
use_safetensors=True)`. For the `full` preset `source` is a hub id (default
`meta-llama/Llama-2-7b-hf`, the model the upstream course measured; gated, so set `HF_TOKEN`,
or point `TPUPEDIA_LLM` at any Llama-architecture id or local directory). For `tiny` it is a
directory that `tiny_checkpoint` writes with `save_pretrained`: a random two-layer Llama and an
offline byte-level tokenizer. CI therefore exercises exactly the code a TPU user runs, on a
checkpoint it can build without a network.

Introduced in notebook 01 (a Hugging Face model in JAX); `tpupedia bench llama` uses it too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tpupedia.models import llama
from tpupedia.presets import Preset

__all__ = [
    "FULL_MODEL_ID",
    "ENV_MODEL",
    "tiny_llama_config",
    "offline_tokenizer",
    "tiny_checkpoint",
    "model_source",
    "load_causal_lm",
]

FULL_MODEL_ID = llama.FULL_ID  # the family's facts live in tpupedia.models.llama
ENV_MODEL = "TPUPEDIA_LLM"

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llama_config(**overrides):
    """A two-layer Llama small enough for a 2-core CPU: 64 wide, 4 heads, 2 KV heads (GQA)."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def offline_tokenizer():
    """A byte-level BPE tokenizer built in memory (no files, no network): 256 bytes + 3 specials,
    with Llama-2's special tokens and their quirks, so the tiny preset meets what the full
    checkpoint does: `<unk>` = 0, `<s>` = 1 prepended to every encoding, `</s>` = 2, and **no
    pad token** (`pad_token_id` is None: pad with `eos_token_id`, as notebook 01 does)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.processors import TemplateProcessing
    from transformers import Qwen2Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                         pad_token=None)
    tok._tokenizer.post_processor = TemplateProcessing(  # Llama's add_bos_token=True
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    tok.chat_template = _CHAT_TEMPLATE
    return tok


def tiny_checkpoint(directory: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write a random tiny Llama and its tokenizer with `save_pretrained` (safetensors).

    Returns the directory (a fresh temporary one when not given). Deterministic for a `seed`.
    """
    import torch
    from transformers import LlamaForCausalLM

    path = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tpupedia-tiny-llama-"))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    model.save_pretrained(path, safe_serialization=True)
    offline_tokenizer().save_pretrained(path)
    return path


def model_source(preset: Preset) -> str:
    """Where `load_causal_lm` reads from: `$TPUPEDIA_LLM`, else the preset's default."""
    if os.environ.get(ENV_MODEL):
        return os.environ[ENV_MODEL]
    return FULL_MODEL_ID if preset.pretrained else str(tiny_checkpoint())


def load_causal_lm(preset: Preset, source: str | os.PathLike | None = None, dtype=None):
    """Load `(model, tokenizer)` for `preset` from `source` (default: `model_source`).

    Weights come only from safetensors (`use_safetensors=True`: no pickle). The model is in
    eval mode, float32 for `tiny` and bfloat16 for `full` unless `dtype` says otherwise.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(source) if source is not None else model_source(preset)
    if dtype is None:
        dtype = torch.bfloat16 if preset.pretrained else torch.float32
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model.eval(), tokenizer
