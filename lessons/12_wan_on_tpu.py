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
# # 12 · Wan 2.1 and 2.2 on TPU
#
# Wan is the open video family every TPU project runs, so it is where this course meets the
# others. It is also the test of the course's own structure: a third family should need its
# model module, its pipeline, a scheduler step and this notebook, and nothing else
# (`tests/test_families.py` checks it). Everything notebooks `cogvideox_pipeline` and `hunyuan_video` built carries over: the
# stage files, the guidance pair as a batch on `dp`, one compiled step for all steps, parity
# with stock diffusers. This notebook teaches only what is new:
#
# 1. **the family in the registry**: one `FamilySpec`, and the command line grows a subcommand;
# 2. **UniPC**, a multistep predictor-corrector whose `step` keeps Python state, as a pure step;
# 3. **two experts** (Wan 2.2 A14B): two transformers, one compiled step each, switched on the host;
# 4. **a VAE whose cache is a Python list** of tensors, `None` and a string, compiled anyway;
# 5. the whole run against stock `WanPipeline`, and the full size planned for a v6e-8 (sections 5, 6);
# 6. **image-to-video** (section 7): the picture as channels beside the noise and as tokens beside the text.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | random 2-block Wan 2.1, Wan 2.2 (two experts) and Wan 2.1 I2V checkpoints written with `save_pretrained`, 8 simulated devices | about 2 GB of host RAM | about 65 s, measured here on a 2-core CPU (building the three tiny checkpoints the first time adds about 7 s) |
# | `full` (TPU v6e-8) | `Wan-AI/Wan2.1-T2V-14B-Diffusers`: a 14.3B-parameter transformer (28.6 GB in bf16, counted below), umT5-XXL (about 11 GB), the VAE | per chip: section 6 reads the plan compiled here for a v6e-8 | not measured here; none reported by the upstream project |
#
# On the full preset, sections 2 to 4 and section 7's run use the tiny sizes (the facts they
# teach do not depend on the checkpoint), and section 5 loads the release from the Hub: a TPU
# VM with about 100 GB of disk. *Reading time: about 23 minutes.*

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
# ## 1. A third family in the registry
#
# `tpupedia.models.wan` holds the family's facts and exports `SPEC`; the registry finds it. The
# command line, the dry-run, the plan and the docs read the registry, so `tpupedia generate wan`
# exists because the module does.

# %%
from tpupedia import cli, families
from tpupedia.models import wan as family

spec = families.get("wan")
print(spec.title)
print("video families:", families.names("video"))
print("sharding strategies:", spec.strategies, "| mask:", spec.mask, "| one layer's weights:", spec.layer_prefix)
subcommands = cli.build_parser()._subparsers._group_actions[0].choices["generate"]._subparsers._group_actions[0].choices
print("tpupedia generate:", sorted(subcommands))

# %% [markdown]
# The release's size, counted from its config on PyTorch's `meta` device (shapes, no memory):
# 40 blocks of width 5120 (40 heads of 128), self-attention over the video tokens,
# cross-attention to 512 text tokens, an FFN of 13,824.

# %%
import torch

transformer = family.build(device="meta")
n_params = sum(p.numel() for p in transformer.parameters())
print(f"Wan 2.1 T2V 14B transformer: {n_params / 1e9:.2f} B parameters, {2 * n_params / 1e9:.1f} GB in bf16")
flops = family.step_flops(1280, 720, 81)
print(f"720p, 81 frames: {flops['tokens']:,} video tokens per sample; one guided step {flops['total'] / 1e15:.1f} PFLOP "
      f"({flops['attention'] / flops['total']:.0%} in attention)")

# %% tags=["check"]
assert "wan" in families.names("video") and "wan" in subcommands
assert 14.0e9 < n_params < 14.5e9 and flops["tokens"] == 21 * 45 * 80

# %% [markdown]
# ## 2. UniPC as a pure step
#
# Wan's scheduler is UniPC on flow sigmas: each step *corrects* the sample the previous step
# predicted, using the new model output (UniC), then *predicts* the next one from the last two
# outputs (UniP). diffusers' `UniPCMultistepScheduler.step` keeps that history as Python state
# (`model_outputs`, `last_sample`, a warm-up counter) and picks each update's order in Python:
# first order on the first step and on the last, second order in between. A jitted step cannot
# keep Python state, and it cannot branch on the step index either.
#
# None of those decisions depends on the data, only on the step index. So
# `schedulers.unipc_tables` makes them once, on the host, with the stock code's own arithmetic,
# and stores the coefficients per step, one column per coefficient:

# %%
import jax
import jax.numpy as jnp
import numpy as np
from diffusers import UniPCMultistepScheduler

from tpupedia import results
from tpupedia.pipelines import schedulers

stock = UniPCMultistepScheduler(**family.SCHEDULER_CONFIG)
stock.set_timesteps(8)
host_tables = schedulers.unipc_tables(stock)
print("timesteps:", host_tables["timesteps"].astype(int).tolist())
print("predictor second order:", host_tables["p_two"].astype(int).tolist())
print("corrector runs:         ", host_tables["c_on"].astype(int).tolist())

# %% [markdown]
# The step is then a few multiply-adds, and the history the stock scheduler keeps on `self`
# becomes an argument and a result: `state = (last, m1, m2)`, the corrected sample of the step
# before and the last two model outputs converted to predictions of the clean sample (x0). Where
# diffusers writes `if order == 2:` or `if use_corrector:`, the pure step computes both sides and
# picks one with `jnp.where` on a table value: the step index is traced, so the branch cannot be
# Python. Here it is in full; `schedulers.unipc_step`, which the pipeline runs, is the same
# function.

# %%
def unipc_step(tables, i, sample, model_output, state):
    """`UniPCMultistepScheduler.step(model_output, timesteps[i], sample)` as a pure function of the
    step index `i`: returns `(next sample, next state)`. In float32, as the stock step on float32 latents."""
    c = {k: v[i] for k, v in tables.items() if k != "sigmas"}  # step i's row of each column (i is traced)
    last, m1, m2 = state  # zeros before the first step; the tables never read them there
    sample = sample.astype(jnp.float32)
    sigma = tables["sigmas"][i]
    # the model predicts a flow (velocity); x0 = sample - sigma * flow, the product in the output's dtype as in torch
    m = sample - (sigma.astype(model_output.dtype) * model_output).astype(jnp.float32)
    # UniC, the corrector: redo the previous step's update from `last`, now that this step's m is known
    corr_res = jnp.where(c["c_rho0"] != 0, c["c_rho0"] * ((m2 - m1) / c["c_rk"]), 0.0)  # second-order term
    corrected = (c["c_x"] * last - c["c_m0"] * m1) - c["c_q"] * (corr_res + c["c_rho1"] * (m - m1))
    x = jnp.where(c["c_on"] > 0, corrected, sample)  # step 0 has nothing to correct
    # UniP, the predictor: from x to the next sigma, second order with the previous prediction m1
    pred_res = jnp.where(c["p_two"] > 0, 0.5 * ((m1 - m) / c["p_rk"]), 0.0)
    new = (c["p_x"] * x - c["p_m0"] * m) - c["p_q"] * pred_res
    return new, (x, m, m1)  # the history shifts: x is the next `last`, m the next m1, m1 the next m2


# %% [markdown]
# The proof is step by step: feed the stock scheduler, this step and the package's the same
# random model outputs, and compare every sample. One compiled step serves all eight.

# %%
step, package_step = jax.jit(unipc_step), jax.jit(schedulers.unipc_step)


def step_by_step(stock, seed):
    """Run `stock`, the page's `step` and the package's on the same random model outputs: the max
    difference from the stock sample per step, and the largest difference from the package's step."""
    tables = {k: jnp.asarray(v) for k, v in schedulers.unipc_tables(stock).items()}
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(1, 4, 3, 8, 8, generator=g)
    ours, state = jnp.asarray(sample.numpy()), schedulers.unipc_state(tuple(sample.shape))
    theirs, their_state = ours, state
    errors, from_package = [], 0.0
    for i, t in enumerate(stock.timesteps):
        output = torch.randn(sample.shape, generator=g)
        sample = stock.step(output, t, sample, return_dict=False)[0]
        ours, state = step(tables, i, ours, jnp.asarray(output.numpy()), state)
        theirs, their_state = package_step(tables, i, theirs, jnp.asarray(output.numpy()), their_state)
        errors.append(float(np.abs(np.asarray(ours) - sample.numpy()).max()))
        for a, b in zip((ours, *state), (theirs, *their_state)):
            from_package = max(from_package, float(np.abs(np.asarray(a) - np.asarray(b)).max()))
    return errors, from_package


unipc_errors, unipc_from_package = step_by_step(stock, seed=0)
print(f"max abs difference from stock diffusers, worst of {len(unipc_errors)} steps:", results.error_text(max(unipc_errors)))
print("max abs difference from schedulers.unipc_step (samples and state):", unipc_from_package)
print("compiled once:", step._cache_size() == 1)

# %% tags=["check"]
assert max(unipc_errors) < 1e-5 and step._cache_size() == 1
assert unipc_from_package == 0.0  # the page's step and the package's give the same bits

# %% [markdown]
# ### Exercise 1: predict UniPC's tables for 5 steps, and what the compiled step does with them
#
# The tables above are for 8 steps. Build them for 5 steps and run the same step-by-step
# comparison with the jitted `step` of this section. **Predict** first: the `p_two` and `c_on`
# columns for 5 steps (which steps use the second-order predictor, which run the corrector), and
# whether `step` compiles again for the new tables or reuses its one program. Then open the
# solution, run it, and compare.

# %% tags=["solution"]
stock_5 = UniPCMultistepScheduler(**family.SCHEDULER_CONFIG)
stock_5.set_timesteps(5)
tables_5 = schedulers.unipc_tables(stock_5)
errors_5, from_package_5 = step_by_step(stock_5, seed=1)
print("predictor second order:", np.asarray(tables_5["p_two"]).astype(int).tolist())
print("corrector runs:        ", np.asarray(tables_5["c_on"]).astype(int).tolist())
print("max abs difference from the stock scheduler:", results.error_text(max(errors_5)))
print("programs compiled by `step` (8 steps, then 5):", step._cache_size())

# %% tags=["check"]
assert np.asarray(tables_5["p_two"]).astype(int).tolist() == [0, 1, 1, 1, 0]  # first order first and last
assert np.asarray(tables_5["c_on"]).astype(int).tolist() == [0, 1, 1, 1, 1]  # no corrector before any output
assert max(errors_5) < 1e-5 and from_package_5 == 0.0
assert step._cache_size() == 2  # tables of length 5 are new shapes: one more program, then reused for all 5 steps

# %% [markdown]
# ## 3. Two experts
#
# Wan 2.2 A14B splits the denoising between two transformers of the same shapes: `transformer`
# for the high-noise steps, `transformer_2` once the timestep falls below `boundary_ratio *
# 1000` (0.875 in the release's `model_index.json`), each with its own guidance scale. In one
# compiled program the switch would be a `lax.cond` over two 14B weight sets; the boundary is a
# host fact, like the step index, so the pipeline compiles one step per expert and the Python
# loop calls the right one. Both experts stay resident: 2 x 28.6 GB of bf16 weights, split over
# the 4 chips of `tp` and copied on both rows of `dp`, so about 14 GB per chip (the recorded
# v6e-8 plan's denoise stage holds 13.97 GiB of weights per chip).
#
# Where the switch falls depends on the schedule: the flow shift bends the timesteps towards
# high noise, so a larger shift gives the high-noise expert more of the steps. Over 40 steps:

# %%
two = family.full_configs(experts=2)
boundary = family.boundary_timestep(two)
split = {}
for shift in (3.0, 12.0):
    schedule = UniPCMultistepScheduler(**(family.SCHEDULER_CONFIG | {"flow_shift": shift}))
    schedule.set_timesteps(40)
    experts = ["high" if t >= boundary else "low" for t in schedule.timesteps.tolist()]
    split[shift] = experts.count("high")
    print(f"shift {shift:4}: boundary timestep {boundary:.0f}: {experts.count('high')} high-noise steps, "
          f"then {experts.count('low')} low-noise")

# %% tags=["check"]
assert family.experts(two) == ("transformer", "transformer_2") and 0 < split[3.0] < split[12.0] < 40

# %% [markdown]
# ## 4. A VAE whose cache is a Python list
#
# `AutoencoderKLWan` decodes one latent frame at a time. Its causal convolutions carry the last
# frames of their input to the next call through `feat_cache`, a Python list the modules write
# into, whose entries are tensors, `None` (nothing yet) or the string `"Rep"` (an upsampler's
# first call). `jax.jit` takes arrays, not strings, and cannot see writes into a list.
#
# `pipelines.wan.decode_frames` splits the list in two: the tensors become arguments and
# results, and the *markers* (tensor, `None`, `"Rep"`) become static arguments. The markers a
# call leaves depend only on the markers it was given, so the layout settles after two frames:
# three compiled programs decode any number of frames (first, second, the rest).
#
# One more change, found when the plan of section 6 compiled the release's bf16 VAE: diffusers'
# `WanUpsample` upsamples in float32 and casts back, and under torchax the convolution after it
# then refuses its input ("Input type (float) and bias type (c10::BFloat16) should be the same").
# The upsampling is nearest-neighbour, which copies values, so doing it in bf16 gives the same
# bits: `models.wan.make_vae_jit_friendly` does that.

# %%
from tpupedia import devices
from tpupedia.pipelines import wan as pipeline

checkpoint_21 = family.tiny_checkpoint(experts=1)
checkpoint_22 = family.tiny_checkpoint(experts=2)
request = pipeline.Request(prompt="A panda plays an acoustic guitar in a bamboo forest.", frames=17, height=64,
                           width=64, steps=4, guidance=5.0, guidance_2=3.0, seed=42, fps=8)
mesh = devices.make_mesh((2, 4), ("dp", "tp"))
pipe = pipeline.Wan(str(checkpoint_22), "tiny 2.2", torch.float32, mesh, pipeline.Options(quiet=True))
latents = torch.from_numpy(np.random.default_rng(0).standard_normal((1, 4, 5, 8, 8)).astype("float32"))
decoded, _ = pipe.decode(request, latents)
print("5 latent frames ->", tuple(decoded["frames"].shape), "frames; decoder programs traced:", pipe.traces["decode"])

# %% tags=["check"]
assert tuple(decoded["frames"].shape) == (17, 64, 64, 3) and pipe.traces["decode"] == 3

# %% [markdown]
# The split itself is two list comprehensions. Here they are, run in eager PyTorch on the host
# with the same checkpoint's VAE over the first three latent frames: `join_cache` builds the
# list the modules expect, the decoder writes into it, `split_cache` takes it apart again. The
# printout is the markers (`T` tensor, `N` `None`, `R` `"Rep"`) and how many frames the cached
# tensors hold.

# %%
from diffusers import AutoencoderKLWan


def split_cache(cache):
    """feat_cache -> (markers, tensors): a hashable tuple (a static argument) and the tensors (traced)."""
    markers = tuple("T" if torch.is_tensor(c) else ("N" if c is None else "R") for c in cache)
    return markers, [c for c in cache if torch.is_tensor(c)]


def join_cache(markers, tensors):
    """(markers, tensors) -> the feat_cache list the VAE's modules read and write."""
    tensors = iter(tensors)
    return [next(tensors) if m == "T" else (None if m == "N" else "Rep") for m in markers]


host_vae = AutoencoderKLWan.from_pretrained(checkpoint_22, subfolder="vae")
markers, tensors = ("N",) * host_vae._cached_conv_counts["decoder"], []  # empty: one None per causal conv
with torch.no_grad():
    for k in range(3):
        cache = join_cache(markers, tensors)
        host_vae.decoder(host_vae.post_quant_conv(latents[:, :, k:k + 1]), feat_cache=cache, feat_idx=[0],
                         first_chunk=k == 0)  # writes into `cache`
        markers, tensors = split_cache(cache)
        print(f"after frame {k}: {''.join(markers)}; cached frames {sorted({t.shape[2] for t in tensors})}")
        if k == 0:
            first_cache, first_markers, first_tensors = cache, markers, tensors

# %% [markdown]
# After the first frame two upsamplers have left `"Rep"` and the cached tensors hold one frame;
# after the second, the markers and the shapes no longer change. That is the three programs. The
# package does the same inside `pipelines.wan._frame`, the function its compiled program traces;
# run eagerly on the first frame, it leaves the same markers and the same tensors:

# %%
package_layouts = {}
with torch.no_grad():
    _, package_tensors = pipeline._frame(host_vae, latents[:, :, :1], [], ("N",) * len(first_markers), True,
                                         package_layouts)
package_markers = package_layouts[("N",) * len(first_markers), True]
print("same markers as the package:", package_markers == first_markers, "|", len(package_tensors), "tensors")

# %% tags=["check"]
rebuilt = join_cache(*split_cache(first_cache))  # the round trip gives back the very list the decoder wrote
assert len(rebuilt) == len(first_cache) and all(a is b or a == b for a, b in zip(rebuilt, first_cache))
assert package_markers == first_markers and "R" in first_markers and "N" in first_markers
assert len(package_tensors) == len(first_tensors)
for ours_t, package_t in zip(first_tensors, package_tensors):
    np.testing.assert_array_equal(ours_t.numpy(), package_t.numpy())

# %% [markdown]
# Wan 2.2 TI2V-5B takes the same code path with two differences, both read from its configs:
# `expand_timesteps` in `model_index.json` (each latent token gets its own timestep, so the step
# builds a per-token timestep tensor instead of one number) and a VAE with residual blocks that
# packs 2x2 pixels into 12 channels and compresses 16x in space (its `vae/config.json`:
# `is_residual`, `patch_size`, `scale_factor_spatial`). `decode_frames` unpatchifies as diffusers
# does. `tests/test_wan.py` builds that layout at tiny size and checks its frames against stock
# `WanPipeline` within 1e-4.

# %% [markdown]
# ### Exercise 2: predict the latents of a frame count, from the VAE's rule
#
# Five seconds at 16 frames per second is 80 frames. The VAE keeps the first frame and folds each
# later group of `temporal` frames into one latent frame; `family.shape_facts` reads `spatial`,
# `temporal` and the latent channels from a checkpoint's configs. **Predict** first: does
# `family.check_frames` accept 80 frames, and if not, what would diffusers round it down to? And
# the latent shape `(1, C, T, H, W)` of 81 frames for Wan2.1-T2V-14B at 1280x720 and for
# Wan2.2-TI2V-5B at 1280x704 (its own VAE). Then open the solution, run it, and compare.

# %% tags=["solution"]
from tpupedia.models import ModelInputError

releases = {"Wan2.1-T2V-14B at 1280x720": (family.full_configs(), 720, 1280),
            "Wan2.2-TI2V-5B at 1280x704": (family.full_configs(size="5B"), 704, 1280)}
latent_shapes = {}
for name, (configs, height, width) in releases.items():
    release_facts = family.shape_facts(configs)
    latent_shapes[name] = family.latent_shape(81, height, width, release_facts)
    print(f"{name}: VAE {release_facts.spatial}x in space, {release_facts.temporal}x in time, "
          f"{release_facts.latent_channels} channels -> 81 frames give latents {latent_shapes[name]}")
try:
    family.check_frames(80, release_facts)
    refused = None
except ModelInputError as err:
    refused = str(err)
print("80 frames:", refused)

# %% tags=["check"]
assert latent_shapes["Wan2.1-T2V-14B at 1280x720"] == (1, 16, 21, 90, 160)  # (81 - 1) / 4 + 1 = 21
assert latent_shapes["Wan2.2-TI2V-5B at 1280x704"] == (1, 48, 21, 44, 80)  # 16x in space
assert refused is not None and refused.endswith("round 80 down to 77")  # 4 * 19 + 1

# %% [markdown]
# ## 5. The whole run against stock diffusers
#
# Text, denoise and decode through `pipeline.run`, then stock `WanPipeline(output_type="np")`
# from the same checkpoint, prompt and seed. Both tiny checkpoints: Wan 2.1, and Wan 2.2 with
# two experts and two guidance scales. float32: the frames agree to 1e-4, and in practice within
# 1e-5, which is what the cell prints: the last digits change from run to run, because the
# simulated devices' all-reduces add their partial sums in the order the threads arrive.

# %%
import dataclasses
import tempfile

from diffusers import WanPipeline
from safetensors.numpy import load_file

from tpupedia import results

parity = {}
for name, checkpoint, guidance_2 in (("Wan 2.1", checkpoint_21, None), ("Wan 2.2", checkpoint_22, 3.0)):
    request = dataclasses.replace(request, guidance_2=guidance_2)  # a second scale only for a second expert
    with tempfile.TemporaryDirectory() as workdir:
        reports = pipeline.run(request, pipeline.Options(quiet=True), preset=preset, model=str(checkpoint),
                               workdir=workdir, log=lambda _: None)
        frames = load_file(f"{workdir}/decode.safetensors")["frames"]
    stock_pipe = WanPipeline.from_pretrained(checkpoint, dtype=torch.float32)
    stock_pipe.set_progress_bar_config(disable=True)
    expected = stock_pipe(prompt=request.prompt, negative_prompt="", num_frames=request.frames, height=64, width=64,
                          num_inference_steps=request.steps, guidance_scale=request.guidance,
                          guidance_scale_2=request.guidance_2, generator=torch.Generator().manual_seed(request.seed),
                          output_type="np").frames[0]
    per_expert = {r.stage: r for r in reports}["denoise"].timings["steps_per_expert"]
    parity[name] = float(np.abs(frames - expected).max())
    print(f"{name}: steps per expert {per_expert}; max abs difference from stock WanPipeline "
          f"{results.error_text(parity[name])}")

# %% tags=["check"]
assert all(error < 1e-4 for error in parity.values())

# %% [markdown]
# ## 6. The full size, planned for a v6e-8
#
# `tpupedia plan wan` compiles every program of a `generate wan --preset full` run for a TPU
# topology ahead of time, from the release's configs (notebook `plan_without_tpu`): the umT5 encoder, the
# denoising step at 720p and 81 frames, the VAE's three frame programs. Compiling the full
# depth on a CPU host takes long, so the recorded plan compiles one layer per model and adds
# the other layers' weight shards from their shapes. On the tiny preset this cell reads the
# record (`docs/results/plans.json`); on the full preset it compiles.
#
# The plan also settles a question of precision. Diffusers' Wan examples load the VAE (and, for
# image-to-video, the CLIP tower) in float32 beside a bf16 pipeline, and a run here does the same
# (`models.wan.FLOAT32_COMPONENTS`). A float32 decode holds twice the activations of a bf16 one,
# so the plan compiles the VAE's programs in float32 first, and runs the VAE in bf16 only if
# float32 does not fit a chip, with a note that says what float32 would need. At 720p and 81
# frames it fits.

# %%
from pathlib import Path

from tpupedia import plan

if preset.pretrained:
    full_request = pipeline.Request(prompt="a video", **family.default_request(preset))
    wan_plan = plan.make("wan", full_request, pipeline.Options(), topology="v6e:2x4", layers=1).as_dict()
else:
    wan_plan = next(r for r in results.load(Path("..") / plan.DEFAULT_RECORDS)
                    if r.get("checkpoint") == family.FULL_ID and r["topology"] == "v6e:2x4" and r["layers"] == 1
                    and [s["stage"] for s in r["stages"]] == ["text", "denoise", "decode"])
for stage in wan_plan["stages"]:
    print(f"{stage['stage']:8} peak {stage['peak'] / 2**30:6.2f} GiB per chip (weights {stage['weights'] / 2**30:.2f} GiB)")
print("binding stage:", wan_plan["binding"], "| fits:", wan_plan["fits"])
vae_dtype = wan_plan["request"].get("vae_dtype", family.component_dtype("vae", "bfloat16"))
print("the VAE runs in", vae_dtype, *[f"({n})" for n in wan_plan["notes"] if n.startswith("VAE in")])

# %% tags=["check"]
assert wan_plan["fits"] and all(s["peak"] <= wan_plan["hbm"] for s in wan_plan["stages"])
assert vae_dtype == "float32" or any(n.startswith(f"VAE in {vae_dtype}") for n in wan_plan["notes"])  # stock, or why not

# %% [markdown]
# ## 7. From a picture: image-to-video
#
# Wan's image-to-video releases (Wan2.1-I2V-14B, Wan2.2-I2V-A14B) are the same transformer with a
# wider input. Beside its 16 noisy channels, each latent frame gets 4 *mask* channels and the 16
# channels of the picture's latents. Those latents come from the VAE encoding the picture
# followed by black frames, the whole video's length; the mask says which pixel frames were
# given. The VAE folds the first frame alone into latent frame 0 and 4 frames into each later
# one, so the mask repeats the first frame 4 times: 4 channels per latent frame, all ones in
# frame 0, zeros after. The sequence the self-attention sees keeps its length: 36 channels in,
# 16 out.
#
# Wan 2.1's I2V also looks at the picture through CLIP, a ViT-H/14 vision tower: its penultimate
# hidden states (257 tokens at 224 px) are projected and put in front of the 512 text tokens
# that every block's cross-attention reads, with key and value projections of their own. Wan
# 2.2's I2V has no image encoder. Nothing random is drawn for the picture (the stock pipeline
# takes the VAE posterior's mean), so the noise is the text-to-video run's.

# %%
i2v_checkpoint = family.tiny_checkpoint(image_to_video=True)
i2v_configs = family.component_configs(str(i2v_checkpoint))
facts = family.shape_facts(i2v_configs)
for name, configs in (("tiny", i2v_configs), ("Wan2.1-I2V-14B", family.full_configs(image_to_video=True))):
    t, clip = configs["transformer"], configs["image_encoder"]
    clip_tokens = (clip["image_size"] // clip["patch_size"]) ** 2 + 1  # patches and the class token
    print(f"{name:15} input channels {t['in_channels']} = {configs['vae']['z_dim']} noisy + {facts.temporal} mask + "
          f"{configs['vae']['z_dim']} picture, out {t['out_channels']}; cross-attention keys {clip_tokens} picture "
          f"+ {family.TEXT_TOKENS} text tokens")
mask = family.condition_mask(request.frames, 1, 1, facts)[0, :, :, 0, 0]
print(f"mask for {request.frames} frames (channel x latent frame):\n{mask.int().numpy()}")

# %% [markdown]
# The pipeline adds an `image` stage between text and denoise, as CogVideoX's does (notebook `cogvideox_pipeline`
# §9). Its file holds the condition (mask and picture latents) and the CLIP features, and its
# settings hold the picture's SHA-256, so another picture at the same path reruns it. The VAE's
# encoder runs as its decoder does in section 4: the first frame, then 4 frames at a time, the
# causal cache carried between three compiled programs. A 96x64 picture (a yellow disc on blue),
# for a 64x64 video.
#
# What to expect in the figure: the picture on the left, then five of the 17 frames, which are
# coloured noise and look nothing like the picture. The tiny checkpoint's weights are random, so
# its transformer and its VAE decoder draw nothing; the figure shows only that the run made 17
# frames of 64x64. Whether they are the right frames is what the comparison after it settles.

# %%
from PIL import Image, ImageDraw

from tpupedia import video
from tpupedia.pipelines import stages

scratch = Path(tempfile.mkdtemp())
picture = Image.new("RGB", (96, 64), (40, 70, 140))
ImageDraw.Draw(picture).ellipse((30, 12, 66, 48), fill=(230, 180, 40))
picture.save(scratch / "start.png")
i2v_request = dataclasses.replace(request, image=str(scratch / "start.png"), guidance_2=None)  # one expert
i2v_reports = pipeline.run(i2v_request, pipeline.Options(quiet=True), preset=preset, model=str(i2v_checkpoint),
                           workdir=scratch / "i2v", log=lambda _: None)


def read(stage):  # a stage file of this run, checked against the settings it was made with
    settings = pipeline.Wan.settings_for(str(i2v_checkpoint), i2v_configs, i2v_request, pipeline.Options(),
                                         torch.float32, stage)
    return stages.read(scratch / "i2v", stage, settings).tensors


image_stage, i2v_frames = read("image"), read("decode")["frames"].numpy()
print("stages:", ", ".join(r.stage for r in i2v_reports))
print("condition", tuple(image_stage["condition"].shape), "| CLIP features", tuple(image_stage["image_embeds"].shape))
video.show_frames(i2v_frames, f"tiny Wan 2.1 I2V: a 96x64 picture -> {request.frames} frames at 64x64",
                  picture=np.asarray(picture))

# %% [markdown]
# What counts is that these frames are the stock pipeline's. The stock
# `WanImageToVideoPipeline`, same checkpoint, picture, prompt and seed (`pipeline.stock` builds
# it and its call; on the full preset the host cannot run the whole video):

# %%
if preset.host_runs_whole_models:
    stock_i2v, stock_call = pipeline.stock(str(i2v_checkpoint), i2v_request)
    with torch.no_grad():
        expected_i2v = stock_i2v(**stock_call).frames[0]
    i2v_error = float(np.abs(i2v_frames - expected_i2v).max())
    print("image-to-video frames: max abs difference from stock diffusers", results.error_text(i2v_error, 1e-4))
    del stock_i2v

# %% tags=["check"]
assert [r.stage for r in i2v_reports] == ["text", "image", "denoise", "decode"]
assert i2v_configs["transformer"]["in_channels"] == 2 * facts.latent_channels + facts.temporal
assert mask[:, 0].min() == 1 and mask[:, 1:].max() == 0
assert image_stage["condition"].shape[1] == facts.temporal + facts.latent_channels
if preset.host_runs_whole_models:
    assert expected_i2v.shape == i2v_frames.shape and i2v_error <= 1e-4

# %% [markdown]
# At full size the image stage adds the CLIP tower (one 224 px picture) and the VAE's encoder
# over all 81 frames at 720p to the plan, both in float32 as in section 6; `tpupedia plan wan --image PICTURE` compiles them with
# the other stages. Wan2.2-I2V-A14B has no CLIP tower and two experts; its configs are built in
# as well, so `tpupedia plan wan --model Wan-AI/Wan2.2-I2V-A14B-Diffusers --image PICTURE` plans
# it without a download. The two records, read as in section 6:

# %%
i2v_releases = [family.FULL_ID_I2V, family.FULL_ID_22_I2V]
if preset.pretrained:
    full_i2v = dataclasses.replace(full_request, image=str(scratch / "start.png"))
    i2v_plans = {m: plan.make("wan", full_i2v, pipeline.Options(), model=m, topology="v6e:2x4", layers=1).as_dict()
                 for m in i2v_releases}
else:
    recorded = results.load(Path("..") / plan.DEFAULT_RECORDS)
    i2v_plans = {m: next(r for r in recorded if r.get("checkpoint") == m and r["topology"] == "v6e:2x4")
                 for m in i2v_releases}
for model, i2v_plan in i2v_plans.items():
    print(f"{model}: binding stage {i2v_plan['binding']}, fits: {i2v_plan['fits']}")
    for stage in i2v_plan["stages"]:
        programs = "; ".join(p["name"] for p in stage["programs"] if stage["stage"] in ("image", "denoise"))
        print(f"  {stage['stage']:8} peak {stage['peak'] / 2**30:6.2f} GiB per chip (weights "
              f"{stage['weights'] / 2**30:.2f} GiB){'  ' + programs if programs else ''}")

# %%
for model, i2v_plan in i2v_plans.items():
    assert i2v_plan["fits"] and [s["stage"] for s in i2v_plan["stages"]] == ["text", "image", "denoise", "decode"]
    assert "vae_dtype" not in i2v_plan["request"]  # the VAE in float32, as stock loads it: the plan did not lower it
names = {(m, s["stage"]): [p["name"] for p in s["programs"]] for m, r in i2v_plans.items() for s in r["stages"]}
assert any("CLIP" in n for n in names[family.FULL_ID_I2V, "image"])
assert not any("CLIP" in n for n in names[family.FULL_ID_22_I2V, "image"])  # Wan 2.2 I2V: the picture's latents only
assert len(names[family.FULL_ID_I2V, "denoise"]) == 1 and len(names[family.FULL_ID_22_I2V, "denoise"]) == 2  # experts

# %% [markdown]
# Without CLIP, Wan 2.2's image stage is the VAE encoder alone. Its denoise holds both experts'
# weights at once (the step switches expert on the host, section 3), so that stage peaks close
# to the decode, which binds both runs.

# %% [markdown]
# ## Takeaways
#
# - A third family is a model module, a pipeline module and a scheduler step; the registry
#   gives it a command (section 1).
# - A solver with Python state (UniPC) becomes a pure step by carrying that state as arguments
#   (section 2); two experts are two compiled steps picked on the host (section 3).
# - A cache held in a Python list of tensors, `None` and strings compiles once its tensors are
#   arguments and its markers static (section 4); the encoder's cache works the same way (section 7).
# - Image-to-video is a stage, not a second pipeline: the picture enters as channels beside the
#   noise and, for Wan 2.1, as tokens beside the text (section 7).

# %% [markdown]
# ## Self-check
#
# 1. UniPC's stock `step` picks its order and keeps its history in Python. Why can one jitted
#    step still reproduce it exactly?
#
#    <details><summary>Answer</summary>
#
#    Every decision depends on the step index only, never on the data, so `unipc_tables` makes
#    them on the host once and stores the coefficients per step. The history (the corrected sample
#    and the last two predictions) becomes an argument and a result of the step.
#
#    </details>
#
# 2. Why does Wan 2.2 compile one step per expert instead of one step with a `lax.cond` between
#    the two transformers?
#
#    <details><summary>Answer</summary>
#
#    Which expert runs depends only on the timestep against the boundary, a host fact known before
#    the loop. A `lax.cond` would put both 14B weight sets and both branches in one program for no
#    gain; two programs picked by the Python loop are simpler and each is compiled once.
#
#    </details>
#
# 3. What would happen to the high-noise expert's share of the steps if you raised the flow shift,
#    and why?
#
#    <details><summary>Answer</summary>
#
#    It would grow: the shift bends the timesteps towards high noise, so more of them stay above
#    the boundary timestep (`boundary_ratio * 1000`). Section 3 shows more high-noise steps at
#    shift 12 than at 3 over the same 40 steps.
#
#    </details>
#
# 4. The VAE's `feat_cache` holds tensors, `None` and the string `"Rep"`. How does the decoder
#    still run as compiled programs, and why are three enough for any number of frames?
#
#    <details><summary>Answer</summary>
#
#    The tensors become arguments and results, and the markers (tensor, `None`, `"Rep"`) become
#    static arguments. The markers a call leaves depend only on the markers it received, so the
#    layout is the same from the third frame on: one program for the first frame, one for the
#    second, one for all the rest.
#
#    </details>
#
# 5. In Wan 2.1's image-to-video, the transformer takes 36 input channels but returns 16. What are
#    the other 20, and why does the self-attention sequence not get longer?
#
#    <details><summary>Answer</summary>
#
#    4 mask channels (one per pixel frame folded into a latent frame) and the 16 channels of the
#    picture's latents, stacked beside the noise in each latent frame. They widen every token
#    instead of adding tokens, so the sequence keeps its length; the CLIP tokens go to the
#    cross-attention beside the text.
#
#    </details>
