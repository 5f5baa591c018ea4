"""A parity check meant to hold on a TPU must ask for full float32 matmuls: a TPU runs float32
dots and convolutions in bf16 passes by default, a CPU ignores the setting. So the test reads the
lowered program, where the request is visible on every dot, instead of comparing numbers."""

import re

import jax
import pytest
import torch

from tpupedia import devices, llm, torchax_utils


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
    """`jax.default_matmul_precision("highest")` around the traced call (how notebooks `cogvideox_pipeline` and `hunyuan_video`
    and the pipelines' `matmul_precision="highest"` run their parity checks) marks every dot of
    a torchax-traced Hugging Face model HIGHEST; without it, the program leaves them DEFAULT."""
    highest, default = _lowered("highest"), _lowered(None)
    assert _dot_precisions(highest) == {"HIGHEST"}
    assert "HIGHEST" not in default and len(re.findall(r"dot_general", highest)) >= 7  # q, k, v, o, 3 MLP, lm_head


def test_highest_precision_reaches_the_convolutions_of_a_torchax_function():
    """Notebook `image_processing`'s blur (two depthwise `F.conv2d`) and notebook `cogvideox_vae_flax`'s VAE are convolutions: the same
    request marks them, as notebook `image_processing` shows in a cell."""
    from torchax.interop import jax_view

    from tpupedia import image

    blur = jax.jit(jax_view(image.gaussian_blur))
    x = jax.numpy.ones((1, 3, 16, 24), jax.numpy.float32)
    with jax.default_matmul_precision("highest"):
        highest = blur.lower(x).as_text()
    default = blur.lower(x).as_text()
    conv = r"precision_config = \[#stablehlo<precision (\w+)>"
    assert set(re.findall(conv, highest)) == {"HIGHEST"} and set(re.findall(conv, default)) == {"DEFAULT"}


# Lessons whose float32 parity checks must hold on a TPU, and the tolerance patterns that mark one.
PARITY_LESSONS = ["00_start_here", "01_hf_model_in_jax", "02_sharding", "03_torchax_internals",
                  "05_splash_attention", "06_cogvideox_vae_flax", "04_image_processing"]
_FP32_CHECK = re.compile(r"(atol=1e-[4-7]|[<]=? ?1e-[4-7]\b|tolerance = 1e-5|llm\.compare_logits\(.*preset\.dtype)")
_REQUEST = re.compile(r"""default_matmul_precision(\(|", )"highest"\)?""")


def _code_cells(lesson: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "lessons" / f"{lesson}.py").read_text()
    cells = re.split(r"^# %%.*$", text, flags=re.M)
    return [c for c in cells if c.strip() and not c.lstrip().startswith("# [markdown]")
            and not all(line.startswith("#") or not line.strip() for line in c.splitlines())]


@pytest.mark.parametrize("lesson", PARITY_LESSONS)
def test_every_float32_parity_lesson_requests_highest_precision_before_its_first_check(lesson):
    """A CPU ignores the precision setting, so only the source can show a parity check would hold
    on a TPU: each lesson must ask for "highest" (for the notebook, or in a `with` block) in or
    before the first cell that asserts a float32 tolerance."""
    cells = _code_cells(lesson)
    checks = [i for i, c in enumerate(cells) if _FP32_CHECK.search(c)]
    requests = [i for i, c in enumerate(cells) if _REQUEST.search(c)]
    assert checks, f"{lesson}: no float32 parity check found; update PARITY_LESSONS"
    assert requests and requests[0] <= checks[0], (
        f"{lesson}: cell {checks[0]} asserts a float32 tolerance but highest precision is first requested "
        f"in cell {requests[0] if requests else None}")


@pytest.mark.skipif(not devices.has_libtpu(), reason="needs libtpu (pip install 'jax[tpu]')")
def test_the_tpu_compiler_keeps_the_request_on_the_instruction():
    """AOT for v6e:2x4: the compiled TPU program carries `operand_precision={highest,highest}` on
    a float32 matmul asked for "highest", and no precision request at the default."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpupedia import aot

    chip = NamedSharding(devices.topology_mesh("v6e:2x4", (2, 4), ("a", "b")), P())
    x = aot.abstract((256, 256), jax.numpy.float32, chip)
    text = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            text[precision] = aot.compile_aot(lambda a, b: a @ b, x, x).compiled.as_text()
    assert "operand_precision={highest,highest}" in text["highest"]
    assert "operand_precision" not in text["default"]
