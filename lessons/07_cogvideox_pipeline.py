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
# # 07 · CogVideoX text-to-video in three stages
#
# Everything so far was a part: a model under torchax (01), a mesh (02), the pitfalls (03), a
# frame's preprocessing (04), the attention kernel (05), the VAE in Flax (06). This lesson puts
# them together and generates a video. The stock `diffusers.CogVideoXPipeline` is one Python
# loop that calls a text encoder, a transformer 50 times, a scheduler and a VAE, op by op. On a
# TPU we want three compiled programs instead, with a file between each:
#
# | stage | what runs | compiled as | writes |
# |---|---|---|---|
# | `text` | T5 encoder, prompt and negative prompt | one jitted forward | `text.safetensors` |
# | `denoise` | transformer + guidance + scheduler, every step | **one** program for all steps | `denoise.safetensors` |
# | `decode` | the VAE of notebook `cogvideox_vae_flax` | its per-frame-batch body | `decode.safetensors` (frames) |
#
# Stages let you rerun only what changed, run each stage on the machine that suits it, and
# survive a crash: a stage file is written atomically and checked when read.
#
# The notebook first makes a video in one call, the way `tpupedia generate cogvideox` does, and
# then takes that call apart:
#
# 1. the model's facts and rules;
# 2. stage 1, text;
# 3. the scheduler as a pure function, and what its numbers mean;
# 4. stage 2, the denoising step written out here, and the collective it compiles to;
# 5. the in-place write that a compiler got wrong once the step was split;
# 6. stage 3, decode and look at the video;
# 7. parity with stock diffusers;
# 8. the stage-file contract;
# 9. image-to-video, a fourth stage.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | a random 2-layer CogVideoX checkpoint written with `save_pretrained`, 8 simulated devices | about 1 GB of host RAM | about 45 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | `zai-org/CogVideoX1.5-5B`: about 21 GB of bf16 weights (T5-XXL 9.5 GB, transformer 11.2 GB, VAE 0.4 GB, from their parameter counts); on the host CPU too, for section 7's one-step parity check | per chip: T5-XXL 2.2 GiB while encoding (9.5 GB split over `tp`, AOT here); the transformer step at 1360x768, 81 frames, 3.8 GiB of arguments + 1.8 GiB of temporaries (AOT here, the `tp` table on the 2×4 mesh, splash); the VAE decode at 1360x768 split over a host's chips, under 19 GiB per chip (AOT here, 4 chips; about 22 GiB on one) | about 107 s for 50 steps at 720p once compiled (reported upstream, TPU v6e-8), twice over: the opening call and sections 2 to 6 each make the video; Exercise 3 loads the transformer once more and compiles one more step |
#
# The full preset downloads `zai-org/CogVideoX1.5-5B`, released under the **CogVideoX LICENSE**
# (linked from its model card on the Hugging Face Hub; the CogVideoX code is Apache-2.0, the
# weights are not): read it before you run the full preset.
#
# *Reading time: about 40 minutes.*

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
# A request, one call that runs the three stages and writes the mp4, and the video. This is
# what `tpupedia generate cogvideox --prompt ...` does; the preset picks the checkpoint and the
# default size (section 1). The stage files it writes go to a scratch folder, which section 8
# comes back to.

# %%
import tempfile
from pathlib import Path

from tpupedia.models import cogvideox as family
from tpupedia.pipelines import cogvideox as pipeline

scratch = Path(tempfile.mkdtemp(prefix="tpupedia-07-"))
request = pipeline.Request(prompt="A panda, dressed in a small red jacket, plays an acoustic guitar in a bamboo forest.",
                           negative_prompt="blurry, low quality", **family.default_request(preset))
log = []  # one line per stage: what it did
reports = pipeline.run(request, pipeline.Options(quiet=True), preset=preset, workdir=scratch / "run",
                       out=scratch / "first.mp4", log=log.append)

# %% [markdown]
# The video. On the tiny preset the weights are random, so it is noise: there is no panda to
# see. What to see is that one call turned a prompt into a video of the requested length and
# size; section 7 shows these frames equal the frames stock diffusers makes from the same
# checkpoint and seed. (Its bytes depend on the ffmpeg build, so nbval does not compare this
# cell's output.)

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
# Every fact about CogVideoX (its configs, the frame and size rules, latent and token counts,
# the FLOPs of a step) lives in `tpupedia.models.cogvideox`. The pipeline, the planner
# (`tpupedia plan`) and the docs all read it, so a rule is written once. The preset decides the
# default request: seconds on a CPU for `tiny`; for `full`, 81 frames and 50 steps at 1360x768,
# the model authors' text-to-video size for CogVideoX1.5-5B (720p, the size of upstream's
# timings, stays an option).

# %%
request  # the preset's default size, frames, steps, guidance and seed

# %% [markdown]
# The VAE keeps the first frame and compresses the rest 4x in time, so a video has `4n + 1`
# frames and `(F - 1) / 4 + 1` latent frames. CogVideoX 1.5 then packs 2 latent frames into
# each patch (`patch_size_t = 2`); an odd latent count gets one padding latent frame at the
# front, which diffusers drops before decoding. So 81 frames are 21 latent frames, padded to
# 22, which make 11 temporal patches.

# %%
print(f"{'frames':>6} {'latent':>6} {'padded':>6} {'padding':>7} {'tokens at 720p':>15}")
for frames in (9, 49, 81, 85):
    padded, padding = family.padded_latent_frames(frames)
    print(f"{frames:>6} {family.latent_frames(frames):>6} {padded:>6} {padding:>7} "
          f"{family.video_tokens(1280, 720, frames):>15,}")

# %% tags=["check"]
assert family.padded_latent_frames(81) == (22, 1) and family.padded_latent_frames(85) == (22, 0)
assert family.video_tokens(1280, 720, 81) == 11 * 45 * 80 == 39_600

# %% [markdown]
# A count the model cannot produce is refused before anything is loaded, with the rule and
# where it comes from:

# %%
from tpupedia.errors import expect

expect(lambda: pipeline.validate(pipeline.Request(**{**request.__dict__, "frames": 80}), pipeline.Options()),
       family.ModelInputError, max_lines=1)
_ = expect(lambda: pipeline.validate(pipeline.Request(**{**request.__dict__, "width": 1000}), pipeline.Options()),
           family.ModelInputError)

# %% [markdown]
# ### Exercise 1: the same video through CogVideoX 1.0
#
# CogVideoX 1.0 (the 2B release, whose configs the family module builds in:
# `family.full_configs(size="2b")`) has the same VAE, but its transformer has no temporal patch
# (`patch_size_t` is `None`). **Predict** first, for a 49-frame video at 720x480 (that release's
# default) and for both releases: how many latent frames the VAE gives, how many padding frames
# the transformer adds, and how many video tokens one sample puts in the attention. Then open the
# solution, run it, and compare.

# %% tags=["solution"]
v1_facts = family.shape_facts(family.full_configs(size="2b"))  # read from the configs, as in section 2
print("CogVideoX 1.0:", v1_facts)
for name, facts in (("CogVideoX 1.5", family.DEFAULT_SHAPES), ("CogVideoX 1.0", v1_facts)):
    padded, padding = family.padded_latent_frames(49, facts)
    print(f"{name}: {family.latent_frames(49, facts)} latent frames, {padding} padding, "
          f"{family.video_tokens(720, 480, 49, facts):,} video tokens at 720x480")

# %% tags=["check"]
latent_49 = (49 - 1) // v1_facts.temporal + 1  # the VAE's rule, with its ratio read from the configs
grid = (480 // v1_facts.size_multiple) * (720 // v1_facts.size_multiple)  # tokens per temporal position
assert v1_facts.patch_t is None and v1_facts.temporal == family.DEFAULT_SHAPES.temporal
assert family.padded_latent_frames(49, v1_facts) == (latent_49, 0)  # no temporal patch: nothing to pad
assert family.padded_latent_frames(49) == (latent_49 + 1, 1)  # 13 is odd: one padding frame for pairs
assert family.video_tokens(720, 480, 49, v1_facts) == latent_49 * grid
assert family.video_tokens(720, 480, 49) == (latent_49 + 1) // 2 * grid  # about half of 1.0's

# %% [markdown]
# ## 2. The checkpoint, and stage 1: text
#
# Both presets load through the same `from_pretrained(..., use_safetensors=True)`. The tiny
# preset first writes a random CogVideoX 1.5-layout checkpoint with `save_pretrained` (a T5
# encoder, a 2-layer transformer, a 4-level VAE, the 1.5-5B scheduler configuration), so CI runs
# the loading code a TPU VM runs. The component configs are read without touching weights; their
# fingerprints go into every stage file, and the shape facts the pipeline uses (how much the VAE
# compresses, the patch sizes) come from them, as diffusers takes them, not from constants.

# %%
import jax
import torch

from tpupedia import devices

source, label = family.model_source(preset)
dtype = getattr(torch, preset.dtype)
mesh = devices.make_mesh(pipeline.default_mesh_shape(jax.device_count()), ("dp", "tp"))
# section 7 compares these stages with stock diffusers: full fp32 matmuls on a TPU too
pipe = pipeline.CogVideoX(source, label, dtype, mesh, pipeline.Options(quiet=True, matmul_precision="highest"))
t = pipe.configs["transformer"]
print(f"{label}: {t['num_layers']} layers, {t['num_attention_heads']} heads of {t['attention_head_dim']}, "
      f"text length {t['max_text_seq_length']}, scheduler {pipe.configs['scheduler']['_class_name']}")
print("mesh", dict(mesh.shape), "on", jax.device_count(), jax.devices()[0].platform, "devices")
print("shape facts from the configs:", pipe.shapes)
same = ("spatial", "temporal", "patch", "patch_t")  # the tiny model is only narrower (fewer latent channels)
assert all(getattr(pipe.shapes, k) == getattr(family.DEFAULT_SHAPES, k) for k in same)

# %% [markdown]
# The tokenizer is where a first full-size run can fail. CogVideoX's tokenizer folder on the
# Hub is a SentencePiece model, `spiece.model`, with no `tokenizer.json`; transformers 5 can read
# it only with the `sentencepiece` package installed (without it, it falls back to a tiktoken
# reader and raises). So the tiny checkpoint ships the same files, with a SentencePiece model
# trained here in milliseconds (`tpupedia.models.tokenizer_files`), and loads them through the
# same call: a missing package fails in CI, not on the TPU VM.

# %%
from pathlib import Path

from transformers import AutoTokenizer

from tpupedia.models import tokenizer_files

folder = Path(source) / "tokenizer"
print("tokenizer folder:", tokenizer_files.layout(folder) if folder.is_dir() else f"{source} on the Hub")
tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer")
ids = tokenizer(request.prompt).input_ids
print(f"{type(tokenizer).__name__}: {request.prompt!r} -> {len(ids)} ids, last {tokenizer.convert_ids_to_tokens(ids[-1])!r}")
assert type(tokenizer).__name__ == "T5Tokenizer" and ids[-1] == tokenizer.eos_token_id

# %% [markdown]
# Stage 1 tokenizes on the host exactly as diffusers' `_get_t5_prompt_embeds` does (pad to the
# checkpoint's text length, truncate, add the end token) and runs the encoder as one jitted
# function that returns only the embeddings. The negative and the positive prompt have the
# same shape, so the second call reuses the first call's program.

# %%
embeds, text_timings = pipe.encode_text(request)
for name, value in embeds.items():
    print(f"{name:24} {tuple(value.shape)} {value.dtype}")
print("traced", pipe.traces["text"], "time(s) for 2 prompts")

# %% [markdown]
# The same embeddings as diffusers' own `encode_prompt`, on PyTorch. In float32 (tiny) the two
# agree to rounding, so the bound is absolute. In bfloat16 (full) a value keeps 8 significant
# bits, so how far two correct programs drift apart grows with the values themselves, and an
# absolute bound fails wherever a channel is large. There the measure is notebook `hf_model_in_jax`'s: the
# largest difference over the reference's largest value, at most 2^-4 (`llm.BF16_RELATIVE_BOUND`).
# T5 runs once per prompt, so the host CPU computes the reference at full size too.

# %%
from diffusers import CogVideoXPipeline

from tpupedia import llm, results


def relative(got, want):
    """max |got - want| / max |want|, in float32: notebook `hf_model_in_jax`'s bfloat16 measure."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    return float((got - want).abs().max() / want.abs().max())


stock = CogVideoXPipeline.from_pretrained(source, dtype=dtype, use_safetensors=True)
stock.set_progress_bar_config(disable=True)
with torch.no_grad():
    positive, negative = stock.encode_prompt(request.prompt, request.negative_prompt, True, device="cpu",
                                             max_sequence_length=t["max_text_seq_length"])
pairs = ((embeds["prompt_embeds"], positive), (embeds["negative_prompt_embeds"], negative))
if dtype == torch.float32:  # tiny: equal to float32 rounding
    text_error, text_bound = max(float((a - b).abs().max()) for a, b in pairs), 1e-5
    print("max abs difference from diffusers:", results.error_text(text_error, text_bound))
else:  # full, bfloat16: relative to the largest value
    text_error, text_bound = max(relative(a, b) for a, b in pairs), llm.BF16_RELATIVE_BOUND
    print(f"max abs difference from diffusers over its largest |value|: {text_error:.1e} (bound {text_bound:.1e})")

# %% tags=["check"]
assert pipe.traces["text"] == 1
assert text_error <= text_bound

# %% [markdown]
# ## 3. The scheduler as a pure function
#
# `CogVideoXDPMScheduler.step` cannot go inside `jax.jit` as written: it branches in Python on
# `prev_timestep >= 0`, indexes `alphas_cumprod` with the timestep, keeps the previous
# prediction as Python state, and draws noise from the pipeline's generator. Every per-step
# number is known on the host once the step count is set, so `tpupedia.pipelines.schedulers`
# computes them with the scheduler's own methods and stacks them into arrays indexed by the step
# `i`. The branch becomes a table column (`second_order`), the state an argument, the noise an
# argument drawn on the host in the order the stock step draws it.

# %%
import numpy as np

from tpupedia.pipelines import schedulers

scheduler = family.load_scheduler(source)
scheduler.set_timesteps(request.steps)
tables = schedulers.cogvideox_tables(scheduler)
columns = ["timesteps", "sqrt_alpha", "mult1", "mult2", "mult_noise", "second_order"]
print(" ".join(f"{c:>12}" for c in ["step"] + columns))
for i in range(min(request.steps, 6)):
    print(" ".join([f"{i:>12}"] + [f"{tables[c][i]:>12.4g}" for c in columns]))

# %% [markdown]
# What the columns are. CogVideoX predicts a velocity `v`, and the clean latent it implies at
# step `i` is `x0 = sqrt_alpha * x - sqrt_beta * v`, with `sqrt_alpha` = sqrt(alpha-bar) and
# `sqrt_beta` = sqrt(1 - alpha-bar) at the step's timestep. The solver is DPM-Solver++(2M) in its
# stochastic form. Write `sigma = sqrt(1 - alpha-bar)`, `lambda = log(sqrt(alpha-bar) / sigma)`
# (half the log signal-to-noise ratio) and `h` for how far one step moves `lambda`. One step is
#
#     x_prev = mult1 * x - mult2 * D + mult_noise * noise
#     mult1 = (sigma_prev / sigma) * exp(-h)
#     mult2 = (exp(-2h) - 1) * sqrt(alpha-bar_prev)        (negative: -mult2 * D adds the estimate)
#     mult_noise = sigma_prev * sqrt(1 - exp(-2h))
#
# where `D` is the clean-latent estimate. A first-order step uses this step's `x0`. A
# second-order step (`second_order` = 1) extrapolates from the last two estimates,
# `D = mult3 * x0 - mult4 * x0_prev` with `mult3 = 1 + 1/(2r)`, `mult4 = 1/(2r)`, where `r` is
# the ratio of the previous step's `h` to this one's. `x0_prev` is the state the jitted step
# carries from one call to the next (`old_pred` below).
#
# The two ends of the schedule are worth a look:
#
# - **Step 0: `sqrt_alpha = 0`.** The checkpoint's scheduler sets `rescale_betas_zero_snr`, so
#   the signal-to-noise ratio is exactly zero at timestep 999: the first input is pure noise.
#   Then `lambda` is minus infinity and `h` is infinite, which makes `mult1 = 0`. The first step
#   keeps nothing of its input and builds the next latent from the model's `x0 = -v` and fresh
#   noise. Step 1 is second order in name only: its `r` is infinite, so `mult4 = 0`.
# - **The last step.** `set_alpha_to_one` makes the final alpha-bar 1, so `sigma_prev = 0`:
#   `mult1 = 0`, `mult2 = -1` and `mult_noise = 0`. The last step returns the clean-latent
#   estimate and adds no noise.
#
# Over this checkpoint's 50 steps (the full preset's count; the tiny checkpoint carries the
# release's scheduler configuration):

# %%
import matplotlib.pyplot as plt

release_scheduler = family.load_scheduler(source)
release_scheduler.set_timesteps(50)
release_tables = schedulers.cogvideox_tables(release_scheduler)
fig, ax = plt.subplots(figsize=(6.5, 2.8))
for column, style in (("sqrt_alpha", "-"), ("mult1", "-"), ("mult2", "--"), ("mult_noise", "-"), ("mult4", ":")):
    ax.plot(release_tables[column], style, label=column)
ax.set_xlabel("step")
ax.legend(fontsize=8, ncol=5, loc="lower center")
plt.tight_layout()
plt.show()

# %%
first, last = ({c: float(release_tables[c][i]) for c in columns + ["mult3", "mult4"]} for i in (0, -1))
assert release_scheduler.config.rescale_betas_zero_snr and release_scheduler.config.set_alpha_to_one
assert first["sqrt_alpha"] == 0 and first["mult1"] == 0 and first["second_order"] == 0
assert release_tables["second_order"][1] == 1 and release_tables["mult4"][1] == 0  # r is infinite at step 1
assert last["mult1"] == 0 and abs(last["mult2"] + 1) < 1e-6 and last["mult_noise"] == 0
assert np.all(np.diff(release_tables["sqrt_alpha"]) > 0)  # the signal grows every step

# %% [markdown]
# One jitted function then serves every step: `i` is traced, so the program does not depend on
# which step it runs. Against the stock `step` on the same model outputs and generator:

# %%
import jax.numpy as jnp

device_tables = {k: jnp.asarray(v) for k, v in tables.items()}
pure_step = jax.jit(lambda i, x, out, old, noise: schedulers.dpm_step(device_tables, i, x, out, old, noise))
shape = (1, 2, 4, 4, 4)
outputs = torch.randn((request.steps, *shape), generator=torch.Generator().manual_seed(0))
x_stock = torch.randn(shape, generator=torch.Generator().manual_seed(1))
x_pure, old_stock, old_pure = jnp.asarray(x_stock.numpy()), None, jnp.zeros(shape)
g_stock, g_pure = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
reference = family.load_scheduler(source)
reference.set_timesteps(request.steps)
step_errors = []
for i, timestep in enumerate(reference.timesteps):
    x_stock, old_stock = reference.step(outputs[i], old_stock, timestep, reference.timesteps[i - 1] if i else None,
                                        x_stock, generator=g_stock, return_dict=False)
    noise = schedulers.dpm_noise(g_pure, shape, torch.float32, tables, i)
    x_pure, old_pure = pure_step(jnp.int32(i), x_pure, jnp.asarray(outputs[i].numpy()), old_pure, jnp.asarray(noise))
    step_errors.append(float(np.abs(np.asarray(x_pure) - x_stock.numpy()).max()))
print("max abs difference per step:", " ".join(results.error_text(e) for e in step_errors))

# %% tags=["check"]
assert type(scheduler).__name__ == "CogVideoXDPMScheduler" and max(step_errors) <= 1e-5
assert pure_step._cache_size() == 1  # one compiled program for all steps

# %% [markdown]
# ### Exercise 2: the schedule at 10 steps
#
# The tables above are for this preset's step count. A run with 10 steps gets its own tables
# from the same scheduler. **Predict** first: the 10 timesteps (the spacing is `trailing`, 1000
# training timesteps), which steps are first order and which second order, and the values of
# `mult1`, `mult2` and `mult_noise` at the first and at the last step. Then open the solution,
# run it, and compare.

# %% tags=["solution"]
ten = family.load_scheduler(source)
ten.set_timesteps(10)
ten_tables = schedulers.cogvideox_tables(ten)
print(" ".join(f"{c:>12}" for c in ["step"] + columns))
for i in range(10):
    print(" ".join([f"{i:>12}"] + [f"{ten_tables[c][i]:>12.4g}" for c in columns]))

# %% tags=["check"]
assert list(ten_tables["timesteps"]) == list(range(999, 0, -100))  # trailing: 1000 / 10 apart, the last at 99
assert list(ten_tables["second_order"]) == [0] + [1] * 8 + [0]  # no previous estimate, then no next timestep
assert ten_tables["sqrt_alpha"][0] == 0 and ten_tables["mult1"][0] == 0 and ten_tables["mult_noise"][0] > 0
assert ten_tables["mult1"][-1] == 0 and abs(ten_tables["mult2"][-1] + 1) < 1e-6 and ten_tables["mult_noise"][-1] == 0

# %% [markdown]
# ## 4. Stage 2: the denoising step, written out
#
# The denoising step does four things in one program:
#
# 1. classifier-free guidance's two halves (negative, positive) as **one batch of 2**, placed on
#    the mesh's `dp` axis, so each half runs on its own half of the chips;
# 2. the transformer, its attention and MLP weights split over `tp` by the Megatron table of
#    notebook `sharding` (column-parallel `to_q/to_k/to_v/ff.net.0`, row-parallel `to_out/ff.net.2`);
# 3. the guidance combination `uncond + g * (cond - uncond)`, with `g` traced;
# 4. the pure scheduler step of section 3.
#
# Here it is, written out, before the pipeline module's copy of it is used. First the
# transformer, placed as notebook `sharding` placed Llama: each chip receives only its shards of the
# family's `tp` table. `family.make_jit_friendly` swaps in one attention processor (section 5
# shows why), and `FunctionalModule` turns the module into a function of its weights.

# %%
from diffusers import CogVideoXTransformer3DModel

from tpupedia import sharding, torchax_utils

transformer = CogVideoXTransformer3DModel.from_pretrained(source, subfolder="transformer", dtype=dtype,
                                                          use_safetensors=True).eval()
family.make_jit_friendly(transformer)
env = torchax_utils.default_env()
placement = sharding.place(transformer, sharding.rules(family.SPEC, "tp", axis="tp"), mesh, env)
forward = torchax_utils.FunctionalModule(transformer, return_dict=False)
weights, buffers = forward.state()
print(f"{len(weights)} weight tensors on the mesh, {placement.bytes_per_device / 2**20:.1f} MiB per device")

# %% [markdown]
# Then what the host prepares, as diffusers prepares it. The initial latents come from
# `torch.Generator(seed)` through diffusers' own `randn_tensor`, in the latents' dtype, so the
# same seed starts from the same noise as the stock pipeline; the same generator then draws
# each step's noise (`schedulers.dpm_noise`, in the stock step's order). The rotary tables come
# from the stock pipeline's own method (`family.rotary_embeddings`), and the text is the
# guidance pair, negative first.

# %%
from diffusers.utils.torch_utils import randn_tensor

from tpupedia.pipelines import common

generator = torch.Generator().manual_seed(request.seed)
latent_frames, _ = family.padded_latent_frames(request.frames, pipe.shapes)
latent_shape = (1, latent_frames, pipe.shapes.latent_channels, *pipe.shapes.latent_size(request.height, request.width))
start = randn_tensor(latent_shape, generator=generator, dtype=dtype) * scheduler.init_noise_sigma
cos, sin = family.rotary_embeddings(t, request.height, request.width, latent_frames, pipe.shapes)
text_pair = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]])
print("latents", latent_shape, "| text pair", tuple(text_pair.shape), "| rotary tables", tuple(cos.shape))

# %% [markdown]
# The step itself. `i` and `guidance` are traced arguments, so one program serves every step
# and any guidance scale. The latents and the solver's previous estimate come back with the
# sharding they came in with, so the second call reuses the first call's program, and they are
# donated, so XLA may write the new ones over the old buffers.

# %%
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pair = NamedSharding(mesh, P("dp"))  # the guidance pair: one half per dp group
replicated = NamedSharding(mesh, P())


def denoise_step(weights, buffers, latents, old_x0, text, cos, sin, i, guidance, noise):
    x = jnp.concatenate([latents, latents])  # 1. negative and positive, one batch of 2 ...
    x = jax.lax.with_sharding_constraint(x, pair)  # ... split over dp
    timestep = jnp.broadcast_to(device_tables["timesteps"][i], (2,))
    v = forward(weights, buffers, hidden_states=x, encoder_hidden_states=text, timestep=timestep,
                image_rotary_emb=(cos, sin))[0].astype(jnp.float32)  # 2. the transformer, over tp
    v = v[:1] + guidance * (v[1:] - v[:1])  # 3. guidance
    new, x0 = schedulers.dpm_step(device_tables, i, latents.astype(jnp.float32), v, old_x0, noise)  # 4.
    return new.astype(latents.dtype), x0


step = jax.jit(denoise_step, donate_argnums=(2, 3), out_shardings=(replicated, replicated))

# %% [markdown]
# The loop: the inputs go to the mesh once, then one call per step with that step's noise. The
# attention inside the transformer is torchax's SDPA routed to the backend the pipeline picks
# (splash on a TPU, notebook `splash_attention`; the reference on a CPU), and the matmuls run at the precision
# section 2 asked for.

# %%
backend = common.attention_backend("auto", mesh)
x = jax.device_put(common.to_jax_array(start), replicated)
old_x0 = jax.device_put(jnp.zeros(latent_shape, jnp.float32), replicated)
inputs = (jax.device_put(common.to_jax_array(text_pair), pair),
          *(jax.device_put(common.to_jax_array(a), replicated) for a in (cos, sin)))
with common.attention_installed(env, mesh, backend, pipe.block_sizes), jax.default_matmul_precision("highest"):
    first_noise = schedulers.dpm_noise(torch.Generator().manual_seed(0), latent_shape, dtype, tables, 0)
    step_hlo = step.lower(weights, buffers, x, old_x0, *inputs, np.int32(0), np.float32(request.guidance),
                          first_noise).compile().as_text()  # kept for the collectives below
    for i in range(request.steps):
        noise = schedulers.dpm_noise(generator, latent_shape, dtype, tables, i)
        x, old_x0 = step(weights, buffers, x, old_x0, *inputs, np.int32(i), np.float32(request.guidance), noise)
ours = common.to_torch(x).to(dtype)
print("latents", tuple(ours.shape), ours.dtype, "| compiled", step._cache_size(), "program(s) for", request.steps, "steps")

# %% [markdown]
# Donation has one rule: once a call has taken an input, the input is gone, and only the output
# may be read. The loop above never touches `x` or `old_x0` after passing them; it rebinds both
# to what `step` returns. Where PyTorch would let you read a tensor that an in-place update had
# overwritten, JAX refuses, as a one-line donating function shows:

# %%
add_one = jax.jit(lambda a: a + 1, donate_argnums=0)
before = jax.device_put(jnp.zeros(4), replicated)
after = add_one(before)
deleted = expect(lambda: before + 0, RuntimeError, max_lines=1)
print("read the output instead:", after.tolist())

# %% tags=["check"]
assert before.is_deleted() and "deleted" in str(deleted) and after.tolist() == [1.0] * 4

# %% [markdown]
# The pipeline module runs the same step (`pipeline.CogVideoX.denoise`, which also loads and
# frees the transformer and times each call). Our copy of the transformer goes first, so the
# chips hold one at a time; then the module's result against ours, bit for bit:

# %%
del transformer, weights, buffers, x, old_x0, inputs
forward = None  # the last reference to our copy's weights
latents, denoise_timings = pipe.denoise(request, embeds)
print("module:", tuple(latents["latents"].shape), "| traced", pipe.traces["denoise"], "time(s) for",
      request.steps, "steps | equal to the step written here:", torch.equal(latents["latents"], ours))

# %% tags=["check"]
assert step._cache_size() == 1 and pipe.traces["denoise"] == 1  # one program for every step
assert torch.equal(latents["latents"], ours)
assert latents["latents"].shape[1] == family.padded_latent_frames(request.frames)[0]

# %% [markdown]
# What the `tp` split costs. A row-parallel layer (`to_out`, `ff.net.2`) multiplies its slice
# of the input by its slice of the weight, so each chip holds a partial sum of the output; the
# compiler adds them with an **all-reduce** over `tp`. Two per block, and the compiled step
# shows them (`aot.collective_ops` reads the HLO text; the bytes are what one chip sends, by
# How to Scale Your Model's ring estimate):

# %%
from collections import Counter

from tpupedia import aot

collectives = aot.collective_ops(step_hlo, jax.device_count())
kinds = Counter(op.kind for op in collectives)
print(f"{t['num_layers']} blocks; collectives in the compiled step:", dict(kinds))
for op in collectives:
    print(f"  {op.kind:18} over {op.group_size} chips, result {op.shapes}: {op.bytes_sent / 2**10:.1f} KiB sent per chip")

# %% [markdown]
# The all-reduces over the 4 chips of `tp` are those two per block, each the size of a block's
# activations. The other three collectives move latent-sized tensors across `dp`: the guidance
# pair's two halves live on the two `dp` rows, and the guidance formula `uncond + g (cond -
# uncond)` needs both, so the compiler brings them together (an all-to-all and a
# collective-permute) and sums a 2-chip all-reduce. They carry a few KiB of latents, not
# activations; exercise 3 below turns guidance off and watches them go.

# %% [markdown]
# Where the transformer's weights went (the first block; the other blocks repeat it):

# %%
from IPython.display import Markdown

plan = pipe.plans["transformer"]
Markdown(plan.table(r"^transformer_blocks\.0\.(attn1\.to_(q|out\.0)|ff\.net\.(0\.proj|2))\.weight$"))

# %% tags=["check"]
# the tp split, as placed and as compiled: column-parallel q, row-parallel ff.net.2, and the
# row-parallel layers' all-reduces (to_out and ff.net.2 in every block)
assert plan["transformer_blocks.0.attn1.to_q.weight"].spec == jax.sharding.PartitionSpec("tp", None)
assert plan["transformer_blocks.0.ff.net.2.weight"].spec == jax.sharding.PartitionSpec(None, "tp")
assert kinds["all-reduce"] >= 2 * t["num_layers"]

# %% [markdown]
# The timings of the first call (trace and compile) and of the later steps (the program alone).
# On a 2-core CPU the tiny model says little about a TPU; the shape of the numbers is the point:
# compilation is paid once.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"text    first {text_timings['first_s']:.2f} s, second {text_timings['steady_s'] * 1e3:.1f} ms")
print(f"denoise first {denoise_timings['first_s']:.2f} s, steady {denoise_timings['steady_s'] * 1e3:.1f} ms/step")

# %% [markdown]
# ### Exercise 3: turn guidance off
#
# At `guidance = 1`, `u + g (c - u)` is `c`: the negative prompt no longer counts, so diffusers
# skips it (`do_classifier_free_guidance` is `guidance_scale > 1`), and so does the pipeline
# module, which compiles another step for it. That step makes one transformer call on a batch of
# one, the positive prompt only, the latents whole on every chip. **Predict** first: (a) which
# collectives of the guided step's list above disappear, and whether the `tp` all-reduces that
# stay send fewer bytes; (b) how many transformer samples each chip of this `(dp=2, tp=4)` mesh
# computes per step, guided and not; (c) whether one step of it matches the guided step run at
# `guidance = 1.0` from the same latents and noise. Then open the solution, run it, and compare.

# %% tags=["solution"]
# section 4's transformer again (our copy went to make room for the module's), placed the same way
transformer = CogVideoXTransformer3DModel.from_pretrained(source, subfolder="transformer", dtype=dtype,
                                                          use_safetensors=True).eval()
family.make_jit_friendly(transformer)
sharding.place(transformer, sharding.rules(family.SPEC, "tp", axis="tp"), mesh, env)
forward = torchax_utils.FunctionalModule(transformer, return_dict=False)  # `denoise_step` calls it by this name
weights, buffers = forward.state()


def unguided_step(weights, buffers, latents, old_x0, text, cos, sin, i, noise):
    timestep = jnp.broadcast_to(device_tables["timesteps"][i], (1,))
    v = forward(weights, buffers, hidden_states=latents, encoder_hidden_states=text, timestep=timestep,
                image_rotary_emb=(cos, sin))[0].astype(jnp.float32)  # one call, a batch of one
    new, x0 = schedulers.dpm_step(device_tables, i, latents.astype(jnp.float32), v, old_x0, noise)
    return new.astype(latents.dtype), x0


unguided = jax.jit(unguided_step, out_shardings=(replicated, replicated))
cos_sin = [jax.device_put(common.to_jax_array(a), replicated) for a in (cos, sin)]
positive = jax.device_put(common.to_jax_array(embeds["prompt_embeds"]), replicated)
pair_text = jax.device_put(common.to_jax_array(text_pair), pair)
fresh = lambda: (jax.device_put(common.to_jax_array(start), replicated),  # noqa: E731 - `step` donates these
                 jax.device_put(jnp.zeros(latent_shape, jnp.float32), replicated))
with common.attention_installed(env, mesh, backend, pipe.block_sizes), jax.default_matmul_precision("highest"):
    one_call = unguided.lower(weights, buffers, *fresh(), positive, *cos_sin, np.int32(0), first_noise).compile()
    unguided_x, _ = one_call(weights, buffers, *fresh(), positive, *cos_sin, np.int32(0), first_noise)
    guided_x, _ = step(weights, buffers, *fresh(), pair_text, *cos_sin, np.int32(0), np.float32(1.0), first_noise)
    guided_flops = step.lower(weights, buffers, *fresh(), pair_text, *cos_sin, np.int32(0), np.float32(1.0),
                              first_noise).compile().cost_analysis()["flops"]
unguided_collectives = aot.collective_ops(one_call.as_text(), jax.device_count())
print("guided:  ", dict(kinds))
print("unguided:", dict(Counter(op.kind for op in unguided_collectives)))
for op in unguided_collectives:
    print(f"  {op.kind:18} over {op.group_size} chips, result {op.shapes}: {op.bytes_sent / 2**10:.1f} KiB sent per chip")
flops_ratio = one_call.cost_analysis()["flops"] / guided_flops  # the compiler's count, one chip's program
print(f"FLOPs per chip per step, unguided over guided: {flops_ratio:.2f}")
guidance_off_error = relative(common.to_torch(unguided_x), common.to_torch(guided_x))
print("one step, unguided against guided at guidance 1.0, max difference over the largest |value|:",
      results.error_text(guidance_off_error, 1e-5 if dtype == torch.float32 else llm.BF16_RELATIVE_BOUND))
del transformer, weights, buffers, cos_sin, positive, pair_text, unguided_x, guided_x
forward = None

# %% tags=["check"]
tp_reduces = lambda ops: sorted(op.bytes_sent for op in ops if op.kind == "all-reduce" and op.group_size == 4)  # noqa: E731
assert tp_reduces(unguided_collectives) == tp_reduces(collectives)  # the tp all-reduces stay, as large
assert all(op.group_size == mesh.shape["tp"] for op in unguided_collectives)  # nothing crosses dp: no pair to split
assert 0.95 < flops_ratio < 1.05  # one sample per chip either way: both dp groups now compute the same one
assert step._cache_size() == 1  # guidance 1.0 is only another value of the traced scale: no new program
assert guidance_off_error <= (1e-5 if dtype == torch.float32 else llm.BF16_RELATIVE_BOUND)

# %% [markdown]
# ## 5. A write in place, and a compiler that got it wrong
#
# `family.make_jit_friendly` (section 4) changes one thing in diffusers' CogVideoX attention:
# how the rotary position embedding (RoPE) is applied. The stock `CogVideoXAttnProcessor2_0`
# rotates the video part of the query and the key by writing into them:
#
#     query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
#
# On one device that is fine. When this pipeline first split the guidance pair over `dp`, its
# parity check against stock diffusers failed: a max abs error of 0.06 on the tiny model, where
# a few 1e-7 were expected. Here is that failure live, on one attention layer of this
# checkpoint's shape (random weights, a short sequence), its projections placed by the family's
# `tp` table and the batch of 2 split over `dp` as the step splits it. PyTorch on the CPU is the
# reference:

# %%
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

heads, head_dim = t["num_attention_heads"], t["attention_head_dim"]
torch.manual_seed(0)
layer = Attention(query_dim=heads * head_dim, dim_head=head_dim, heads=heads, qk_norm="layer_norm", eps=1e-6,
                  bias=True, out_bias=True, processor=CogVideoXAttnProcessor2_0()).eval()  # as a CogVideoX block builds it
text_len, video_len = 8, 32
hidden = torch.randn(2, text_len + video_len, heads * head_dim)
rope = (torch.randn(video_len, head_dim), torch.randn(video_len, head_dim))  # any tables exercise the write
with torch.no_grad():
    reference_out = layer(hidden[:, text_len:], hidden[:, :text_len], image_rotary_emb=rope)[0]

named_as_in_the_transformer = torch.nn.ModuleList([torch.nn.ModuleDict({"attn1": layer})])  # 0.attn1.to_q, ...
sharding.place(named_as_in_the_transformer, sharding.rules(family.SPEC, "tp", axis="tp"), mesh, env)
attention = torchax_utils.FunctionalModule(layer)
layer_state = attention.state()
layer_inputs = [common.to_jax_array(a) for a in (hidden, *rope)]


def layer_error(batch: P) -> float:
    """Max abs difference from PyTorch of the layer on the mesh, its input's batch split by `batch`."""
    def call(weights, buffers, hidden, cos, sin):
        hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, batch))
        return attention(weights, buffers, hidden_states=hidden[:, text_len:], encoder_hidden_states=hidden[:, :text_len],
                         image_rotary_emb=(cos, sin))[0]

    with jax.default_matmul_precision("highest"):
        out = jax.jit(call)(*layer_state, *layer_inputs)
    return float((common.to_torch(out) - reference_out).abs().max())


# Errors print against a bound (`results.measured_text`), since their last digits change from
# run to run (the simulated devices add partial sums in the order their threads arrive): float32
# noise under 1e-5, a wrong program's error over 1e-2.
def shown(error: float) -> str:
    return results.measured_text(error, 1e-5) if error <= 1e-5 else results.measured_text(error, 1e-2, at_least=True)


stock_whole, stock_split = layer_error(P()), layer_error(P("dp"))
layer.set_processor(family.FunctionalRoPEAttnProcessor())  # what make_jit_friendly installs
fixed_split = layer_error(P("dp"))
print(f"stock processor, batch whole:    {shown(stock_whole)}")
print(f"stock processor, batch over dp:  {shown(stock_split)}")
print(f"rotated by concatenation, dp:    {shown(fixed_split)}")

# %% [markdown]
# Is it torchax? The same attention in plain JAX, the write as `.at[...].set(...)` (what
# torchax turns the assignment into), the heads split over `tp` by a column-split weight:

# %%
def jax_attention(x, wq, wk, wv, cos, sin, *, write_in_place: bool, split: bool):
    """Attention over `x` with RoPE on the tokens after `text_len`; the weights' heads over tp if `split`."""
    if split:
        wq, wk, wv = (jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(None, "tp"))) for w in (wq, wk, wv))
    to_heads = lambda a: a.reshape(a.shape[0], -1, heads, head_dim).transpose(0, 2, 1, 3)  # noqa: E731
    q, k, v = to_heads(x @ wq), to_heads(x @ wk), to_heads(x @ wv)

    def rotate(a):  # diffusers' apply_rotary_emb: pairs (a0, a1) -> (a0 cos - a1 sin, a1 cos + a0 sin)
        pairs = a.reshape(*a.shape[:-1], -1, 2)
        turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(a.shape)
        return a * cos + turned * sin

    if write_in_place:
        q = q.at[:, :, text_len:].set(rotate(q[:, :, text_len:]))
        k = k.at[:, :, text_len:].set(rotate(k[:, :, text_len:]))
    else:
        q = jnp.concatenate([q[:, :, :text_len], rotate(q[:, :, text_len:])], axis=2)
        k = jnp.concatenate([k[:, :, :text_len], rotate(k[:, :, text_len:])], axis=2)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(head_dim)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


rng = np.random.default_rng(0)
width = heads * head_dim
jax_inputs = [rng.standard_normal((2, text_len + video_len, width), dtype=np.float32),
              *(rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width) for _ in range(3)),
              *(rng.standard_normal((video_len, head_dim), dtype=np.float32) for _ in range(2))]


def run_jax(write_in_place: bool, split: bool) -> np.ndarray:
    program = jax.jit(lambda *a: jax_attention(*a, write_in_place=write_in_place, split=split))
    with jax.default_matmul_precision("highest"):
        return np.asarray(program(*jax_inputs))


jax_reference = run_jax(write_in_place=False, split=False)
jax_errors = {}
for in_place in (True, False):
    for split in (False, True):
        jax_errors[in_place, split] = float(np.abs(run_jax(in_place, split) - jax_reference).max())
        print(f"{'in place' if in_place else 'concatenated':13} heads {'over tp' if split else 'whole  '}: "
              f"{shown(jax_errors[in_place, split])}")

# %% [markdown]
# Plain JAX fails too, so the fault is below torchax: XLA's SPMD partitioner, which splits the
# program over the chips, gets the in-place update (a `dynamic-update-slice` in the HLO) of an
# array whose heads are split wrong when an attention reads it. The query and key themselves
# come out right if the program returns them; the attention over them does not. Which
# arrangement trips it depends on the rest of the program (in the layer above, the `dp` split
# did; here the split heads alone do). It was measured on this CPU with jax 0.10.2; nothing here
# ran on a TPU. The cure does not depend on where it happens: build the rotated tensor anew with
# `torch.cat`, as `FunctionalRoPEAttnProcessor` does, and there is no in-place update left to
# partition. The rule to take away: inside a jitted torch function, compute new tensors rather
# than writing into old ones (an in-place write leaves the compiler an update to partition, and
# this one it partitioned wrong); and check parity on the mesh you will run, because a program
# right on one device can be wrong split.

# %% tags=["check"]
assert stock_whole <= 1e-5 and fixed_split <= 1e-5
assert jax_errors[(False, True)] <= 1e-5 and jax_errors[(True, False)] <= 1e-5
if jax.default_backend() == "cpu":  # measured here; another backend's partitioner may get it right
    assert stock_split > 1e-2 and jax_errors[(True, True)] > 1e-2

# %% [markdown]
# ## 6. Stage 3: decode, and look at the video
#
# The padding latent frame is dropped, the latents are divided by the VAE's scaling factor and
# decoded by the Flax NNX port of notebook `cogvideox_vae_flax`, the VAE a plan covers (the library's
# `Options(vae="torchax")` runs diffusers' VAE under torchax instead, on the tiny preset). Frames come out as diffusers' `output_type="np"` returns them: float32
# `(frames, height, width, 3)` in [0, 1]. Random weights make a random video; the shapes, the
# value range and the parity below are what this preset proves.

# %%
decoded, decode_timings = pipe.decode(request, latents["latents"])
frames = decoded["frames"].numpy()
print("frames", frames.shape, frames.dtype, f"range [{frames.min():.2f}, {frames.max():.2f}]")

# %% [markdown]
# Five frames spread over the video. On the tiny preset each is noise, because the weights are
# random: the picture says nothing about quality. What it shows is the count and size the request
# asked for (the title), and these are the frames that section 7 finds equal to stock diffusers'
# to within 1e-4. On the full preset the same cell shows the generated video's frames.

# %%
from tpupedia import video

video.show_frames(frames, f"{label}: {request.frames} frames at {request.width}x{request.height}")

# %% [markdown]
# ### The host's chips share the decode
#
# The VAE's causal convolutions run in time order (each frame batch takes the previous one's
# cache, notebook `cogvideox_vae_flax`), so time cannot be split between chips. Space can: the decode stage keeps a
# copy of the VAE's weights on every chip of the host and splits each activation of a frame batch
# by width (by height when the latent width does not divide among the chips, not at all when
# neither does), each chip computing its strip (`tpupedia.pipelines.decoding.activation_sharding`;
# upstream splits its VAE by width too, yangwhale/gpu-tpu-pedia, commit 3fa9ce1,
# `tpu/CogVideoX/README.md`). The run hands every
# chip the whole latent, and the compiler would then keep every activation whole, so the Flax VAE
# pins every convolution's input and output and every norm's output to the split
# (`with_sharding_constraint`); a 3x3 convolution then trades one-pixel edges with its neighbours
# and a GroupNorm one all-reduce of its sums. With tiling on (a size where even that does not
# fit), the tiles of one shape are decoded side by side instead, one per chip (HunyuanVideo-1.5's decode, in notebook `hunyuan_video`, does this; the
# knowledge base's [Decoding video on several chips](../kb/vae-decode.md) has both, measured).
#
# The decode's first frame batch compiled for one chip and for this host's chips, per chip
# (on the tiny preset at 128x192, where the split divides the temporaries by about the chip
# count; at the release's 1360x768, compiled ahead of time for a v6e host's 4 chips, the work
# is split four ways but the memory falls far less: under 19 GiB per chip against the 22 GiB of
# notebook `cogvideox_vae_flax`'s one-chip compile):

# %%
from tpupedia.pipelines import decoding

host_chips = decoding.decode_mesh(pipe.mesh)
one_chip = devices.make_mesh((1,), (decoding.AXIS,), devices=list(host_chips.devices.flat)[:1])
if preset.compile_full_size:  # full: the run's own VAE and size, compiled for these chips (minutes)
    vae_config, (vae_height, vae_width) = pipe.configs["vae"], (request.height, request.width)
else:  # tiny: the tiny VAE at 128x192, large enough for the split to show (seconds)
    vae_config, (vae_height, vae_width) = pipe.configs["vae"], (128, 192)
decode_memory = {}
for chips in (one_chip, host_chips):
    first_batch = pipeline.decode_programs(vae_config, 3, vae_height, vae_width, chips, dtype=preset.dtype)[0]
    decode_memory[chips.size] = first_batch.compile().memory
    print(f"{first_batch.name}: {decode_memory[chips.size].temporaries / 2**20:,.1f} MiB of temporaries per chip")

# %% tags=["check"]
assert decode_memory[host_chips.size].temporaries < decode_memory[1].temporaries / 3

# %% [markdown]
# The mp4 is written from the same array (8-bit, H.264) by `tpupedia.video.write_mp4`, to a
# temporary file that is renamed into place. Reading it back gives the frame count and size:

# %%
import imageio.v3 as iio

movie = video.write_mp4(frames, scratch / "panda.mp4", fps=request.fps)
read_back = np.stack(list(iio.imiter(movie, plugin="FFMPEG")))
print(movie.name, read_back.shape, read_back.dtype)

# %% [markdown]
# And the video itself, noise again on the tiny preset (its encoded bytes depend on the ffmpeg
# build, so nbval does not compare this cell's output; the asserts below check what was written:
# the frame count and size):

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import Video

Video(str(movie), embed=True, width=256, html_attributes="controls loop autoplay muted")

# %% tags=["check"]
assert frames.shape == (request.frames, request.height, request.width, 3) and frames.dtype == np.float32
assert 0.0 <= frames.min() and frames.max() <= 1.0
assert read_back.shape == frames.shape

# %% [markdown]
# ## 7. Parity with stock diffusers
#
# The strongest check of the whole pipeline: the stock `CogVideoXPipeline`, eager PyTorch on the
# CPU, given the same checkpoint, prompt and seed. Float32 on both sides (tiny preset); a TPU
# would run float32 matmuls in bf16 passes unless asked for full precision, so the pipeline
# of section 2 was built with `matmul_precision="highest"`, which the CPU has anyway.
#
# On the full preset the whole video is out of the host's reach: 50 steps at 720p are about
# 1.2e17 FLOPs (`family.step_flops`, section 1), over a day even at a sustained 1e12 FLOP/s. The
# host can run one step at 9 frames and 256x256, about 1/160 of a 720p step. Both pipelines take
# that step from our stage-1 embeddings and the same seed, and their latents are compared with
# section 2's bfloat16 measure. The step is unguided: `u + g (c - u)` multiplies a difference
# between the two sides by up to `2g - 1` (11 at `g = 6`), and guidance is plain arithmetic,
# checked exactly on the tiny preset.

# %%
import dataclasses

if preset.host_runs_whole_models:  # tiny: the whole video, seconds on the host CPU
    with torch.no_grad():
        expected = stock(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.frames,
                         height=request.height, width=request.width, num_inference_steps=request.steps,
                         guidance_scale=request.guidance, generator=torch.Generator().manual_seed(request.seed),
                         output_type="np", max_sequence_length=t["max_text_seq_length"]).frames[0]
    video_error = float(np.abs(frames - expected).max())
    print("frames: max abs difference from stock diffusers",
          results.error_text(video_error, 1e-4), "(pixel scale 1; one 8-bit level is 1/255)")
else:  # full: one denoising step at 9 frames, 256x256, without guidance
    one_step = dataclasses.replace(request, frames=9, height=256, width=256, steps=1, guidance=1.0)
    ours = pipe.denoise(one_step, embeds)[0]["latents"]
    with torch.no_grad():
        theirs = stock(prompt_embeds=embeds["prompt_embeds"], num_frames=one_step.frames, height=one_step.height,
                       width=one_step.width, num_inference_steps=1, guidance_scale=one_step.guidance,
                       generator=torch.Generator().manual_seed(one_step.seed), output_type="latent").frames
    step_error = relative(ours, theirs)
    print(f"one step at {one_step.width}x{one_step.height}, {one_step.frames} frames "
          f"({family.step_flops(one_step.width, one_step.height, one_step.frames)['total']:.1e} FLOPs): latents' "
          f"max abs difference from stock diffusers over its largest |value|: {step_error:.1e} "
          f"(bound {llm.BF16_RELATIVE_BOUND:.1e})")

# %% tags=["check"]
if preset.host_runs_whole_models:
    assert expected.shape == frames.shape
    assert video_error <= 1e-4
    assert frames.std() > 0.01  # not a constant image that would match anything
else:
    assert ours.shape == theirs.shape
    assert step_error <= llm.BF16_RELATIVE_BOUND

# %% [markdown]
# The stock pipeline is not needed again; on the full preset it holds 21 GB of host memory (the
# header's parameter counts), so it goes now:

# %%
import gc

del stock
_ = gc.collect()

# %% [markdown]
# ## 8. The stage-file contract
#
# `pipeline.run`, the call the notebook opened with, is what `tpupedia generate cogvideox`
# calls: it validates the request, then for each stage either skips it (its file exists and was
# made for this request) or runs it and writes the file. A stage reads its input only through
# `stages.read`, which checks the JSON twin, the settings fingerprint, the tensor file's
# checksum, and every shape and dtype. The same request again, in the opening run's folder:
# nothing to do.

# %%
from tpupedia.pipelines import stages

workdir = scratch / "run"
options = pipeline.Options(quiet=True)
pipeline.run(request, options, preset=preset, workdir=workdir, log=log.append)  # `log` holds the opening run's lines
print("\n".join(line.split(" (")[0].replace(str(scratch), "SCRATCH") for line in log))

# %% [markdown]
# Here is that contract as a picture, drawn from the pipeline's stage list
# (`common.STAGE_ORDER` and which stages each one reads, `common.STAGE_INPUTS`) and from the
# files in the opening run's folder. Under each stage is the file it wrote, with every tensor's
# name, shape and dtype, its settings fingerprint and its checksum, all as `stages.status` read
# and checked them just now (the checks of `stages.read`, without loading the tensors). The
# `image` stage is dashed: the pipeline has it, but only a request with a picture runs it
# (section 9). Each arrow into a stage is one such read, and only these files pass between
# stages: of the text stage's work, a denoise stage on another machine needs these two files alone.

# %% tags=["diagram-stages"]
from tpupedia.diagrams import stages as stages_diagram

stages_diagram.draw(pipe, request, workdir)

# %% tags=["check"]
checked = stages_diagram.records(workdir, {report.stage: pipe.settings(report.stage, request) for report in reports})
assert list(checked) == ["text", "denoise", "decode"] and all(isinstance(record, dict) for record in checked.values())

# %% [markdown]
# A later stage refuses an input made for another request and says which setting differs.
# Here the decode stage is asked for seed 7 while `denoise.safetensors` was made with seed 42:

# %%
other = pipeline.Request(**{**request.__dict__, "seed": 7})
refused = expect(lambda: pipeline.run(other, options, preset=preset, stage="decode", workdir=workdir),
                 stages.StageError, max_lines=1)

# %% [markdown]
# A truncated file (a copy interrupted, a disk that filled up) is refused, never half-used:

# %%
tensor_file = stages.path(workdir, "denoise")
tensor_file.write_bytes(tensor_file.read_bytes()[:100])
truncated = expect(lambda: pipeline.run(request, options, preset=preset, stage="decode", force=True, workdir=workdir),
                   stages.StageError)

# %% tags=["check"]
assert [line.split(":")[1].strip().split(" ")[0] for line in log] == ["wrote"] * 4 + ["up"] * 3  # 3 stages and the mp4, then 3 skips
assert "seed=42 in the file, seed=7 in this run" in str(refused)
assert "checksum" in str(truncated)

# %% [markdown]
# ## 9. From a picture: image-to-video
#
# CogVideoX1.5-5B-I2V is the same transformer with one change at its input. The picture, encoded
# by the VAE into one latent frame and padded with zero frames to the video's length, enters
# *beside* the noisy latents, as extra channels: the patch embedding reads twice the latent
# channels, and the sequence the attention sees keeps its length. The 1.5 release also adds an
# `ofs` embedding to the timestep's (the stock pipeline passes the constant 2.0). Everything else
# (text, the denoising loop, the scheduler, the decode) is this notebook's.
#
# The pipeline adds one stage between text and denoise, `image`, whose file holds the picture's
# latents and is tied to the picture's bytes (a SHA-256 in its settings). Its randomness follows
# the stock order: the VAE's posterior is sampled with the first draws of `torch.Generator(seed)`,
# and the denoise stage skips those draws before drawing the noise. The picture is read as
# `diffusers.utils.load_image` reads it and resized by diffusers' own `VideoProcessor`, so a
# picture of any size and aspect (here 96x64, for a square video) is prepared exactly as stock.

# %%
from PIL import Image, ImageDraw

picture_path = scratch / "start.png"
picture = Image.new("RGB", (96, 64), (40, 70, 140))
ImageDraw.Draw(picture).ellipse((30, 12, 66, 48), fill=(230, 180, 40))
picture.save(picture_path)
i2v_source, i2v_label = family.model_source(preset, image_to_video=True)
i2v_configs = family.component_configs(i2v_source)
print("transformer input channels: text-to-video", t["in_channels"], "| image-to-video",
      i2v_configs["transformer"]["in_channels"], "| the VAE's latent channels", i2v_configs["vae"]["latent_channels"])
print("ofs embedding width:", i2v_configs["transformer"]["ofs_embed_dim"])

# %% [markdown]
# The four stages through `pipeline.run`, then the picture's latents beside the noise's shape,
# and the frames after the picture. With random weights the frames are noise again and do not
# carry the picture's disc: what to see is the picture first, then as many frames as the request
# asks at its size, and, in the next cell, that they equal stock diffusers' image-to-video frames.

# %%
i2v_request = dataclasses.replace(request, image=str(picture_path))
i2v_reports = pipeline.run(i2v_request, options, preset=preset, workdir=scratch / "i2v", log=lambda _: None)


def read(stage):  # a stage file of this run, checked against the settings it was made with
    settings = pipeline.CogVideoX.settings_for(i2v_label, i2v_configs, i2v_request, options, dtype, stage)
    return stages.read(scratch / "i2v", stage, settings).tensors


image_latents, i2v_latents = read("image")["image_latents"], read("denoise")["latents"]
i2v_frames = read("decode")["frames"].numpy()
print("stages:", ", ".join(r.stage for r in i2v_reports))
print("image latents", tuple(image_latents.shape), "| denoised latents", tuple(i2v_latents.shape),
      "| latent frames after the first that are zero:", int((image_latents[0, 1:] == 0).all(dim=(1, 2, 3)).sum()))
video.show_frames(i2v_frames, f"{label} image-to-video: a 96x64 picture -> {request.frames} frames at "
                  f"{request.width}x{request.height}", picture=np.asarray(picture))

# %% [markdown]
# The stock `CogVideoXImageToVideoPipeline`, same checkpoint, picture, prompt and seed
# (`pipeline.stock` builds it and its call; on the full preset the host cannot run the whole
# video, as in section 7):

# %%
if preset.host_runs_whole_models:
    stock_i2v, stock_call = pipeline.stock(i2v_source, i2v_request)
    with torch.no_grad():
        expected_i2v = stock_i2v(**stock_call).frames[0]
    i2v_error = float(np.abs(i2v_frames - expected_i2v).max())
    print("image-to-video frames: max abs difference from stock diffusers", results.error_text(i2v_error, 1e-4))
    del stock_i2v

# %% tags=["check"]
assert [r.stage for r in i2v_reports] == ["text", "image", "denoise", "decode"]
assert i2v_configs["transformer"]["in_channels"] == 2 * i2v_configs["vae"]["latent_channels"]
assert image_latents.shape == i2v_latents.shape and (image_latents[0, 1:] == 0).all()
if preset.host_runs_whole_models:
    assert expected_i2v.shape == i2v_frames.shape and i2v_error <= 1e-4
    assert i2v_frames.std() > 0.01

# %% [markdown]
# ## Takeaways
#
# - A diffusers pipeline becomes three compiled programs with files between them. The
#   denoising program is compiled once for all steps because the step index is an argument and
#   the scheduler's numbers are tables.
# - Randomness stays on the host, drawn from the same `torch.Generator` in the same order as
#   diffusers, so the TPU pipeline reproduces the stock pipeline frame for frame (float32,
#   section 7).
# - The denoising step is twenty lines: the guidance pair as a batch of 2 on `dp`, the
#   transformer over `tp`, guidance, the scheduler's update, the state donated (section 4). Its
#   `tp` split costs two all-reduces per block, visible in the compiled HLO.
# - The stock attention processor's in-place RoPE write came out wrong once the program was
#   split, in plain JAX too: XLA's partitioner, measured on this CPU (section 5). The family
#   module installs a processor that concatenates instead (`family.make_jit_friendly`); check
#   parity on the mesh you will run.
# - Stage files make a long job restartable and auditable: written atomically, refused when
#   they belong to another request, checked against a checksum.
# - Image-to-video is a fourth stage, not a second pipeline: the picture's latents enter as
#   channels beside the noise, drawn from the same generator in the stock order (section 9).
# - Whether the full model fits a v6e-8, and how fast it could run there, is the next
#   notebook's question, answered on this CPU host by compiling for the slice.
# - `tpupedia generate cogvideox` runs all of this from the command line, and the
#   [CogVideoX on a TPU VM](../guides/cogvideox-tpu-vm.md) guide gives the full-size commands.

# %% [markdown]
# ## Further reading
#
# - [Flow-matching schedulers](../kb/flow-matching.md): the other family of samplers, used by
#   HunyuanVideo-1.5 and Wan (notebooks `hunyuan_video` and `wan_on_tpu`).
# - [Decoding video on several chips](../kb/vae-decode.md): the decode of section 6 in depth.
# - [PyTorch on TPU: torch_xla, torchax and TorchTPU](../kb/torch-on-tpu.md): why this course
#   runs diffusers' modules through torchax.
# - [From upstream to this course](../kb/from-upstream.md): the upstream staged scripts each
#   section replaces.
# - [Corrections to the upstream material](../kb/corrections.md): the upstream claims this
#   notebook checks.
# - [CogVideoX on a TPU VM](../guides/cogvideox-tpu-vm.md): the full-size commands.

# %% [markdown]
# ## Self-check
#
# 1. Why does one compiled program serve all 50 denoising steps, and what would happen if the
#    step index were a static argument (`static_argnums`)?
#
#    <details><summary>Answer</summary>
#
#    The index `i` is a traced argument and every per-step number of the scheduler is a row of a
#    table indexed by it, so the program does not depend on the step. A static index is a
#    constant of the trace: every new value traces and compiles its own program, 50 compiles.
#
#    </details>
#
# 2. Why is the noise drawn on the host from `torch.Generator(seed)`, not with `jax.random`
#    inside the step?
#
#    <details><summary>Answer</summary>
#
#    To draw the same numbers in the same order as the stock pipeline, so the video matches
#    diffusers frame for frame (section 7). `jax.random` would give a correct video that no
#    diffusers run reproduces, and parity could no longer be checked.
#
#    </details>
#
# 3. The stock attention processor is right on one device. Why does the pipeline still replace
#    it, and what does that teach about checking a port?
#
#    <details><summary>Answer</summary>
#
#    Its in-place RoPE write becomes a `dynamic-update-slice` that XLA's SPMD partitioner got
#    wrong once the program was split over the mesh (an error of 0.06 where 1e-7 was expected).
#    Building the rotated tensor with a concatenation removes the update. Check parity on the
#    mesh you will run, not only on one device.
#
#    </details>
#
# 4. What does the `dp` axis buy the guided step, and what happens to it when guidance is off?
#
#    <details><summary>Answer</summary>
#
#    Each `dp` group computes one half of the guidance pair, so a guided step costs each chip
#    one sample, at the price of splitting the pair and combining the halves over `dp`. Without
#    guidance the batch of one cannot be split: both groups compute the same sample, so the step
#    does not get faster on this mesh (Exercise 3) unless the chips are used otherwise, for
#    example `tp` over all eight.
#
#    </details>
#
# 5. A denoise file made with seed 42 has the same shapes as one made with seed 7. What would
#    go wrong if the decode stage checked only shapes, and what else does it check?
#
#    <details><summary>Answer</summary>
#
#    It would decode latents of another request without a word and write a plausible, wrong
#    video. `stages.read` also compares the settings fingerprint (which names the setting that
#    differs) and the tensor file's checksum (which catches a truncated or edited file).
#
#    </details>
