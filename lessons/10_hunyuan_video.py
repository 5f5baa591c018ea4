# ---
# jupyter:
#   jupytext:
#     formats: notebooks///ipynb,lessons///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · HunyuanVideo-1.5 text-to-video on TPU
#
# The second destination of the course. Notebook `cogvideox_pipeline` built a staged pipeline for CogVideoX:
# stage files, a scheduler step as a pure function, one compiled program for all steps, the
# guidance pair as one batch. HunyuanVideo-1.5 (an 8.3B-parameter transformer of 54 dual-stream
# blocks) goes down the same path, `tpupedia.pipelines.common`, and meets two new problems:
#
# 1. its diffusers forward **cannot be traced** by `jax.jit` (a Python `if` on a tensor, and
#    boolean-mask indexing whose output shape depends on the data);
# 2. its attention processor turns a padding vector into a **(B, 1, S, S) mask** in every block,
#    about 13 G elements per sample at 720p and 121 frames, and masks padded *queries* too, so
#    whole rows are masked and a naive softmax returns NaN;
#
# At 50 steps it is also slow; notebook `hunyuan_tuning_and_i2v` takes that on next (DeepCache,
# the sharding tables compared) and adds image-to-video.
#
# The notebook first makes a video in one call, the way `tpupedia generate hunyuan` does, and
# then takes that call apart:
#
# 1. the model's facts;
# 2. a forward jit can trace;
# 3. masks without the S x S matrix;
# 4. stage 1, two text encoders;
# 5. flow matching as a pure step;
# 6. stage 2, the denoising step written out here, and its collectives;
# 7. stage 3, decode, and parity with stock diffusers.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | a random 2-block HunyuanVideo-1.5 checkpoint written with `save_pretrained`, 8 simulated devices | about 2 GB of host RAM | about 80 s with its first compiles, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | `hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v`: bf16 transformer 16.7 GB, Qwen2.5-VL-7B text model 15.2 GB, ByT5 and the VAE under 1 GB each (from their parameter counts) | per chip: the text stage about 3 GiB (Qwen split over `tp`, AOT here); the transformer step at 720p, 121 frames, 7.8 GiB of arguments + 2.3 GiB of temporaries (AOT here, the `tp` table on the 2×4 mesh); the tiled VAE decode under 29 GiB (AOT here, one 256-pixel tile per chip) | 7.29 s per step at 720p, 121 frames (reported upstream, TPU v6e-8): about 6 minutes for 50 steps, plus compiles, twice over: the opening call and sections 4 to 7 each make the video, and section 6 runs the denoising loop twice |
#
# Section 3 reads recorded AOT compiles on the tiny preset and compiles live on the full one
# (minutes on a CPU host). On the full preset the checks against stock diffusers run what
# the host CPU can: the first two blocks of the checkpoint (sections 2 and 3), one forward of each
# text encoder (section 4), one denoising step at a small size (section 7).
#
# The full preset downloads HunyuanVideo-1.5, released under the **Tencent Hunyuan Community
# License Agreement**. Its territory excludes the European Union, the United Kingdom and South
# Korea: the agreement grants no licence to use the model there. Read it before you run the full
# preset. *Reading time: about 36 minutes.*

# %%
# %xmode Minimal
# On Colab or Kaggle: fetch and install the course once, then work in its notebooks/ folder;
# anywhere else this does nothing.
import os
import sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    raise RuntimeError("this copy of the course names no public repository to install from: clone the "
                       "course yourself, install it as its README says, and open its notebooks/ folder")
# (end of the hosted-runtime setup: python -m tpupedia.notebooks hosted writes the lines above)

from tpupedia import session

preset = session.start()  # preset, simulated devices, known warnings silenced (notebook `hf_model_in_jax`)
preset.name

# %% [markdown]
# ## The whole thing in one call
#
# As in notebook `cogvideox_pipeline`: a request, one call that runs the stages and writes the mp4, and the video.
# This is what `tpupedia generate hunyuan --prompt ...` does; the preset picks the checkpoint and
# the default size. The prompt quotes a word, which wakes the second text encoder (section 4).

# %%
import tempfile
from pathlib import Path

from tpupedia.models import hunyuan as family
from tpupedia.pipelines import hunyuan as pipeline

scratch = Path(tempfile.mkdtemp(prefix="tpupedia-09-"))
request = pipeline.Request(prompt='A neon sign that says "OPEN" flickers on a rainy street at night.',
                           negative_prompt="blurry, low quality", **family.default_request(preset))
log = []  # one line per stage, with its timings and paths: kept off the page
reports = pipeline.run(request, pipeline.Options(quiet=True), preset=preset, workdir=scratch / "run",
                       out=scratch / "first.mp4", log=log.append)
for r in reports:
    print(f"{r.stage:>8}: {r.path.name}")

# %% [markdown]
# The video. On the tiny preset the checkpoint's weights are random, so what plays is noise:
# coloured static that changes from frame to frame, with no sign, no street and no rain. That is
# the expected result, not a failure. What this run shows is the shape of the output, the
# request's frame count at its width and height, and section 7 shows that these frames equal
# stock diffusers' frames from the same weights and seed. On the full preset the same cell plays
# the prompt's video. The file's bytes depend on the ffmpeg build, so nbval does not compare this
# cell's output.

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import Video

Video(str(scratch / "first.mp4"), embed=True, width=256, html_attributes="controls loop autoplay muted")

# %% tags=["check"]
assert [r.stage for r in reports] == ["text", "denoise", "decode"] and all(r.ran for r in reports)
assert (scratch / "first.mp4").stat().st_size > 0

# %% [markdown]
# ## 1. One home for the model's facts
#
# `tpupedia.models.hunyuan` holds every HunyuanVideo-1.5 fact the pipeline, the dry-run and the
# docs use. The upstream material disagrees with itself about the model's size (54 double
# blocks in one place; 53 blocks of width 3072 and ~13B parameters, or 20 + 40 blocks, in
# others). The configuration itself settles it: build the transformer on `meta` (shapes only,
# no memory) from diffusers' defaults for the 720p t2v checkpoint and count.

# %%
full = family.build()  # on `meta`: 54 blocks, no weights allocated
config = full.config
params = sum(p.numel() for p in full.parameters())
print(f"{config.num_layers} dual-stream blocks, {config.num_attention_heads} heads of {config.attention_head_dim} "
      f"(width {config.num_attention_heads * config.attention_head_dim}), MLP ratio {config.mlp_ratio}, "
      f"{config.num_refiner_layers} text-refiner layers")
print(f"{params / 1e9:.2f} B parameters, {params * 2 / 1e9:.1f} GB in bf16")

# %% [markdown]
# The frame rule is the VAE's: it keeps the first frame and compresses the rest 4x in time, so a
# video has `4n + 1` frames; space is compressed 16x and the transformer's patch is 1, so every
# latent pixel is a token. Each step also carries three text slots whatever the prompt: 1000
# Qwen2.5-VL tokens, 256 ByT5 glyph tokens and 729 image tokens (zeros and fully masked for
# text-to-video, but still in the sequence in diffusers' layout).

# %%
text_slots = sum(n for n, _ in family.TEXT_SLOTS.values())
print(f"{'frames':>6} {'latent':>6} {'video tokens':>13} {'+ text slots':>13} {'mask elements':>15}")
for frames in (9, 49, 121):
    tokens = family.video_tokens(1280, 720, frames)
    print(f"{frames:>6} {family.latent_frames(frames):>6} {tokens:>13,} {tokens + text_slots:>13,} "
          f"{family.mask_elements(1280, 720, frames):>15,}")

# %% [markdown]
# The tiny preset is a random 2-block checkpoint written with `save_pretrained` and loaded with
# the same `from_pretrained(..., use_safetensors=True)` the full preset uses. It shares the full
# checkpoint's rules: its VAE compresses 16x in space and 4x in time, its tokenizer has
# Qwen2.5-VL's special tokens. A request it cannot produce is refused before anything loads:

# %%
from tpupedia.errors import expect

expect(lambda: pipeline.validate(pipeline.Request(**{**request.__dict__, "frames": 120}), pipeline.Options()),
       family.ModelInputError, max_lines=1)
_ = expect(lambda: pipeline.validate(pipeline.Request(**{**request.__dict__, "height": 100}), pipeline.Options()),
           family.ModelInputError, max_lines=1)

# %% tags=["check"]
# the configuration settles the size: 54 dual-stream blocks of width 2048, about 8.3 B parameters
assert config.num_layers == family.FULL_LAYERS == 54
assert config.num_attention_heads * config.attention_head_dim == 2048 and 8.0e9 < params < 8.6e9
# the frame rule and the text slots give 720p's token count and diffusers' mask size
assert family.video_tokens(1280, 720, 121) == 31 * 45 * 80 == 111_600
assert family.mask_elements(1280, 720, 121) == (111_600 + 1_985) ** 2  # about 12.9 G per sample

# %% [markdown]
# ### Exercise 1: predict the mask's sizes for a 480p video
#
# Take a 480p request, 848x480 and 61 frames. **Predict** first, from the frame rule and the three
# text slots of this section: the latent frames, the video tokens, the length of the validity
# vector each attention receives per sample (section 3 keeps the mask as that vector), and the
# number of elements in diffusers' `(S, S)` mask per sample. Then open the solution, run it, and
# compare.

# %% tags=["solution"]
wide = pipeline.Request(prompt="a fox in the snow", frames=61, height=480, width=848)
pipeline.validate(wide, pipeline.Options())  # accepted: 4n + 1 frames, a multiple of 16 on each side
wide_latent_frames = family.latent_frames(wide.frames)
wide_tokens = family.video_tokens(wide.width, wide.height, wide.frames)
wide_sequence = wide_tokens + text_slots  # the validity vector's length, per sample
wide_matrix = family.mask_elements(wide.width, wide.height, wide.frames)
print(f"{wide.width}x{wide.height}, {wide.frames} frames: {wide_latent_frames} latent frames, {wide_tokens:,} video tokens")
print(f"validity vector: {wide_sequence:,} booleans per sample; diffusers' mask: {wide_matrix:,} "
      f"({wide_matrix / wide_sequence:,.0f}x the vector)")

# %% tags=["check"]
assert wide_latent_frames == (61 - 1) // 4 + 1 == 16
assert wide_tokens == 16 * (480 // 16) * (848 // 16) == 25_440  # patch 1: one token per latent pixel
assert wide_sequence == 25_440 + 1000 + 256 + 729 and wide_matrix == wide_sequence**2

# %% [markdown]
# ## 2. A forward that `jax.jit` can trace
#
# Load the checkpoint's transformer and try to jit its stock forward under torchax. It fails
# on its first data-dependent branch: `is_t2v = torch.all(image_embeds == 0)` feeds a Python
# `if`, which asks a traced boolean (`bool[]`) for a concrete value.
#
# Sections 2 and 3 load the transformer four times: once to run its stock forward on the host
# CPU, three times onto a single device, unsharded, two of them at once. The whole model is
# 16.7 GB in bf16 (section 1), and two copies do not fit on one 31.25 GiB chip. So on the full
# preset `load_transformer` reads only the checkpoint's first two blocks, with its embedders,
# text refiner and final layer: real weights, the same code, as many blocks as the tiny
# checkpoint has. What these sections show (the trace failure, the NaN, the mask in the HLO)
# needs no more than two blocks.

# %%
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from tpupedia import torchax_utils

source, label = family.model_source(preset)
dtype = getattr(torch, preset.dtype)
blocks = {} if preset.host_runs_whole_models else {"num_layers": 2}  # full: blocks 0 and 1 of 54


def load_transformer():
    """The checkpoint's transformer on the CPU: whole on the tiny preset, its first two blocks on the full one."""
    return HunyuanVideo15Transformer3DModel.from_pretrained(source, subfolder="transformer", dtype=dtype,
                                                            use_safetensors=True, **blocks).eval()


stock_transformer = load_transformer()
t_cfg = stock_transformer.config
g = torch.Generator().manual_seed(0)
x = torch.randn(2, t_cfg.in_channels, 3, 4, 4, generator=g).to(dtype)
timestep = torch.tensor([900.0, 900.0]).to(dtype)
text = torch.randn(2, 1000, t_cfg.text_embed_dim, generator=g).to(dtype)
text_mask = (torch.arange(1000) < torch.tensor([[37], [12]])).to(dtype)  # 37 and 12 real tokens, the rest padding
glyph = torch.zeros(2, 256, t_cfg.text_embed_2_dim, dtype=dtype)
glyph_mask = torch.zeros(2, 256, dtype=dtype)  # no quoted text: all padding
image = torch.zeros(2, 729, t_cfg.image_embed_dim, dtype=dtype)
kwargs = dict(encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask, image_embeds=image, return_dict=False)

env = torchax_utils.default_env()
torchax_utils.register_common_outputs()


def to_jax(*tensors):
    with env:
        return [t.to("jax") for t in tensors]


def stock_under_jit():
    module = load_transformer()
    with env:
        module.to("jax")
        args = to_jax(x, timestep, text, text_mask, glyph, glyph_mask, image)
        return torchax_utils.JitModule(module)(*args[:4], encoder_hidden_states_2=args[4],
                                               encoder_attention_mask_2=args[5], image_embeds=args[6], return_dict=False)


import jax

error = expect(stock_under_jit, jax.errors.ConcretizationTypeError, max_lines=2)

# %% [markdown]
# The second construct would fail next: diffusers reorders the text tokens per sample with
# boolean masks (`text[text_mask]`, valid tokens first), and a tensor whose length depends on
# the data has no static shape. `tpupedia.models.hunyuan.static_forward` keeps every other op and
# replaces the two constructs:
#
# | stock forward | `static_forward` |
# |---|---|
# | `if is_t2v: image = image * 0.0` | `torch.where(is_t2v, image * 0.0, image)` |
# | `cat([image[m3], byt5[m2], qwen[m1], ...])` per sample | a stable `argsort` of `~valid` (valid first, order kept), then `gather` |
#
# On PyTorch it is the stock forward bit for bit, padding included:

# %%
with torch.no_grad():
    reference = stock_transformer(x, timestep, text, text_mask, **kwargs)[0]
    rewritten = family.static_forward(stock_transformer, x, timestep, text, text_mask, **kwargs)[0]
print("bit-identical to the stock forward:", torch.equal(rewritten, reference), "| output", tuple(reference.shape))

# %% tags=["check"]
assert "bool[]" in str(error) and torch.equal(rewritten, reference)

# %% [markdown]
# ## 3. Masks without the S x S matrix
#
# Traced under `jax.jit` with torchax's own attention, the rewritten forward compiles, and
# returns NaN:

# %%
import numpy as np

transformer = load_transformer()
with env:
    transformer.to("jax")
static_fm = torchax_utils.FunctionalModule(transformer, family.static_forward, return_dict=False)
inputs = [jax.numpy.asarray(t.float().numpy()).astype(jax.numpy.dtype(preset.dtype))
          for t in (x, timestep, text, text_mask)]
extra = [jax.numpy.asarray(t.float().numpy()).astype(jax.numpy.dtype(preset.dtype)) for t in (glyph, glyph_mask, image)]


def forward(weights, buffers, x, t, text, mask, glyph, glyph_mask, image):
    return static_fm(weights, buffers, x, t, text, mask, None, glyph, glyph_mask, image)[0]  # noqa: F821 - defined above, deleted once this section is done


with torchax_utils.restoring_ops(env):
    torchax_utils.stock_ops(env)  # torchax's own scaled_dot_product_attention
    naive = np.asarray(jax.jit(forward)(*static_fm.state(), *inputs, *extra))
print(f"NaN in the output: {np.isnan(naive).mean():.0%} of the values")

# %% [markdown]
# The processor builds `valid[i] & valid[j]` for every pair of tokens, so a padded token's *row*
# sees no key at all. A softmax over a row of `-inf` is `0 / 0`. PyTorch's CPU kernel returns 0
# for such rows, and the stock model relies on it; a plain softmax returns NaN, and the NaN does
# not stay in the padded rows: the next block multiplies the padded tokens by their zero mask,
# and `0 * NaN` is NaN, which then reaches every token through attention's weighted sum.
#
# Two fixes are needed. Rows with no visible key must give 0 (the upstream port found this
# too, and the stack's SDPA override does it). And the mask should never be built: it is fully
# described by the `(B, S)` validity vector. `hunyuan.PaddingAttnProcessor` is diffusers'
# processor with the vector kept and handed to an `attend(q, k, v, valid)` function; under
# torchax that is `tpupedia.attention.padded_attention`, where splash (notebook `splash_attention`) takes the
# vector as segment ids and the reference path broadcasts it inside the score computation.
#
# The fixed forward is compared with the stock one as notebook `cogvideox_pipeline` compares its stages: in
# float32 (tiny) to rounding, an absolute bound; in bfloat16 (full) relative to the largest
# value, at most 2^-4 (notebook `hf_model_in_jax`'s `llm.BF16_RELATIVE_BOUND`), because bfloat16 rounds each
# value relative to its size.

# %%
import functools

from torchax.interop import call_jax

from tpupedia import attention, llm, results


def relative(got, want):
    """max |got - want| / max |want| in float32 (torch or NumPy arrays): notebook `hf_model_in_jax`'s bfloat16 measure."""
    got, want = (a.float().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, np.float32) for a in (got, want))
    return float(np.abs(got - want).max() / np.abs(want).max())


shapes_seen = []
exact = jax.jit(functools.partial(attention.padded_attention, backend="reference"))


def attend(q, k, v, valid):
    shapes_seen.append(tuple(valid.shape))
    return call_jax(exact, q, k, v, valid)


family.make_jit_friendly(transformer, attend)
with torchax_utils.restoring_ops(env):
    torchax_utils.install_masked_row_safe_sdpa(env)  # the text refiner's small (B, 1, 1000, 1000) mask
    with jax.default_matmul_precision("highest"):  # a parity check: full fp32 matmuls on a TPU too
        fixed = np.asarray(jax.jit(forward)(*static_fm.state(), *inputs, *extra))
if dtype == torch.float32:  # tiny: equal to float32 rounding
    forward_error, forward_bound = float(np.abs(fixed - reference.float().numpy()).max()), 1e-5
    print(f"NaN: {np.isnan(fixed).mean():.0%}; max abs difference from the stock forward on PyTorch:",
          results.error_text(forward_error, forward_bound))
else:  # full, bfloat16: relative to the largest value
    forward_error, forward_bound = relative(fixed, reference), llm.BF16_RELATIVE_BOUND
    print(f"NaN: {np.isnan(fixed).mean():.0%}; max abs difference from the stock forward on PyTorch over its "
          f"largest |value|: {forward_error:.1e} (bound {forward_bound:.1e})")
print("what each block's attention received:", sorted(set(shapes_seen)), "(batch, tokens)")

# %%
tokens = 3 * 4 * 4 + text_slots
assert np.isnan(naive).any() and not np.isnan(fixed).any()
assert forward_error <= forward_bound
assert set(shapes_seen) == {(2, tokens)}  # a vector, never (2, 1, S, S)

# %% [markdown]
# What the matrix costs is a question for the compiler. Compile the tiny model twice, with
# diffusers' processor and with the vector handed to splash (interpret mode here, the same kernel
# a TPU compiles), and look for a boolean `(2, 1, S, S)` tensor in the optimized HLO text:

# %%
import re


def mask_tensors(module):
    fm = torchax_utils.FunctionalModule(module, family.static_forward, return_dict=False)
    step = jax.jit(lambda w, b, *a: fm(w, b, a[0], a[1], a[2], a[3], None, *a[4:])[0])
    hlo = step.lower(*fm.state(), *inputs, *extra).compile().as_text()
    return sorted(set(re.findall(rf"pred\[2,1,{tokens},{tokens}\]", hlo)))


splash_padded = jax.jit(functools.partial(attention.padded_attention, backend="splash", interpret=True))
family.make_jit_friendly(transformer, lambda q, k, v, valid: call_jax(splash_padded, q, k, v, valid))
matrix_version = load_transformer()
with env:
    matrix_version.to("jax")
with torchax_utils.restoring_ops(env):
    torchax_utils.install_masked_row_safe_sdpa(env)
    in_stock, in_ours = mask_tensors(matrix_version), mask_tensors(transformer)
print("diffusers' processor:", in_stock or "none", "| vector + splash:", in_ours or "none")

# %% tags=["check"]
assert in_stock and not in_ours

# %% [markdown]
# This section's transformers are not used again. They go now, with section 2's error, whose
# traceback holds the model it was raised with:

# %%
import gc

del stock_transformer, transformer, matrix_version, static_fm, error
_ = gc.collect()

# %% [markdown]
# At full size the same comparison comes from an ahead-of-time compile for a `v6e:2x4` slice
# (notebook `plan_without_tpu`'s dry-run; `--mask matrix` keeps diffusers' processor, `--mask vector` is the
# pipeline's). One block is compiled at 720p and 121 frames, the other 53 blocks' weights are
# added from their shapes. The tiny preset reads the recorded compiles.

# %%
from pathlib import Path

from tpupedia import dryrun


def hunyuan_plan(sharding="tp", mesh=(2, 4), mask="vector", layers=54):
    """The full-size step's dry-run for a v6e-8: compiled on the full preset (minutes to tens of
    minutes on a CPU host), read from the recorded ones on tiny."""
    return dryrun.compiled_or_recorded(preset.compile_full_size, "hunyuan", "v6e:2x4", "720p", 121, sharding=sharding,
                                       mesh_shape=mesh, mask=mask, layers=layers,
                                       records=Path("..") / dryrun.DEFAULT_RECORDS)


GiB = 2**30
masks = {m: hunyuan_plan(mask=m, layers=1) for m in ("matrix", "vector")}
print(f"{'text mask':>10} {'arguments':>10} {'temporaries':>12}  (GiB per chip, 720p, 121 frames, 1 block compiled)")
for m, r in masks.items():
    print(f"{m:>10} {r['arguments_bytes'] / GiB:>10.2f} {r['temporaries_bytes'] / GiB:>12.2f}")
materialized = family.mask_elements(1280, 720, 121) / GiB  # one byte per boolean, one sample per chip on dp=2
print(f"the matrix itself, had it been stored: {materialized:.1f} GiB per chip")

# %% [markdown]
# The same memory, to the byte's neighbourhood. On this stack the TPU compiler never stores the
# matrix: the splash override of notebook `splash_attention` reduces it straight back to the two validity
# vectors, and XLA fuses the broadcast-and-compare into those reductions. So the vector is not
# a memory rescue here; it is a guarantee. Correctness and memory no longer depend on a fusion
# decision, no shape-checking branch is compiled, and the reference path (GPUs, and CPUs for
# checks) receives a vector it can broadcast lazily instead of a 13 G-element tensor built by
# `repeat`. What costs memory on the reference path is the `(B, H, S, S)` score matrix itself,
# which is why notebook `splash_attention`'s kernel exists.

# %%
temps = {m: r["temporaries_bytes"] for m, r in masks.items()}
assert abs(temps["matrix"] - temps["vector"]) <= 0.05 * temps["vector"]
assert materialized > 5 * temps["vector"] / GiB  # storing the matrix would have dominated the step

# %% [markdown]
# ## 4. Stage 1: two text encoders
#
# diffusers wraps the prompt in a chat template with a long system message, runs Qwen2.5-VL's
# text model over 1108 tokens, keeps the **third hidden state from the end** and crops the
# template's first 108 tokens, leaving 1000. The stage compiles that whole selection: the jitted
# function returns one `(1, 1000, width)` array, not the tuple of every layer's hidden states.
# The ByT5 glyph encoder runs only if the prompt quotes text (`"OPEN"` here); otherwise its slot is
# zeros with an all-false mask, as in diffusers. The settings it used are read from diffusers'
# own signature, not copied:

# %%
from tpupedia import devices

mesh = devices.make_mesh(pipeline.common.default_mesh_shape(jax.device_count()), ("dp", "tp"))
# section 7 compares these stages with stock diffusers: full fp32 matmuls on a TPU too
pipe = pipeline.Hunyuan(source, label, dtype, mesh, pipeline.Options(quiet=True, matmul_precision="highest"))
resolved = pipeline.resolve(request, pipe.configs)
text_defaults = pipeline.prompt_defaults()
print({k: v for k, v in text_defaults.items() if k != "system_message"})
print(f"guidance {resolved.guidance} and shift {resolved.shift}, from the checkpoint's guider and scheduler")
embeds, text_timings = pipe.encode_text(request)
for name, value in embeds.items():
    print(f"{name:30} {tuple(value.shape)} {value.dtype}")

# %% [markdown]
# How long is the prompt? Two counts disagree, and the difference is worth a minute. Every row
# of `prompt_embeds` is non-zero: Qwen computes a hidden state at every position, padding
# included, and nothing zeroes those rows. The mask is what says which rows count. And it counts
# far more tokens than the sentence has, because the sentence is not encoded alone: diffusers
# puts it in a chat template after a long system message (a description of what a good video
# caption contains), and of that whole text crops only the template's first 108 tokens. Count
# each piece with the checkpoint's tokenizer. (The tiny checkpoint's is byte-level, one token
# per character, so its counts are several times those of Qwen's real 151k-token vocabulary;
# the full preset prints the real ones. The structure is the same.)

# %%
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
from transformers import AutoTokenizer

qwen_tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer")
chat = qwen_tokenizer.apply_chat_template(format_text_input([request.prompt], text_defaults["system_message"]),
                                          add_generation_prompt=True, tokenize=True, return_dict=True)
templated = len(chat["input_ids"][0])
sentence = len(qwen_tokenizer(request.prompt)["input_ids"])
valid = int(embeds["prompt_embeds_mask"].sum())
print(f"the sentence alone: {sentence} tokens; with the system message and template: {templated}")
print(f"after the {text_defaults['crop_start']}-token crop: {templated - text_defaults['crop_start']} valid "
      f"(the mask counts {valid}), padded to {text_defaults['tokenizer_max_length']}")
print(f"non-zero rows of prompt_embeds: {int(embeds['prompt_embeds'].ne(0).any(-1).sum())} of "
      f"{embeds['prompt_embeds'].shape[1]}; ByT5's glyph slot: {int(embeds['prompt_embeds_mask_2'].sum())} valid "
      f"tokens for the quoted text, none for the negative prompt")

# %% tags=["check"]
assert templated - text_defaults["crop_start"] == valid < text_defaults["tokenizer_max_length"]
assert sentence < valid  # the system message, not the sentence, fills the slot
assert int(embeds["prompt_embeds"].ne(0).any(-1).sum()) == embeds["prompt_embeds"].shape[1]  # padding rows too

# %% [markdown]
# So the transformer's text slot holds 1000 positions of which a few hundred are real, and it
# must be told which (section 3's validity vector); the next section's step uses the same
# count to leave most of the padding out.

# %% [markdown]
# The same tensors as diffusers' `encode_prompt` on PyTorch, one forward of each encoder, which
# the host CPU runs at full size too. Qwen's hidden states have a few channels far larger than
# the rest, so in bfloat16 (full) the bound is section 3's relative one; in float32 (tiny) it is
# absolute:

# %%
from diffusers import HunyuanVideo15Pipeline

stock = HunyuanVideo15Pipeline.from_pretrained(source, dtype=dtype, use_safetensors=True)
stock.set_progress_bar_config(disable=True)
with torch.no_grad():
    theirs = dict(zip(("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"),
                      stock.encode_prompt(request.prompt, device="cpu", dtype=dtype)))
if dtype == torch.float32:  # tiny: equal to float32 rounding
    text_error, text_bound = max(float((embeds[k] - v).abs().max()) for k, v in theirs.items()), 1e-5
    print("max abs difference from diffusers over the 4 positive-prompt tensors:",
          results.error_text(text_error, text_bound))
else:  # full, bfloat16: relative to each tensor's largest value
    text_error, text_bound = max(relative(embeds[k], v) for k, v in theirs.items()), llm.BF16_RELATIVE_BOUND
    print(f"max abs difference from diffusers over the largest |value|, worst of the 4 positive-prompt tensors: "
          f"{text_error:.1e} (bound {text_bound:.1e})")

# %% tags=["check"]
assert pipe.traces["text"] == 1  # prompt and negative prompt share one program
assert embeds["prompt_embeds_mask_2"].sum() > 0 and embeds["negative_prompt_embeds_mask_2"].sum() == 0
assert text_error <= text_bound

# %% [markdown]
# ## 5. Flow matching as a pure step
#
# HunyuanVideo-1.5 is trained with flow matching: the model predicts a velocity `v`, and a step
# moves the latents along it, `x <- x + (sigma_next - sigma) * v` (Euler). The pipeline spaces
# sigmas evenly from 1 towards 0 and the scheduler *shifts* them towards the noisy end,
# `sigma' = s * sigma / (1 + (s - 1) * sigma)`, so more of the steps are spent where the video's
# layout forms; timesteps are `1000 * sigma'`. The stock `FlowMatchEulerDiscreteScheduler.step`
# finds its index with `.nonzero().item()` and keeps it as Python state, which `jax.jit` cannot
# trace; every number it needs is known on the host, so `schedulers.flow_match_tables` stacks
# them (from the stock scheduler's own `set_timesteps`) and `flow_match_euler_step` indexes
# them with the traced step.

# %%
from diffusers import FlowMatchEulerDiscreteScheduler

from tpupedia.pipelines import schedulers

steps = 8
print(f"{'shift':>5}  sigmas over {steps} steps")
for shift in (1.0, 3.0, resolved.shift):
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler", shift=shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    print(f"{shift:>5}  " + " ".join(f"{s:.3f}" for s in sched.sigmas.tolist()))

# %%
sigma = np.linspace(1.0, 0.0, steps + 1)[:-1]
expected_sigmas = resolved.shift * sigma / (1 + (resolved.shift - 1) * sigma)
assert np.allclose(sched.sigmas[:-1].numpy(), expected_sigmas, atol=1e-6)

# %% [markdown]
# Over the release's 50 steps the shift's effect is easier to see than to read. With shift 1
# the noise level falls evenly; with the checkpoint's shift the first half of the steps stays
# above sigma 0.8, where the layout forms, and the detail is left to the last few steps. The
# same stock scheduler, asked for each shift:

# %%
import matplotlib.pyplot as plt

shift_curves = {}
for shift in (1.0, 3.0, resolved.shift, 13.0):
    curve = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler", shift=shift)
    curve.set_timesteps(sigmas=np.linspace(1.0, 0.0, 51)[:-1])
    shift_curves[shift] = curve.sigmas[:-1].numpy()
fig, ax = plt.subplots(figsize=(6.5, 2.8))
for shift, sigmas in shift_curves.items():
    ax.plot(sigmas, label=f"shift {shift:g}" + (" (this checkpoint)" if shift == resolved.shift else ""))
ax.set_xlabel("step")
ax.set_ylabel("sigma (noise level)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
half = {shift: float(sigmas[25]) for shift, sigmas in shift_curves.items()}
assert abs(half[1.0] - 0.5) < 1e-6 and half[resolved.shift] > 0.8  # halfway: even spacing; most steps kept noisy
assert all(np.all(np.diff(sigmas) < 0) for sigmas in shift_curves.values())

# %% [markdown]
# Against the stock step on the same velocities, in float32 and bfloat16. The stock step adds
# `dt * v` (in the velocity's dtype) to the latents in float32 and casts back; the pure step
# does the same operations, but under `jax.jit` XLA fuses the multiply and the add into one
# multiply-add, rounded once instead of twice. So each step may differ by one unit in the last
# place of its dtype (2^-23 relative in float32, 2^-7 in bfloat16), never more:

# %%
import jax.numpy as jnp

tables = {k: jnp.asarray(v) for k, v in schedulers.flow_match_tables(sched).items()}
pure = jax.jit(lambda i, x, v: schedulers.flow_match_euler_step(tables, i, x, v))
ulps = {}
for dt, eps in ((torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-7)):
    gen = torch.Generator().manual_seed(1)
    x_stock = torch.randn(1, 4, 3, 4, 4, generator=gen).to(dt)
    worst = 0.0
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(1, 4, 3, 4, 4, generator=gen).to(dt)
        x_next = sched.step(v, t, x_stock, return_dict=False)[0]
        ours = pure(jnp.int32(i), *(jnp.asarray(a.float().numpy()).astype(jnp.dtype(str(dt)[6:])) for a in (x_stock, v)))
        scale = (x_stock.float().abs() + abs(float(tables["dt"][i])) * v.float().abs()).numpy()
        worst = max(worst, float((np.abs(np.asarray(ours.astype(jnp.float32)) - x_next.float().numpy()) / (eps * scale)).max()))
        x_stock = x_next
    ulps[str(dt)[6:]] = worst
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])  # `step` advanced its index: reset
print("largest difference from the stock step, in units of the last place:",
      {k: results.measured_text(v, 1.0, fmt=".2f") for k, v in ulps.items()})

# %% tags=["check"]
assert all(u <= 1.0 for u in ulps.values())
assert pure._cache_size() == 2  # one program per dtype, whatever the step

# %% [markdown]
# ### Exercise 2: one flow-matching step by hand
#
# The first of the 8 steps above moves from sigma 1 to the next of `np.linspace(1, 0, 9)`, both
# shifted with the checkpoint's shift (`resolved.shift`). **Predict** first: the first step's
# `dt` from the shift formula alone, and how close `x + dt * v`, written as one jitted line, comes
# to the stock scheduler's step on the same float32 `x` and `v`. Then open the solution, run it,
# and compare with the tables' `dt` and the stock step.

# %% tags=["solution"]
def shifted(sigma, s):  # the scheduler's shift, as above
    return s * sigma / (1 + (s - 1) * sigma)


by_hand_dt = shifted(1 - 1 / steps, resolved.shift) - shifted(1.0, resolved.shift)
gen = torch.Generator().manual_seed(2)
x0, v0 = torch.randn(1, 4, 3, 4, 4, generator=gen), torch.randn(1, 4, 3, 4, 4, generator=gen)
x1_stock = sched.step(v0, sched.timesteps[0], x0, return_dict=False)[0]
sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])  # `step` advanced its index: reset
x1_hand = jax.jit(lambda x, v: x + jnp.float32(by_hand_dt) * v)(x0.numpy(), v0.numpy())
hand_error = float(np.abs(np.asarray(x1_hand) - x1_stock.numpy()).max())
print(f"first step's dt: by hand {by_hand_dt:.6f}, the tables' {float(tables['dt'][0]):.6f}")
print("one Euler step by hand against the stock scheduler:", results.error_text(hand_error, 1e-6))

# %% tags=["check"]
assert by_hand_dt < 0 and abs(by_hand_dt - float(tables["dt"][0])) < 1e-6  # sigma falls: dt is negative
assert hand_error <= 1e-6  # float32 rounding, at most an ulp or two of values near 1

# %% [markdown]
# ## 6. Stage 2: the denoising step, written out
#
# One compiled step for all steps, as in notebook `cogvideox_pipeline`, with what this model changes:
#
# 1. the transformer's input is the latents with 33 more channels, the picture's latents and a
#    mask, which are zeros for text-to-video (diffusers' `prepare_cond_latents_and_mask`);
# 2. the guidance pair (negative, positive prompt) is **one batch of 2** on the `dp` axis, where
#    diffusers' guider runs two batch-1 forwards;
# 3. the timestep is cast to the latents' dtype before the model sees it, as diffusers casts it
#    (in bfloat16, 937.5 becomes 936);
# 4. the transformer over `tp`, with section 3's exact padded attention;
# 5. guidance `uncond + g * (cond - uncond)`, then section 5's pure Euler step, the latents
#    donated.
#
# The conditioning slots (Qwen's 1000, ByT5's 256 and the image slot's tokens) are put valid
# tokens first and cut after the most valid tokens of the pair, rounded up to 128
# (`family.kept_text_tokens`). What is cut is padding, which every query masks out anyway, so
# the video does not change, and on this tiny model most of a step's work goes with it.
#
# First the transformer, placed as notebook `cogvideox_pipeline` placed CogVideoX's: each chip receives only its
# shards of the family's `tp` table, and `family.make_jit_friendly` installs section 2's traceable
# forward with section 3's attention.

# %%
from tpupedia import sharding
from tpupedia.pipelines import common

backend = common.attention_backend("auto", mesh)  # splash on a TPU, the reference elsewhere
step_transformer = HunyuanVideo15Transformer3DModel.from_pretrained(source, subfolder="transformer", dtype=dtype,
                                                                    use_safetensors=True).eval()
family.make_jit_friendly(step_transformer, attention.padded_attend(
    backend, mesh=mesh, interpret=not common.on_tpu(mesh), block_sizes=pipe.block_sizes))
placement = sharding.place(step_transformer, sharding.rules(family.SPEC, "tp", axis="tp"), mesh, env)
forward = torchax_utils.FunctionalModule(step_transformer, return_dict=False)
weights, buffers = forward.state()
step_blocks = step_transformer.config.num_layers  # all of them, on both presets
print(f"{step_blocks} blocks, {len(weights)} weight tensors on the mesh, "
      f"{placement.bytes_per_device / 2**20:.1f} MiB per device")

# %% [markdown]
# Then what the host prepares. The initial latents come from `torch.Generator(seed)` through
# diffusers' own `randn_tensor`, so the same seed starts from the same noise as the stock
# pipeline. The schedule is section 5's tables at the request's step count and the checkpoint's
# shift. The text is the guidance pair, negative first, with the kept token count. This
# checkpoint's guider guides every step with the plain formula (its `start`, `stop` and
# `use_original_formulation` are the defaults), which the step below assumes and the assert
# checks.

# %%
from diffusers.utils.torch_utils import randn_tensor

guider = pipe.configs["guider"]
assert (guider.get("start", 0.0), guider.get("stop", 1.0), guider.get("use_original_formulation", False)) == (0.0, 1.0, False)
step_scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(source, subfolder="scheduler", shift=resolved.shift)
step_scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, resolved.steps + 1)[:-1])
step_tables = {k: jnp.asarray(v) for k, v in schedulers.flow_match_tables(step_scheduler).items()}
latent_shape = family.latent_shape(request.frames, request.height, request.width, pipe.shapes)
start = randn_tensor(latent_shape, generator=torch.Generator().manual_seed(request.seed), dtype=dtype)
text_keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
text_pair = [torch.cat([embeds[f"negative_{k}"], embeds[k]]) for k in text_keys]
slots = family.slot_tokens(pipe.configs)
valid_pair = [int(embeds[f"{p}prompt_embeds_mask"].sum() + embeds[f"{p}prompt_embeds_mask_2"].sum())
              for p in ("negative_", "")]
kept = family.kept_text_tokens(valid_pair, slots)
no_picture = torch.zeros(2, family.image_tokens(pipe.configs), t_cfg.image_embed_dim, dtype=dtype)
print("latents", latent_shape, "| text pair", tuple(text_pair[0].shape), "+", tuple(text_pair[2].shape),
      f"| conditioning tokens kept: {kept} of {slots} (valid: {valid_pair[0]} negative, {valid_pair[1]} positive)")

# %% [markdown]
# The step. `i` and `guidance` are traced, so one program serves every step; the latents come
# back with the sharding they came in with and are donated.

# %%
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pair = NamedSharding(mesh, P("dp"))  # the guidance pair: one half per dp group
replicated = NamedSharding(mesh, P())


def denoise_step(weights, buffers, latents, text, no_picture, i, guidance):
    condition = jnp.zeros((1, latents.shape[1] + 1, *latents.shape[2:]), latents.dtype)  # 1. no picture
    single = jnp.concatenate([latents, condition], axis=1)
    both = jax.lax.with_sharding_constraint(jnp.concatenate([single, single]), pair)  # 2. the pair, over dp
    t_model = jnp.broadcast_to(step_tables["timesteps"][i].astype(latents.dtype), (2,))  # 3.
    v = forward(weights, buffers, both, t_model, text[0], text[1], None, text[2], text[3], no_picture,
                text_tokens=kept)[0]  # 4. the transformer, over tp
    uncond, cond = v[:1], v[1:]
    v = (uncond.astype(jnp.float32) + guidance * (cond - uncond).astype(jnp.float32)).astype(v.dtype)  # 5.
    return schedulers.flow_match_euler_step(step_tables, i, latents, v)


step = jax.jit(denoise_step, donate_argnums=(2,), out_shardings=replicated)

# %% [markdown]
# The loop, under the attention the pipeline installs and the precision section 4 asked for:

# %%
step_latents = jax.device_put(common.to_jax_array(start), replicated)
text_on_mesh = [jax.device_put(common.to_jax_array(t), pair) for t in text_pair]
picture_slot = jax.device_put(common.to_jax_array(no_picture), pair)
with common.attention_installed(env, mesh, backend, pipe.block_sizes), jax.default_matmul_precision("highest"):
    step_hlo = step.lower(weights, buffers, step_latents, text_on_mesh, picture_slot, np.int32(0),
                          np.float32(resolved.guidance)).compile().as_text()  # kept for the collectives below
    for i in range(resolved.steps):
        step_latents = step(weights, buffers, step_latents, text_on_mesh, picture_slot, np.int32(i),
                            np.float32(resolved.guidance))
ours = common.to_torch(step_latents).to(dtype)
print("latents", tuple(ours.shape), ours.dtype, "| compiled", step._cache_size(), "program(s) for", resolved.steps, "steps")

# %% [markdown]
# The pipeline module runs the same step (`pipeline.Hunyuan.denoise`, which also loads and frees
# the transformer, handles image-to-video, DeepCache and the step-distilled releases, and times
# each call). Our copy goes first, so the chips hold one at a time; then the module's result
# against ours, bit for bit:

# %%
del step_transformer, weights, buffers, step_latents, text_on_mesh, picture_slot
forward = None  # the last reference to our copy's weights
latents, denoise_timings = pipe.denoise(request, embeds)
print("module:", tuple(latents["latents"].shape), "| traced", pipe.traces["denoise"], "time(s) for", request.steps,
      f"steps | {denoise_timings['text_tokens']} conditioning tokens | equal to the step written here:",
      torch.equal(latents["latents"], ours))

# %% [markdown]
# What the `tp` split costs. Each row-parallel layer leaves partial sums that an **all-reduce**
# over `tp` adds up, as in notebook `cogvideox_pipeline`'s step. A dual-stream block has four such layers (each
# stream's attention output and second MLP layer), and the text refiner and the glyph embedder
# have their own. The placement lists them; the compiled step has at least one all-reduce for
# each, and the other collectives the compiler chose to move activations between layouts:

# %%
from collections import Counter

from tpupedia import aot

row_parallel = [p.name for p in placement.placements if p.spec == P(None, "tp")]
collectives = aot.collective_ops(step_hlo, jax.device_count())
kinds = Counter(op.kind for op in collectives)
in_blocks = sum(name.startswith("transformer_blocks.") for name in row_parallel)
print(f"row-parallel layers: {len(row_parallel)} ({in_blocks} in the {step_blocks} blocks, "
      f"{len(row_parallel) - in_blocks} in the text refiner and glyph embedder)")
print("collectives in the compiled step:", dict(kinds))
print(f"all-reduce bytes sent per chip per step: "
      f"{sum(op.bytes_sent for op in collectives if op.kind == 'all-reduce') / 2**10:.1f} KiB")

# %% [markdown]
# Where the module put the first block's weights (Megatron tensor parallelism, notebook `sharding`: q/k/v and the
# first MLP layer split by output rows, the attention output and second MLP layer by input
# columns):

# %%
from IPython.display import Markdown

plan = pipe.plans["transformer"]
Markdown(plan.table(r"^transformer_blocks\.0\.(attn\.(to_q|to_out\.0)|ff\.net\.(0\.proj|2))\.weight$"))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"text    first {text_timings['first_s']:.2f} s")
print(f"denoise first {denoise_timings['first_s']:.2f} s, steady {denoise_timings['steady_s'] * 1e3:.0f} ms/step")

# %% tags=["check"]
# one compiled step serves every step, keeps the rounded conditioning tokens, and equals the module's
assert step._cache_size() == 1 and pipe.traces["denoise"] == 1  # one program for every step
assert denoise_timings["text_tokens"] == kept and max(valid_pair) <= kept < slots
assert torch.equal(latents["latents"], ours)
# the tp split: four row-parallel layers per block, at least one all-reduce for each such layer
assert in_blocks == 4 * step_blocks
assert kinds["all-reduce"] >= len(row_parallel)
# Megatron's placement: q by output rows, the second MLP layer by input columns
assert plan["transformer_blocks.0.attn.to_q.weight"].spec == jax.sharding.PartitionSpec("tp", None)
assert plan["transformer_blocks.0.ff.net.2.weight"].spec == jax.sharding.PartitionSpec(None, "tp")

# %% [markdown]
# ### Exercise 3: predict how many conditioning tokens a step keeps
#
# The step keeps the conditioning tokens up to the most valid tokens of the guidance pair, rounded
# up to 128 (`family.kept_text_tokens`), out of the 1,985 slots. **Predict** first how many it
# keeps when the negative and positive prompts have 37 and 12 valid tokens, 120 and 300, 0 and
# 129, and when every slot is valid. Why is the count rounded at all, rather than kept exact?
# Then open the solution, run it, and compare.

# %% tags=["solution"]
pairs = {"37 and 12 valid": [37, 12], "120 and 300 valid": [120, 300], "0 and 129 valid": [0, 129],
         "every slot valid": [slots, slots]}
kept_for = {name: family.kept_text_tokens(counts, slots) for name, counts in pairs.items()}
for name, n in kept_for.items():
    print(f"{name:>18}: {n} of {slots} conditioning tokens kept")
print("this notebook's prompt pair:", valid_pair, "->", kept)
print("rounded, not exact: one compiled step serves every prompt pair whose count rounds to the same length")

# %% tags=["check"]
# rounded so that one compiled step serves every prompt whose count rounds to the same length
assert kept_for == {"37 and 12 valid": 128, "120 and 300 valid": 384, "0 and 129 valid": 256,
                    "every slot valid": slots}
assert kept == family.kept_text_tokens(valid_pair, slots) and (kept % 128 == 0 or kept == slots)

# %% [markdown]
# ## 7. Stage 3: decode, and parity with stock diffusers
#
# The VAE runs under torchax with its decoder jitted (with `vae_tiling`, each 256-pixel tile is
# one call of that program, which is how 720p fits a chip; the end of this section shares the
# tiles between chips). Frames come out as diffusers' `output_type="np"`: float32
# `(frames, height, width, 3)` in [0, 1].
#
# What to look for in the strip below (five frames spread over the video). On the tiny preset
# the weights are random, so every frame is noise, coloured static with nothing of the prompt in
# it. Read the strip for its count and size (the title gives both: the request's frames at its
# width and height), and the next cell for what makes it right: the frames equal stock
# diffusers' frames from the same checkpoint, prompt and seed. On the full preset the strip
# shows the prompt's video.

# %%
from tpupedia import video

decoded, decode_timings = pipe.decode(request, latents["latents"])
frames = decoded["frames"].numpy()
video.show_frames(frames, f"{label}: {request.frames} frames at {request.width}x{request.height}")

# %% [markdown]
# The stock `HunyuanVideo15Pipeline`, eager PyTorch, same checkpoint, prompt and seed. On the
# full preset the whole video is out of the host's reach: 50 steps at 720p and 121 frames are
# about 6e17 FLOPs (`family.step_flops`), and each block's `(B, 1, S, S)` mask over 113,585
# tokens alone is 12.9 G elements (section 1). There both pipelines take one step at 9 frames
# and 256x256 from our stage-1 embeddings and the same seed, without guidance (as in notebook
# 07: guidance would multiply the difference by up to `2g - 1`), and the latents are compared
# with section 3's bfloat16 measure.

# %%
import dataclasses

if preset.host_runs_whole_models:  # tiny: the whole video, seconds on the host CPU
    with torch.no_grad():
        expected = stock(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.frames,
                         height=request.height, width=request.width, num_inference_steps=request.steps,
                         generator=torch.Generator().manual_seed(request.seed), output_type="np").frames[0]
    video_error = float(np.abs(frames - expected).max())
    print("frames: max abs difference from stock diffusers",
          results.error_text(video_error, 1e-4), "(one 8-bit level is 1/255)")
else:  # full: one denoising step at 9 frames, 256x256, without guidance
    one_step = dataclasses.replace(request, frames=9, height=256, width=256, steps=1, guidance=1.0)
    ours = pipe.denoise(one_step, embeds)[0]["latents"]
    stock.guider = stock.guider.new(guidance_scale=1.0)  # diffusers' guider then runs one forward
    positive = {k: v for k, v in embeds.items() if not k.startswith("negative_")}
    with torch.no_grad():
        theirs = stock(**positive, num_frames=one_step.frames, height=one_step.height, width=one_step.width,
                       num_inference_steps=1, generator=torch.Generator().manual_seed(one_step.seed),
                       output_type="latent").frames
    step_error = relative(ours, theirs)
    print(f"one step at {one_step.width}x{one_step.height}, {one_step.frames} frames "
          f"({family.step_flops(one_step.width, one_step.height, one_step.frames)['total']:.1e} FLOPs): latents' "
          f"max abs difference from stock diffusers over its largest |value|: {step_error:.1e} "
          f"(bound {llm.BF16_RELATIVE_BOUND:.1e})")

# %% tags=["check"]
if preset.host_runs_whole_models:
    assert frames.shape == expected.shape == (request.frames, request.height, request.width, 3)
    assert video_error <= 1e-4
else:
    assert ours.shape == theirs.shape
    assert step_error <= llm.BF16_RELATIVE_BOUND
assert frames.std() > 0.01  # not a constant image that would match anything

# %% [markdown]
# ### Eight chips share the decode
#
# This decoder takes all latent frames in one call, and its causal convolutions run in time
# order, so time cannot be split between chips. Space can. At 720p and 121 frames the untiled
# decoder's last stage alone is a 121 x 720 x 1280 x 128 bfloat16 tensor, 28.5 GB, on one
# 31.25 GiB chip: 720p decodes in 256-pixel tiles, and the plan (notebook `plan_without_tpu`) turns tiling on
# when the untiled decode does not fit. diffusers decodes the tiles one after another, so one
# chip works while seven wait. The tiles are independent until they are blended, so the
# pipeline decodes the tiles of one shape side by side, one per chip
# (`tpupedia.pipelines.hunyuan.through_tiles`): it runs diffusers' own `decode` with a
# decoder that only records the tiles it is handed, decodes them in waves, then runs
# diffusers' `decode` again with a decoder that hands the results back in order, so the
# cutting, blending and cropping stay stock code and the frames stay diffusers' tiled frames.
#
# The tiles of the release's 720p decode, read from diffusers' tiling on PyTorch's `meta`
# device (nothing is computed): decoder calls on one chip, and waves on this host's chips.

# %%
from tpupedia.pipelines import decoding

latent_frames = family.latent_shape(121, 720, 1280)[2]
host_chips = decoding.decode_mesh(pipe.mesh)
one_chip = devices.make_mesh((1,), (decoding.AXIS,), devices=list(host_chips.devices.flat)[:1])
release_vae = family.full_configs()["vae"]
alone = pipeline.decode_programs(release_vae, latent_frames, 720, 1280, one_chip, tiling=True)
shared = pipeline.decode_programs(release_vae, latent_frames, 720, 1280, host_chips, tiling=True)
for program in shared:
    print(program.name)
print(f"720p, 121 frames: {sum(p.calls for p in alone)} tile decodes one after another on one chip, "
      f"{sum(p.calls for p in shared)} waves on {host_chips.size} chips")

# %% [markdown]
# Decoding a batch of tiles met a bug in diffusers 0.42.1: the mid-block attention's mask is
# `(batch, S, S)`, the scores `(batch, 1, S, S)`, and broadcasting gives
# `(batch, batch, S, S)`, so a batch of two fails to reshape (diffusers' VAE only ever decodes
# one sample at a time). The loop-free mask of section 3 (`family.vae_attention_mask`) keeps the
# head axis, and `tests/test_hunyuan.py` checks that a batch decodes each sample as alone.

# %% tags=["check"]
assert sum(p.calls for p in alone) == 28 and sum(p.calls for p in shared) < sum(p.calls for p in alone)
assert all(p.args[-1].shape[0] == host_chips.size for p in shared)  # one tile per chip in every call

# %% [markdown]
# The stock pipeline is not needed again; on the full preset it holds about 33 GB of host memory
# (the header's parameter counts):

# %%
del stock
_ = gc.collect()

# %% [markdown]
# `tpupedia generate hunyuan` runs these three stages with the stage files of notebook `cogvideox_pipeline`
# (atomic writes, fingerprints, resume, refusal of a file made for another request):
#
# ```
# tpupedia generate hunyuan --preset tiny --prompt "a fox in the snow" --out fox.mp4
# tpupedia generate hunyuan --preset full --prompt "..." --vae-tiling --out video.mp4
# ```

# %% [markdown]
# ## Takeaways
#
# - A forward that `jax.jit` cannot trace is made traceable by replacing its data-dependent steps
#   (a Python `if` on a tensor, boolean indexing) with fixed-shape ones that give the same numbers
#   (section 2).
# - A padding mask is the `(B, S)` validity vector, never an S x S matrix, and a row with no
#   visible key gives 0, not NaN; the TPU compiler happened not to store the matrix anyway, the
#   vector makes that a guarantee (section 3).
# - Two text encoders are two compiled programs at their own token lengths; the second runs only
#   when the prompt quotes text (section 4).
# - The sampler is a pure function of the step index, its tables computed on the host once
#   (section 5); the step it drives is written out and its collectives counted (section 6).
# - The three stages match stock diffusers within stated tolerances, and the decode spreads its
#   tiles over the host's chips (section 7).

# %% [markdown]
# ## Further reading
#
# - [HunyuanVideo-1.5 on TPU](../kb/hunyuan-video.md): this notebook's model, its checkpoints and
#   upstream's TPU runs in one page.
# - [Flow-matching schedulers](../kb/flow-matching.md): section 5's sampler and its shift.
# - [Splash attention](../kb/splash-attention.md): the kernel behind section 3's padded attention.
# - Next: notebook `hunyuan_tuning_and_i2v`, DeepCache, the sharding tables on a v6e-8 and
#   image-to-video on this pipeline.

# %% [markdown]
# ## Self-check
#
# 1. The stock forward fails under `jax.jit` on `if torch.all(image_embeds == 0)`. Why does
#    replacing it with `torch.where` fix the trace without changing the numbers?
#
#    <details><summary>Answer</summary>
#
#    A Python `if` needs a concrete boolean, and under tracing the tensor has none. `torch.where`
#    computes both values and selects one inside the program, so the shape and the ops are fixed;
#    it returns what the `if` would have chosen, so `static_forward` is the stock forward bit for bit.
#
#    </details>
#
# 2. Why does a naive softmax over diffusers' pairwise mask put NaN in every token's output, not
#    only in the padded ones?
#
#    <details><summary>Answer</summary>
#
#    A padded token's row sees no key, and a softmax over a row of `-inf` is `0 / 0`, NaN. The next
#    block multiplies padded tokens by their zero mask, `0 * NaN` is NaN, and attention's weighted
#    sum carries it into every token.
#
#    </details>
#
# 3. The TPU compiler did not store the `(B, 1, S, S)` mask even with diffusers' processor. What
#    does passing the `(B, S)` vector still buy?
#
#    <details><summary>Answer</summary>
#
#    A guarantee: correctness and memory no longer depend on a fusion decision, and the reference
#    path (GPUs, CPU checks) gets a vector it can broadcast lazily instead of a 13 G-element tensor.
#    Splash takes the vector directly as segment ids.
#
#    </details>
#
# 4. Why can the flow-matching step be one compiled program for all steps when the stock
#    scheduler keeps its index as Python state?
#
#    <details><summary>Answer</summary>
#
#    Every number the step needs (sigmas, timesteps, `dt`) is known on the host before the loop, so
#    `flow_match_tables` stacks them and the pure step indexes them with the traced step number `i`.
#    Only the index changes from step to step, and it is an argument, not a constant.
#
#    </details>
#
# 5. Cutting the conditioning tokens after the most valid ones changes the sequence length. Why
#    does the video stay the same?
#
#    <details><summary>Answer</summary>
#
#    The tokens are ordered valid-first, so what is cut is padding, and every query masks padding
#    out; the output reads only video tokens. The result changes at most by the order in which a
#    softmax's sum is added, and section 7's frames, against a stock pipeline that keeps all 1,985
#    slots, stay within float32 rounding.
#
#    </details>
