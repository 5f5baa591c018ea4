"""Llama: the facts of the decoder-only LLM the course starts from (Llama-2-7B on the full preset).

Configs, depth, FLOPs of a forward and what `tpupedia.dryrun` needs to build and call it. The
tiny model and the offline tokenizer live in `tpupedia.llm`, which loads both presets.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX); the dry-run of notebook `plan_without_tpu` reads it.
"""

from __future__ import annotations

from typing import Any

from tpupedia.models.spec import FamilySpec

__all__ = ["FAMILY", "FULL_ID", "FULL_LAYERS", "SPLASH_BLOCK_SIZES", "full_config", "forward_flops", "build", "step_inputs", "SPEC"]

FAMILY = "llama"
FULL_ID = "meta-llama/Llama-2-7b-hf"
FULL_LAYERS = 32
SPLASH_BLOCK_SIZES = (512, 512, 512)
"""Splash block sizes for the dry-run (`tpupedia.attention.default_block_sizes`' cap); untuned."""


def full_config(layers: int | None = None) -> dict[str, Any]:
    """Llama-2-7B: 32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000."""
    return dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=FULL_LAYERS if layers is None else layers, num_attention_heads=32,
                num_key_value_heads=32, max_position_embeddings=4096, use_cache=False)


def forward_flops(seq: int, batch: int = 1, layers: int = FULL_LAYERS, hidden: int = 4096,
                  mlp: int = 11008, vocab: int = 32000) -> dict[str, float]:
    """Matmul FLOPs of one forward over `batch x seq` tokens (causal attention counted full)."""
    tokens = batch * seq
    linear = 2 * tokens * (layers * (4 * hidden * hidden + 3 * hidden * mlp) + hidden * vocab)
    attention = batch * layers * 4 * seq * seq * hidden
    return {"tokens": tokens, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def build(layers: int | None = None, device: str = "meta", dtype: Any = None):
    """`LlamaForCausalLM` with the full config (shapes only on `meta`), in bf16 by default."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**full_config(layers))).to(dtype or torch.bfloat16)


def step_inputs(seq: int) -> tuple[list, Any]:
    """`(input specs, call)` for the dry-run: token ids `(1, seq)` replicated, and the forward."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def call(fm, w, b, ids):
        return fm(w, b, ids, return_dict=False)[0]

    return [((1, seq), jnp.int32, P())], call


def _tables() -> dict:
    from tpupedia import sharding

    return sharding.architecture_tables("llama")


SPEC = FamilySpec(name=FAMILY, module=__name__, kind="llm", full_id=FULL_ID, sharding=_tables(),
                  mask="causal_padding", layer_prefix="model.layers.0.",
                  title="Llama-2-7B (notebook `hf_model_in_jax`): one forward of the decoder")
"""This dry-run target in the registry (`tpupedia.families`); its tables are Llama's names in
`tpupedia.sharding.RULES`, shared by the Qwen2 and Mistral text encoders."""
