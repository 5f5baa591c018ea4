"""Causal language models for both presets, through one loading path.

`load_causal_lm(preset)` always ends in `AutoModelForCausalLM.from_pretrained(source,
use_safetensors=True)`. For the `full` preset `source` is a hub id (default
`meta-llama/Llama-2-7b-hf`, the model the upstream course measured; gated, so set `HF_TOKEN`,
or point `TPUPEDIA_LLM` at any Llama-architecture id or local directory). For `tiny` it is a
directory that `tiny_checkpoint` writes with `save_pretrained`: a random two-layer Llama and an
offline byte-level tokenizer. CI therefore exercises exactly the code a TPU user runs, on a
checkpoint it can build without a network.

Two more things notebook `hf_model_in_jax` needs in several cells live here too: `compare_logits`, the one
measure of "the same logits" for float32 and bfloat16 runs, and `static_cache` /
`cache_arrays` / `empty_cache_arrays`, which carry a transformers `StaticCache` in and out of a
jitted decode step as plain arrays.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX); `tpupedia bench llama` uses it too.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    "FP32_ABS_BOUND",
    "BF16_RELATIVE_BOUND",
    "TOP1_MARGIN_STEPS",
    "bf16_step",
    "LogitsAgreement",
    "compare_logits",
    "static_cache",
    "cache_arrays",
    "empty_cache_arrays",
    "greedy_decode",
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
    pad token** (`pad_token_id` is None: pad with `eos_token_id`, as notebook `hf_model_in_jax` does)."""
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


# ---------------------------------------------------------------------------------------------
# "The same logits": one measure for both presets (notebook `hf_model_in_jax`)

FP32_ABS_BOUND = 1e-5
"""float32 runs (the tiny preset): largest absolute logit difference allowed. Two float32
programs that round in different places differ by ~1e-7 relative per operation; 1e-5 leaves
room for a few layers of that, and is far below any bfloat16 effect."""

BF16_RELATIVE_BOUND = 2.0**-4
"""bfloat16 runs (the full preset): largest `max |diff| / max |reference|` allowed. A bfloat16
number keeps 8 significant bits, so one rounding moves it by up to 2^-8 of its size. Two
programs that round in different places (PyTorch on a CPU, XLA on a TPU) collect a few such
roundings per layer in the residual stream; over Llama-2-7B's 32 layers, a few hundred
independent roundings add up to about sqrt(256) = 16 of them: 16 * 2^-8 = 2^-4."""

TOP1_MARGIN_STEPS = 4
"""A position is *decided* when the reference's top-2 margin exceeds this many bfloat16 steps at
the size of its top logit; the argmax must agree at every decided position. Below that margin
a near tie may legitimately go either way in bfloat16."""


def bf16_step(value: Any) -> Any:
    """The spacing of bfloat16 numbers at `abs(value)` (elementwise, numpy): 2^(e - 7) for
    2^e <= |value| < 2^(e+1). Between 1/256 and 1/128 of the value; 0.0625 at 10, 0.125 at 20."""
    import numpy as np

    magnitude = np.maximum(np.abs(np.asarray(value, dtype=np.float64)), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(magnitude)) - 7)


def _as_float32(x: Any):
    """A numpy float32 copy of a torch tensor, a torchax tensor or a JAX array."""
    import numpy as np
    import torch

    if hasattr(x, "jax") and hasattr(x, "torch") and callable(x.jax):  # a torchax tensor
        x = x.jax()
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x).astype(np.float32)  # a jax.Array (bfloat16 goes through ml_dtypes)


@dataclass(frozen=True, eq=False)
class LogitsAgreement:
    """How close two sets of logits are, as numbers (see `compare_logits`)."""

    dtype: str
    max_abs: float
    """max |got - reference| over every position and vocabulary entry."""
    reference_max: float
    """max |reference|: the scale the relative measure divides by."""
    bound: float
    """The largest `max_abs` allowed: `FP32_ABS_BOUND`, or `BF16_RELATIVE_BOUND * reference_max`."""
    positions: int
    top1_agree: int
    """Positions whose argmax is the same in both."""
    decided: int
    """Positions whose reference top-2 margin exceeds `TOP1_MARGIN_STEPS` bfloat16 steps."""
    decided_agree: int
    """Decided positions whose argmax is the same in both (must equal `decided`)."""
    per_position: tuple[float, ...]
    """max |got - reference| at each position (over the vocabulary)."""

    @property
    def relative(self) -> float:
        return self.max_abs / self.reference_max if self.reference_max else float("inf")

    @property
    def ok(self) -> bool:
        """Within the bound, and the same top-1 token at every decided position."""
        return self.max_abs <= self.bound and self.decided_agree == self.decided

    def __str__(self) -> str:
        from tpupedia.results import measured_text

        if self.dtype == "float32":  # against the bound: rounding noise's digits vary by CPU
            size = f"max |diff| {measured_text(self.max_abs, self.bound)}"
        else:  # the bound is relative to the reference's largest |value|
            size = f"max |diff| / max |reference| {measured_text(self.relative, BF16_RELATIVE_BOUND)}"
        return (f"{size} | top-1 agrees at {self.top1_agree}/{self.positions} positions, "
                f"{self.decided_agree}/{self.decided} decided ones")


def compare_logits(got: Any, reference: Any, dtype: str) -> LogitsAgreement:
    """Compare `got` with `reference` logits (`(..., vocab)`; torch, torchax or JAX) for a model
    that ran in `dtype` (`"float32"` or `"bfloat16"`, a preset's `dtype`).

    float32 is held to `FP32_ABS_BOUND` absolute. bfloat16 logits of size 10-20 sit one step
    (0.06-0.125) apart, so an absolute bound cannot hold; there the bound is relative,
    `BF16_RELATIVE_BOUND * max |reference|`. For both, the top-1 token must agree at every
    position whose reference top-2 margin exceeds `TOP1_MARGIN_STEPS` bfloat16 steps.

    Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX).
    """
    import numpy as np

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
    a, b = _as_float32(got), _as_float32(reference)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    diff = np.abs(a - b)
    reference_max = float(np.abs(b).max())
    top2 = np.sort(b, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > TOP1_MARGIN_STEPS * bf16_step(top2[:, 1])
    same = a.argmax(-1) == b.argmax(-1)
    bound = FP32_ABS_BOUND if dtype == "float32" else BF16_RELATIVE_BOUND * reference_max
    return LogitsAgreement(
        dtype=dtype,
        max_abs=float(diff.max()),
        reference_max=reference_max,
        bound=float(bound),
        positions=len(b),
        top1_agree=int(same.sum()),
        decided=int(decided.sum()),
        decided_agree=int((same & decided).sum()),
        per_position=tuple(float(x) for x in diff.max(-1)),
    )


# ---------------------------------------------------------------------------------------------
# A StaticCache as explicit state (notebook `hf_model_in_jax`, section 7)


def static_cache(config: Any, keys: list, values: list, lengths: list):
    """A transformers `StaticCache` around given per-layer key and value tensors.

    A jitted decode step is a pure function: the cache goes in as arrays and comes out as arrays
    (`cache_arrays`). Inside the step this rebuilds the cache object the model expects, setting
    on each `StaticLayer` what its `lazy_initialization` would (transformers 5.x), but around
    the tensors given instead of new zeros:

    * `keys[i]`, `values[i]`: `(batch, kv_heads, max_cache_len, head_dim)`, layer `i`'s cache;
    * `lengths[i]`: a 0-d integer tensor, the tokens already written (`cumulative_length`).
      transformers 5 derives the rotary positions and the mask offset of the next tokens from
      it, so a step needs no `cache_position`.

    `max_cache_len` is `keys[0].shape[-2]`. Only full-attention layers (Llama) are supported.

    Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX), section 7.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if not (len(keys) == len(values) == len(lengths)):
        raise ValueError(f"one key, value and length per layer: got {len(keys)}, {len(values)}, {len(lengths)}")
    cache = StaticCache(config=config, max_cache_len=keys[0].shape[-2])
    if len(cache.layers) != len(keys):
        raise ValueError(f"the config has {len(cache.layers)} layers, the arrays {len(keys)}")
    for layer, k, v, n in zip(cache.layers, keys, values, lengths):
        if type(layer) is not StaticLayer:
            raise TypeError(f"only full-attention StaticLayer caches are supported, not {type(layer).__name__}")
        layer.keys, layer.values, layer.cumulative_length = k, v, n
        layer.dtype, layer.device = k.dtype, k.device
        layer.batch_size, layer.num_heads, _, layer.k_head_dim = k.shape
        layer.v_head_dim = v.shape[-1]
        layer.is_initialized = True
    return cache


def cache_arrays(cache) -> tuple[list, list, list]:
    """`(keys, values, lengths)` per layer of a `StaticCache`: what a decode step returns so that
    the next step can rebuild the cache with `static_cache`. Introduced in notebook `hf_model_in_jax`."""
    layers = cache.layers
    return [l.keys for l in layers], [l.values for l in layers], [l.cumulative_length for l in layers]


def empty_cache_arrays(config: Any, max_cache_len: int, batch_size: int = 1, dtype: Any = None,
                       device: Any = None) -> tuple[list, list, list]:
    """Zero `(keys, values, lengths)` for `static_cache`: room for `max_cache_len` tokens, which
    must be **prompt + new tokens** (under JAX, writes past the end are dropped silently). Call
    inside `with env:` for `device="jax"`. Introduced in notebook `hf_model_in_jax`."""
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch_size, config.num_key_value_heads, max_cache_len, head_dim)
    layers = range(config.num_hidden_layers)
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
    lengths = [torch.tensor(0, device=device) for _ in layers]
    return keys, values, lengths


def greedy_decode(step: Any, params: Any, buffers: Any, ids: Any, config: Any, cache_len: int,
                  new_tokens: int, dtype: Any = None) -> tuple[Any, list[int]]:
    """Greedy decoding through a jitted cache step, `step(params, buffers, tokens, keys, values,
    lengths) -> (last logits, keys, values, lengths)` (one built on `static_cache` and
    `cache_arrays`): prefill the prompt `ids` (a CPU tensor) into a zero cache of `cache_len`
    tokens, then feed back one argmax token per step. Call it inside `with env:`, with whatever
    matmul precision the comparison needs. Returns prompt + `new_tokens` tokens on the CPU and the
    token count each layer's cache ended with (the last token is never fed back).

    Introduced in notebook `hf_model_in_jax`, section 7.
    """
    import torch

    keys, values, lengths = empty_cache_arrays(config, cache_len, dtype=dtype, device="jax")
    logits, keys, values, lengths = step(params, buffers, ids.to("jax"), keys, values, lengths)
    out = [ids]
    for i in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        out.append(token.to("cpu"))
        if i + 1 < new_tokens:
            logits, keys, values, lengths = step(params, buffers, token, keys, values, lengths)
    return torch.cat(out, dim=1), [int(n.to("cpu")) for n in lengths]
