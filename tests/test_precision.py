"""A parity check meant to hold on a TPU must ask for full float32 matmuls: a TPU runs float32
dots and convolutions in bf16 passes by default, a CPU ignores the setting. So the test reads the
lowered program, where the request is visible on every dot, instead of comparing numbers."""

import re

import jax
import torch

from tpupedia import llm, torchax_utils


def _dot_precisions(lowered_text: str) -> set[str]:
    return set(re.findall(r"precision = \[(\w+), \w+\]", lowered_text))


def _lowered(precision: str | None) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    module = LlamaForCausalLM(llm.tiny_llama_config(num_hidden_layers=1)).eval()
    env = torchax_utils.default_env()
    with env:
        module.to("jax")
    fm = torchax_utils.FunctionalModule(module, lambda m, ids: m(input_ids=ids, use_cache=False).logits)
    ids = jax.numpy.ones((1, 8), jax.numpy.int32)
    if precision is None:
        return fm.lower(ids).as_text()
    with jax.default_matmul_precision(precision):
        return fm.lower(ids).as_text()


def test_highest_precision_reaches_every_dot_of_a_torchax_forward():
    """`jax.default_matmul_precision("highest")` around the traced call (how notebooks 06 and 07
    and the pipelines' `matmul_precision="highest"` run their parity checks) marks every dot of
    a torchax-traced Hugging Face model HIGHEST; without it, the program leaves them DEFAULT."""
    highest, default = _lowered("highest"), _lowered(None)
    assert _dot_precisions(highest) == {"HIGHEST"}
    assert "HIGHEST" not in default and len(re.findall(r"dot_general", highest)) >= 7  # q, k, v, o, 3 MLP, lm_head
