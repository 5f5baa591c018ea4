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
# # 14 · Fewer, cheaper steps: LoRA adapters, few-step releases, step caches
#
# A video's cost is, to first order, the number of transformer calls times the cost of one. A
# stock run of 50 steps with classifier-free guidance makes 100 calls. What people actually run
# to afford video cuts one factor or the other:
#
# 1. **where the time goes**: transformer calls per video, counted for each family's defaults and
#    releases;
# 2. **a LoRA adapter**, the file format most few-step releases ship in: written here, refused
#    when it does not fit, fused into the weights on the host before they are sharded, and equal to
#    stock diffusers with the same adapter;
# 3. **few-step releases**: Wan 2.2 with its Lightning adapters and HunyuanVideo-1.5's
#    step-distilled checkpoints, each a table of defaults in its family's module;
# 4. **step caches**: keep most steps but skip most of each one, as a schedule fixed on the host
#    (two compiled programs, as notebook `hunyuan_tuning_and_i2v` did for DeepCache), picked from
#    a calibration run, equal to diffusers' own hooks, and bounded by the programs' FLOPs.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | notebook `cogvideox_pipeline`'s random 2-layer CogVideoX checkpoint, 8 simulated devices; adapters written here from the configs | about 1 GB of host RAM | about 45 s, measured here on a 2-core CPU (about half of it section 5's TPU compiles) |
# | `full` (TPU v6e-8) | `zai-org/CogVideoX1.5-5B` (sizes in notebook `cogvideox_pipeline`'s header); its transformer on the host in float32 in section 2 and exercise 2, to fuse adapters and compare them with the formula (about 22 GB each time) | per chip as notebook `cogvideox_pipeline`'s stages; the comparisons with stock diffusers run on the tiny preset only | the adapter run and the calibrated step-cache run each make a 50-step 720p video (about 107 s per video reported upstream, TPU v6e-8; calibration runs every step twice); the saved-calibration section runs the denoise stage three more times, one calibration among them |
#
# The full preset downloads `zai-org/CogVideoX1.5-5B`, released under the **CogVideoX LICENSE**
# (linked from its model card on the Hugging Face Hub): read it before you run the full preset.
#
# *Reading time: about 28 minutes.*

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
# ## 1. Where the time goes: transformer calls per video
#
# Every denoising step calls the transformer once per branch of classifier-free guidance: twice
# with guidance on (the prompt and the negative prompt, one batch of 2 on the `dp` axis since
# notebook `cogvideox_pipeline`), once with it off. diffusers turns guidance on when its scale is
# above 1. The text encoder and the VAE run once per video, so the calls are the bill. Here they
# are for each family's full-size default and for the few-step releases the family modules
# describe (section 3 says where each default comes from):

# %%
from tpupedia import families, presets
from tpupedia.results import error_text, measured_text  # digits vary by CPU: printed against the bound

full_preset = presets.get("full")  # the full-size defaults, whichever preset runs this notebook


def transformer_calls(steps, guidance):
    """Transformer calls for a video: one per step and guidance branch."""
    return steps * (2 if guidance > 1 else 1)


rows = []
for spec in families.video():
    stock = spec.facts.default_request(full_preset)
    guidance = stock.get("guidance")
    if guidance is None:  # HunyuanVideo-1.5 takes its scale from the checkpoint's guider config
        guidance = spec.facts.full_configs()["guider"]["guidance_scale"]
    rows.append((spec.name, "stock default", stock["steps"], guidance))
    for release in spec.few_step.values():
        rows.append((spec.name, f"--release {release.name}", release.steps, release.guidance))
print(f"{'family':10} {'run':26} {'steps':>5} {'guidance':>8} {'calls':>5}")
for name, run, steps, guidance in rows:
    print(f"{name:10} {run:26} {steps:>5} {'on' if guidance > 1 else 'off':>8} {transformer_calls(steps, guidance):>5}")

# %% [markdown]
# Wan's Lightning release makes 4 calls where the stock default makes 100: 25 times fewer, at the
# same cost per call. A step cache (section 4) keeps the 100 calls but makes most of them cheap.
# The two multiply only in principle: a 4-step schedule has few neighbouring steps alike enough to
# share work. CogVideoX has no few-step release among the family's facts; its route is the cache.

# %% tags=["check"]
calls = {(name, run): transformer_calls(steps, guidance) for name, run, steps, guidance in rows}
assert calls[("wan", "stock default")] == 100 and calls[("wan", "--release lightning")] == 4
assert calls[("hunyuan", "--release step-distilled")] == 8 and calls[("hunyuan", "--release step-distilled-4")] == 4
assert all(spec.few_step == {} for spec in families.video() if spec.name == "cogvideox")

# %% [markdown]
# ### Exercise 1: predict the calls for a release you configure yourself
#
# Wan 2.2's A14B checkpoint has two experts, and `guidance_2` is the scale of the low-noise one:
# guidance can be on for one expert and off for the other. Take 8 steps with the high-noise expert
# on the first 3 of them at guidance 3.5, and the low-noise expert on the other 5 at guidance 1.
# **Predict** the transformer calls, then the ratio to the stock default's 100. Then run the
# solution.

# %% tags=["solution"]
high, low = transformer_calls(3, 3.5), transformer_calls(5, 1.0)
print(f"high-noise expert: {high} calls, low-noise expert: {low} calls, {high + low} in all; "
      f"{calls[('wan', 'stock default')] / (high + low):.1f}x fewer than the stock default")

# %% tags=["check"]
assert (high, low) == (6, 5) and high + low == 11

# %% [markdown]
# ## 2. A LoRA adapter, fused before the weights are sharded
#
# A LoRA adapter (Hu et al., 2021) changes a linear layer's weight `W` (shape `(out, in)`, torch's
# layout) by a low-rank product: `W + scale * (alpha / r) * B @ A`, with `A` of shape `(r, in)`
# and `B` of shape `(out, r)`. A file holds `A` and `B` for each adapted layer and `alpha` in its
# header; `scale` is the user's. At rank 64 a 3072 x 3072 projection (CogVideoX1.5-5B's attention)
# stores 393,216 numbers instead of 9,437,184.
#
# There are two ways to run one. PEFT keeps `A` and `B` as extra layers and adds `x @ A.T @ B.T`
# on every call: cheap to switch adapters, but more matmuls per step, and the extra layers'
# names (`to_q.lora_A.default`) match none of the family's sharding rules, so their weights would
# be replicated. Fusing adds `B @ A` into `W` once: no cost per step, and after the adapter layers
# are unloaded the transformer has its original names and shapes, so the sharding table places it
# exactly as it places the stock weights. The fuse runs on the host, before the weights are
# sharded, so it needs host memory for the transformer (which the pipeline loads there anyway)
# and no device memory at all. The price: another adapter is another transformer to load.
#
# First an adapter file. Nothing can be downloaded here, so this one is written from the
# checkpoint's config: the transformer built on PyTorch's `meta` device has every layer's shape
# and no weights, and a random `A` and `B` per adapted layer go into a safetensors file in the
# layout diffusers' loaders read (`transformer.<layer>.lora_A.weight`), with `alpha` in the
# header as diffusers' `save_lora_weights` writes it.

# %%
import json
import tempfile
from pathlib import Path

import diffusers
import torch
from peft import LoraConfig
from safetensors.torch import save_file

from tpupedia.models import cogvideox as family

source, label = family.model_source(preset)
configs = family.component_configs(source)  # configs only: no weights read
os.chdir(tempfile.mkdtemp(prefix="tpupedia-14-"))  # a folder for this notebook's files, named short below


def shapes_only(configs, component="transformer"):
    """The checkpoint's transformer on the `meta` device: every layer's shape, no weights."""
    with torch.device("meta"):
        return getattr(diffusers, family.TRANSFORMER_CLASS).from_config(
            {k: v for k, v in configs[component].items() if not k.startswith("_")})


def write_adapter(path, transformer, targets, rank, alpha, seed=0):
    """A random adapter of `rank` on the linear layers whose names end in `targets`."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, layer in transformer.named_modules():
        if isinstance(layer, torch.nn.Linear) and name.endswith(targets):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=generator) / rank
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator) / 10
    header = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)).to_dict()
    header = {f"transformer.{k}": sorted(v) if isinstance(v, set) else v for k, v in header.items()}
    save_file(state, str(path), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(header)})
    return path


RANK, ALPHA = 4, 8  # alpha / r = 2
adapter_file = write_adapter(Path("style.safetensors"), shapes_only(configs), ("attn1.to_q", "attn1.to_v", "ff.net.2"),
                             RANK, ALPHA)
print(f"{adapter_file.name}: {adapter_file.stat().st_size:,} bytes")

# %% [markdown]
# An adapter is named on the command line as `PATH[:SCALE][@COMPONENT]`
# (`generate cogvideox --lora style.safetensors:0.8`); `@transformer_2` sends it to Wan 2.2's
# low-noise expert. `tpupedia.lora.parse` reads that form:

# %%
from tpupedia import lora

adapter = lora.parse(f"{adapter_file}:0.8")
print(adapter.scale, adapter.component)

# %% [markdown]
# What goes wrong with adapters is mostly that one does not fit: written for another family,
# another model size, or with half of a pair missing. `lora.check` reads the file's keys and
# shapes against the transformer built on `meta` and refuses a misfit in one line, naming it,
# before any weight loads. An adapter for a model twice as wide:

# %%
from tpupedia.errors import expect

wider = {**configs, "transformer": {**configs["transformer"],
                                    "attention_head_dim": 2 * configs["transformer"]["attention_head_dim"]}}
other_size = write_adapter(Path("other-size.safetensors"), shapes_only(wider), ("attn1.to_q",), RANK, ALPHA)
misfit = expect(lambda: lora.check([lora.Adapter(str(other_size))], family, configs), lora.LoraError, max_lines=1)

# %% [markdown]
# A scale that is not a number, and a file that is not safetensors (a pickle can run code as it
# loads, so none is read), are refused the same way:

# %%
_ = expect(lambda: lora.parse(f"{adapter_file}:strong"), lora.LoraError, max_lines=1)
pickled = Path("style.bin")
pickled.write_bytes(b"not read")
_ = expect(lambda: lora.check([lora.Adapter(str(pickled))], family, configs), lora.LoraError, max_lines=1)

# %% [markdown]
# The fuse. `lora.fuse` reads the file with the family's diffusers loader (which also converts
# the community key layouts diffusers knows), fuses each adapter with its scale and unloads the
# adapter layers. One layer checked by hand against the formula:

# %%
from safetensors.torch import load_file

from tpupedia.models import checkpoints


def host_transformer():
    """The checkpoint's transformer on the host, in float32."""
    return checkpoints.load_component(getattr(diffusers, family.TRANSFORMER_CLASS), source, "transformer",
                                      dtype=torch.float32)


plain = host_transformer()
before = {k: v.clone() for k, v in plain.state_dict().items()}
fused = lora.fuse(plain, [adapter], family)
after = fused.state_dict()

layer = "transformer_blocks.0.attn1.to_q"
A = load_file(adapter_file)[f"transformer.{layer}.lora_A.weight"]
B = load_file(adapter_file)[f"transformer.{layer}.lora_B.weight"]
by_hand = before[f"{layer}.weight"] + adapter.scale * (ALPHA / RANK) * B @ A
fuse_error = float((after[f"{layer}.weight"] - by_hand).abs().max())
changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
print(f"{layer}: fused weight vs W + scale*(alpha/r)*B@A by hand, max abs difference {error_text(fuse_error)}")
print(f"{len(changed)} tensors changed, e.g. {changed[:3]}; names unchanged: {list(after) == list(before)}")

# %% [markdown]
# The sharding table of the fused transformer is the stock one, tensor for tensor: the same rules
# (notebook `sharding`) match the same names with the same shapes. The stock table needs no
# weights, only the shapes on `meta`:

# %%
from tpupedia import devices, sharding

mesh = devices.make_mesh((2, 4), ("dp", "tp"))
rules = sharding.rules(family.SPEC, "tp", axis="tp")
same_table = sharding.plan(fused, rules, mesh).table() == sharding.plan(shapes_only(configs), rules, mesh).table()
print("the fused transformer's sharding table equals the checkpoint's:", same_table)

# %% [markdown]
# And the stock comparison: diffusers' own `load_lora_weights`, `fuse_lora(lora_scale=0.8)` and
# `unload_lora_weights` on the stock pipeline give the same tensors, bit for bit (tiny preset: it
# loads the stock pipeline on the host).

# %%
from tpupedia.pipelines import cogvideox as pipeline

if preset.host_runs_whole_models:
    stock_pipe = pipeline.common.load_stock(diffusers.CogVideoXPipeline, source)
    stock_pipe.load_lora_weights(str(adapter_file))
    stock_pipe.fuse_lora(lora_scale=adapter.scale)
    stock_pipe.unload_lora_weights()
    stock_state = stock_pipe.transformer.state_dict()
    bit_for_bit = list(stock_state) == list(after) and all(torch.equal(after[k], stock_state[k]) for k in after)
    print("our fuse equals stock diffusers' fuse, every tensor bit for bit:", bit_for_bit)

# %% tags=["check"]
assert fuse_error <= 1e-5  # float32 sums in another order
assert list(after) == list(before) and len(changed) == 3 * configs["transformer"]["num_layers"]  # 3 layers per block
assert all(k.endswith(("attn1.to_q.weight", "attn1.to_v.weight", "ff.net.2.weight")) for k in changed)
assert same_table
assert "other-size.safetensors" in str(misfit) and "another family or model size" in str(misfit)
if preset.host_runs_whole_models:
    assert bit_for_bit

# %% [markdown]
# A whole run with the adapter: `Request.lora` is what `--lora` fills. The fuse happens as the
# denoise stage loads the transformer, before `shard_weights`; the adapter's file digest and scale
# go into the denoise and decode stage fingerprints, so another adapter reruns those stages and
# not the text stage. On the tiny preset the frames are compared with stock diffusers' pipeline
# with the same adapter fused.

# %%
import numpy as np

request = pipeline.Request(prompt="a panda playing a guitar", negative_prompt="blurry",
                           **family.default_request(preset), lora=(adapter,))
reports = pipeline.run(request, pipeline.Options(quiet=True), preset=preset, workdir="lora",
                       log=lambda _: None)
frames = load_file("lora/decode.safetensors")["frames"].numpy()
print("stages:", [(r.stage, r.ran) for r in reports], "frames", frames.shape)
if preset.host_runs_whole_models:
    _, call = pipeline.stock(source, request)
    expected = stock_pipe(**call).frames[0]
    lora_error = float(np.abs(frames - expected).max())
    print(f"frames vs stock diffusers with the adapter fused: max abs error {error_text(lora_error, 1e-4)}")

# %% tags=["check"]
assert [r.stage for r in reports] == ["text", "denoise", "decode"] and all(r.ran for r in reports)
if preset.host_runs_whole_models:
    assert frames.shape == expected.shape and lora_error <= 1e-4  # float32 on both sides

# %% [markdown]
# ### Exercise 2: two adapters at once
#
# Fuse `style.safetensors` at scale 0.8 and then a second adapter on `attn1.to_q` only (rank 2,
# alpha 2, another seed) at scale -1.5. **Predict** the change in `transformer_blocks.0.attn1.to_q`'s
# weight as a formula in both adapters' `A` and `B`, and which tensors change compared with the
# first adapter alone. Then run the solution.

# %% tags=["solution"]
second_file = write_adapter(Path("second.safetensors"), shapes_only(configs), ("attn1.to_q",), 2, 2, seed=7)
second = lora.Adapter(str(second_file), -1.5)
both = lora.fuse(host_transformer(), [adapter, second], family).state_dict()
A2 = load_file(second_file)[f"transformer.{layer}.lora_A.weight"]
B2 = load_file(second_file)[f"transformer.{layer}.lora_B.weight"]
predicted = before[f"{layer}.weight"] + 0.8 * (ALPHA / RANK) * B @ A + (-1.5) * (2 / 2) * B2 @ A2
changed_again = sorted(k for k in both if not torch.equal(both[k], after[k]))
print(f"max abs difference from the prediction: {error_text(float((both[f'{layer}.weight'] - predicted).abs().max()))}")
print(f"tensors that differ from the first adapter alone: {changed_again}")

# %% tags=["check"]
assert float((both[f"{layer}.weight"] - predicted).abs().max()) <= 1e-5
assert changed_again == sorted(f"transformer_blocks.{i}.attn1.to_q.weight" for i in range(configs["transformer"]["num_layers"]))

# %% [markdown]
# ## 3. Few-step releases: a table of defaults per family
#
# A step-distilled model was trained to go from noise to a video in a few steps, usually without
# guidance. Some ship as a checkpoint (HunyuanVideo-1.5's 480p step-distilled image-to-video
# release, which also embeds the next step's timestep), others as adapters for the base
# checkpoint (Wan 2.2's Lightning, one adapter per expert). Either way a release is a set of
# defaults: steps, guidance, the scheduler's shift, and which adapters go where. Each family's
# module holds its releases as data, with a source for every value; `generate --release NAME`
# applies one, lets any flag the user gives win, and prints what it applied.

# %%
for spec in families.video():
    for release in spec.few_step.values():
        print(f"{spec.name} --release {release.name}: {release.title}")
        print(f"    loads {release.model}; sets {release.request_fields()}")
        for a in release.adapters:
            print(f"    adapter {a.where} -> {a.component} (rank {a.rank}, scale {a.scale})")
        if release.note:
            print(f"    note: {release.note}")

# %% [markdown]
# The Lightning note matters. The adapters were distilled with their authors' own 4-step Euler
# sampler (ModelTC/Wan2.2-Lightning, `wan/utils/fm_solvers_euler.py`; their `generate.py` warns
# when adapters meet any other solver). Stock `WanPipeline` with the adapters loaded keeps the
# checkpoint's UniPC. The release runs the authors' Euler (`--solver euler`; `--solver unipc`
# gives stock's choice). Do the two samplers differ? Step both through the same four made-up
# velocities from the same start. The cell reads the tiny Wan 2.2 checkpoint's scheduler config,
# Wan 2.2's own values, under either preset.

# %%
import torch

from tpupedia.models import wan as wan_family
from tpupedia.pipelines import schedulers
from tpupedia.pipelines import wan as wan_pipeline

wan_configs = wan_family.component_configs(str(wan_family.tiny_checkpoint(experts=2)))
draw = torch.Generator().manual_seed(0)
start = torch.randn(1, 16, 2, 4, 4, generator=draw)
velocities = [torch.randn(start.shape, generator=draw) for _ in range(4)]
sigmas, paths = {}, {}
for solver in schedulers.SOLVERS:
    sampler = wan_pipeline.solver_scheduler(wan_configs["scheduler"], solver, shift=5.0)
    sampler.set_timesteps(4)
    sigmas[solver] = sampler.sigmas.double().numpy()
    x, paths[solver] = start, []
    for t, v in zip(sampler.timesteps, velocities):
        x = sampler.step(v, t, x, return_dict=False)[0]
        paths[solver].append(x)
    print(f"{solver:>6}: sigmas {np.round(sigmas[solver], 4).tolist()}")
apart = [float((a - b).abs().max()) for a, b in zip(paths["unipc"], paths["euler"])]
print("max |unipc - euler| after step 1:", error_text(apart[0], 1e-3), "| after each later step:",
      [measured_text(d, 0.1, at_least=True) for d in apart[1:]])

# %% [markdown]
# Both visit nearly the same noise levels: the Euler's are the authors' formula, sigmas
# `linspace(1, 0, 5)` shifted by `5 s / (1 + 4 s)`, and UniPC's differ only by its integer
# timesteps. The first step is the same Euler move in both. From the second step on, UniPC's
# predictor-corrector also reuses the velocities of earlier steps, and the paths part. A distilled
# model's four velocities were trained for the Euler path.

# %% tags=["check"]
uniform = np.linspace(1, 0, 5)
np.testing.assert_allclose(sigmas["euler"], 5 * uniform / (1 + 4 * uniform), atol=1e-6)
np.testing.assert_allclose(sigmas["unipc"], sigmas["euler"], atol=1e-3)
assert apart[0] < 1e-3 and min(apart[1:]) > 0.1, apart

# %% [markdown]
# The tests check each release against stock diffusers on tiny checkpoints of the same layout
# (`tests/test_few_step.py`). For Lightning, stock `WanPipeline` is handed the same Euler
# (`pipe.scheduler = schedulers.uniform_euler(1000, 5.0)`). On random tiny weights the frames say
# nothing about quality, and nothing here measures it.
#
# A name that is not a release, or another family's, is refused before anything loads:

# %%
_ = expect(lambda: families.few_step("cogvideox", "lightning"), families.ReleaseError, max_lines=1)

# %% tags=["check"]
lightning = families.few_step("wan", "lightning")
assert lightning.request_fields() == {"steps": 4, "guidance": 1.0, "guidance_2": 1.0, "shift": 5.0, "solver": "euler"}
assert [a.component for a in lightning.adapters] == ["transformer", "transformer_2"]
assert all(r.sources for spec in families.video() for r in spec.few_step.values())

# %% [markdown]
# ## 4. Step caches: all the steps, most of each skipped
#
# Neighbouring steps compute similar things. A step cache runs some steps in full and, on the
# others, reuses what the last full step computed. Three ways to cache, one mechanism:
#
# | method | a full step keeps | a cached step runs | which steps run in full |
# |---|---|---|---|
# | `deepcache` (notebook `hunyuan_tuning_and_i2v`) | the state entering the last `tail` blocks | those blocks | a schedule `START:END:INTERVAL` |
# | `fbcache` (First-Block-Cache) | the residual of the blocks after the first | the first block, plus that residual | where the first block's output moved more than a threshold since the last full step |
# | `magcache` (MagCache) | the residual of all blocks | no block: the residual added to their input | where accumulated residual-magnitude ratios drift more than a threshold from 1 |
#
# diffusers 0.42 runs First-Block-Cache and MagCache as hooks (`transformer.enable_cache(...)`)
# that decide at every step by reading a tensor's value. In eager PyTorch that read is cheap;
# under `jax.jit` it is a device-to-host wait each step, or a `lax.cond` with both programs
# compiled into one. So here the decision moves before the run: a **calibration run** (every step
# full) records the quantity each method thresholds, the threshold turns that record into a list
# of full steps, and the real run replays that list with two compiled programs, the full step
# (which also returns the cache) and the cached step (which takes it).
#
# A calibrated First-Block-Cache run on CogVideoX:

# %%
import dataclasses

from tpupedia.pipelines import stepcache

cache_request = dataclasses.replace(request, lora=(), steps=6 if preset.host_runs_whole_models else request.steps,
                                    step_cache=stepcache.parse_step_cache("fbcache:0.6"))
for stage in ("text", "denoise"):
    cache_reports = pipeline.run(cache_request, pipeline.Options(quiet=True), preset=preset,
                                 workdir="fbcache", stage=stage, log=lambda _: None)
timings = cache_reports[-1].timings
change = [float("inf") if c is None else c for c in timings["calibration"]["change"]]
print("first block's change from the step before:", ", ".join(f"{c:.3f}" for c in change))
print(f"{timings['step_cache']}: full steps {timings['full_steps']} of {cache_request.steps}; "
      f"the same frames again: --step-cache {timings['replay']}")

# %% [markdown]
# The rule that turned the record into the list: a step runs in full when the first block's
# output has changed by more than the threshold since the last full step. The calibration run
# records changes between neighbouring steps only, so the change since the last full step is
# taken as their sum, an upper bound on it (the triangle inequality): the schedule caches no step
# that diffusers' run-time rule would recompute along the calibration run's trajectory.

# %%
print(stepcache.fbcache_full_steps(change, 0.6))

# %% tags=["check"]
assert timings["full_steps"] == stepcache.fbcache_full_steps(change, 0.6)
assert timings["full_steps"][0] == 0 and 0 < len(timings["full_steps"]) < cache_request.steps  # some steps cached
assert timings["replay"] == "fbcache:full=" + ",".join(map(str, timings["full_steps"]))

# %% [markdown]
# Is the static scheme the same cache as diffusers' hook? Run stock `CogVideoXPipeline` with
# `FirstBlockCacheConfig` on the same checkpoint and seed, record which steps the hook ran in full
# (its own run-time decision, read from its state after each first block), then replay exactly
# those steps here as a schedule (`fbcache:full=...`). The latents after the last step should be
# stock's. On the tiny preset, where the stock pipeline runs on the host:

# %%
if preset.host_runs_whole_models:
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import HookRegistry

    hooked, call = pipeline.stock(source, cache_request)
    hooked.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.6))
    head = getattr(hooked.transformer, family.CACHE_BLOCKS)[0]
    state = HookRegistry.check_if_exists_or_initialize(head).get_hook("fbc_leader_block_hook").state_manager
    decisions = []
    head.register_forward_hook(lambda *_: decisions.append(bool(state.get_state().should_compute)))
    with torch.no_grad():
        stock_latents = np.asarray(hooked(**(call | {"output_type": "latent"})).frames, np.float32)
    stock_full = [i for i, full in enumerate(decisions) if full]
    replay = dataclasses.replace(cache_request, step_cache=stepcache.StepCache("fbcache", full=tuple(stock_full)))
    pipeline.run(replay, pipeline.Options(quiet=True), preset=preset, workdir="fbcache", stage="denoise",
                 log=lambda _: None)
    replay_latents = load_file("fbcache/denoise.safetensors")["latents"].numpy()
    hook_error = float(np.abs(replay_latents - stock_latents).max())
    print(f"stock's hook ran steps {stock_full} in full; replayed here: max abs error {error_text(hook_error, 1e-4)} "
          f"(latents of order {np.abs(stock_latents).max():.0f})")

# %% tags=["check"]
if preset.host_runs_whole_models:
    assert len(decisions) == cache_request.steps  # one transformer call a step: the guidance pair is one batch
    assert 0 < len(stock_full) < cache_request.steps  # the hook cached some steps, not all
    assert replay_latents.shape == stock_latents.shape and hook_error <= 1e-4

# %% [markdown]
# Here stock's hook chose the steps the calibrated schedule above chose. They need not agree in
# general: the hook compares with the last full step's residual itself, where the calibration
# sums the changes between neighbouring steps. What the comparison proves is that a cached step
# here computes what diffusers' cached step computes. The tests make the same comparison for MagCache and for Wan (`tests/test_stepcache.py`).
#
# What can a schedule gain? Time is measured on the slice; its ceiling is counted here. The two
# programs the pipeline compiles are built as `tpupedia plan` builds them (weights abstract,
# nothing run), and XLA's cost analysis counts each one's FLOPs (notebook `plan_without_tpu`):

# %%
from tpupedia import bench

schedule = dataclasses.replace(cache_request, step_cache=stepcache.parse_step_cache(timings["replay"]))
ceiling = bench.step_cache_bound("cogvideox", schedule, pipeline.Options(quiet=True), configs, mesh)
share = ceiling["cached_flops"] / ceiling["full_flops"]
print(f"FLOPs per step: full {ceiling['full_flops']:.3g}, cached {ceiling['cached_flops']:.3g} ({share:.1%} of full)")
print(f"{schedule.step_cache}: {ceiling['full_steps']} full steps of {ceiling['steps']}, "
      f"speed-up bound {ceiling['bound']:.2f}x")

# %% tags=["check"]
assert 0 < share < 1 and ceiling["full_steps"] == len(timings["full_steps"])
n = ceiling["full_steps"]
assert abs(ceiling["bound"] - cache_request.steps / (n + (cache_request.steps - n) * share)) < 1e-9

# %% [markdown]
# On the tiny 2-layer model a cached FBCache step still runs one of the two blocks, so the share
# is large. At full size (42 blocks for CogVideoX1.5-5B) it is a few percent, and a schedule that
# caches half the steps nears 2x; what it costs in quality is a question for real weights and
# real prompts, which the knowledge-base page on step caches collects from upstream reports.

# %% [markdown]
# ### Calibrate once, keep the file
#
# A calibration pass costs a whole uncached denoise, so a threshold on one video costs more than
# it saves. diffusers asks for MagCache's ratios once per model instead
# (`MagCacheConfig(mag_ratios=...)`, printed by a run with `calibrate=True`). Here `@FILE` after
# the threshold does the same. The first run writes its calibration record there, atomically.
# Each later run reads it, runs no calibration pass, and turns it into full steps at its own
# threshold. The file names its model (the family and the transformer's config fingerprint), and
# a run on another model refuses it before anything loads. Three runs share one file: the first
# calibrates, the second reads, the third reads at threshold 0, which caches nothing.

# %%
from pathlib import Path

saved = Path("magcache-calibration.json")
saved.unlink(missing_ok=True)  # start without it: the first run calibrates
shared = {}
for threshold in ("0.06", "0.06", "0"):
    saving = dataclasses.replace(cache_request, step_cache=stepcache.parse_step_cache(f"magcache:{threshold}@{saved}"))
    run = pipeline.run(saving, pipeline.Options(quiet=True), preset=preset, workdir="fbcache", stage="denoise",
                       log=lambda _: None)[-1].timings
    how = f"wrote {saved}" if "calibration_written" in run else f"read {saved}"
    print(f"magcache:{threshold}: {how}; full steps {run['full_steps']}")
    shared[len(shared)] = run

# %% tags=["check"]
assert "calibration_written" in shared[0] and "calibration_s" in shared[0]
assert all("calibration_read" in shared[k] and "calibration_s" not in shared[k] for k in (1, 2))
assert shared[1]["full_steps"] == shared[0]["full_steps"]  # the same record, the same schedule
assert shared[2]["full_steps"] == list(range(cache_request.steps))  # threshold 0: every step in full
assert len(shared[0]["full_steps"]) < cache_request.steps

# %% [markdown]
# ### Exercise 3: a threshold's schedule, by hand
#
# A calibration run recorded these changes of the first block from the step before, over 10
# steps: `[inf, 0.30, 0.05, 0.04, 0.03, 0.20, 0.02, 0.02, 0.02, 0.25]`. **Predict** which steps
# First-Block-Cache runs in full at threshold 0.1, and at 0.05. Then check with the rule.

# %% tags=["solution"]
recorded = [float("inf"), 0.30, 0.05, 0.04, 0.03, 0.20, 0.02, 0.02, 0.02, 0.25]
for threshold in (0.1, 0.05):
    print(f"threshold {threshold}: full steps {stepcache.fbcache_full_steps(recorded, threshold)}")

# %% tags=["check"]
# 0.1: step 0, step 1 (0.30), then 0.05+0.04+0.03 passes 0.1 at step 4, step 5 (0.20), 0.02*3 stays under
# until step 9 adds 0.25
assert stepcache.fbcache_full_steps(recorded, 0.1) == [0, 1, 4, 5, 9]
assert stepcache.fbcache_full_steps(recorded, 0.05) == [0, 1, 3, 5, 8, 9]

# %% [markdown]
# ### Exercise 4: reuse a calibration at another step count
#
# The file written above records one value per step of the run that wrote it. **Predict** what
# happens when a run with 3 more steps names it: with MagCache at threshold 0.06, and with
# First-Block-Cache at 0.1. Then ask the step cache itself (`check` raises the refusal a run
# would print; `full_steps` gives MagCache's schedule).

# %% tags=["solution"]
record = stepcache.read_calibration(saved)
longer = len(record.ratio) + 3
stretched = stepcache.parse_step_cache(f"magcache:0.06@{saved}").full_steps(longer, record)
print(f"magcache at {longer} steps, from {len(record.ratio)} calibrated ratios: full steps {stretched}")
refusal = expect(lambda: stepcache.parse_step_cache(f"fbcache:0.1@{saved}").check(longer), stepcache.StepCacheError,
                 max_lines=1)

# %% tags=["check"]
assert len(record.ratio) == cache_request.steps
assert stretched == stepcache.magcache_full_steps(record.ratio, 0.06, longer)  # the ratios, stretched
assert f"calibrated at {cache_request.steps} steps and this run has {longer}" in str(refusal)  # changes do not

# %% [markdown]
# ## 5. Fewer bytes a weight: int8, the scale after the matmul
#
# Steps and calls are what a video costs in time; bytes are what decide whether it runs at all on a
# small chip. One v5e chip gives a program 15.75 GiB, and HunyuanVideo-1.5's transformer's bf16
# weights alone leave 0.24 GiB of it (the plan on the free-TPU guide). Weight-only quantization
# keeps each weight in 8 bits and one scale per output channel, `w ≈ q × s`, with `s` the row's
# largest magnitude over 127.5, the range qwix's int8 quantization uses. By hand, on one linear:

# %%
from tpupedia import quantize

torch.manual_seed(0)
linear = torch.nn.Linear(256, 128)
w = linear.weight.detach()
scale = w.abs().amax(dim=1) / 127.5
q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
values, package_scale = quantize.quantize_weight(w, "int8")
steps_off = ((q.to(torch.float32) * scale[:, None] - w).abs() / scale[:, None]).max().item()
print(f"by hand equals tpupedia.quantize: {torch.equal(q, values) and torch.equal(scale, package_scale)}; "
      f"bytes {w.numel() * 2:,} in bf16, {q.numel() + 4 * scale.numel():,} as int8 and scales")
print(f"largest error, in steps of its row's scale: {measured_text(steps_off, 0.5 + 1e-5, fmt='.3f')}")

# %% tags=["check"]
assert torch.equal(q, values) and torch.equal(scale, package_scale) and steps_off <= 0.5 + 1e-5

# %% [markdown]
# Where the scale is applied matters on a TPU. Each scale belongs to one output column of
# `x @ q.T`, so multiplying the product by it gives the same sums as multiplying the weight first,
# and the compiler never has to build the bf16 copy of the weight. `quantize.QuantizedLinear` does
# that, and its error against the float linear stays inside the rounding bound, half a step per
# weight: the sum over the inputs of `|x_k| × s / 2`.

# %%
x = torch.randn(16, 256)
layer = quantize.QuantizedLinear.from_linear(linear, "int8")
with torch.no_grad():
    by_hand = (x @ q.to(torch.float32).T) * scale + linear.bias
    gap = (layer(x) - by_hand).abs().max().item()
    slack = ((layer(x) - linear(x)).abs() / (x.abs().sum(dim=1, keepdim=True) * scale / 2)).max().item()
print(f"QuantizedLinear against the sum by hand: {error_text(gap, 1e-5)}")
print(f"its error against the float linear, as a share of the rounding bound: {measured_text(slack, 1.0, fmt='.2f')}")

# %% tags=["check"]
assert gap <= 1e-5 and slack <= 1.0

# %% [markdown]
# The memory, compiled ahead of time for one v6e chip (the host's libtpu, as in notebook
# `plan_without_tpu`): a 4096 x 8192 bf16 activation against an 8192 x 8192 weight, three ways.
# The int8 weight halves the weight's argument bytes in both int8 programs; dequantizing first
# leaves temporaries (part of the weight's bf16 copy) that the scale-after program never makes. Either way the matmul
# runs at the bf16 rate: weight-only int8 buys bytes, not FLOPs.

# %%
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot, devices, hardware

one_chip = NamedSharding(devices.topology_mesh(hardware.parse_topology("v6e:1x1"), (1, 1), ("dp", "tp")), P())
acts = aot.abstract((4096, 8192), jnp.bfloat16, one_chip)
int8_weight, scales = aot.abstract((8192, 8192), jnp.int8, one_chip), aot.abstract((8192,), jnp.float32, one_chip)
programs = {
    "bf16 weight": (lambda x, w: x @ w.T, (acts, aot.abstract((8192, 8192), jnp.bfloat16, one_chip))),
    "int8, scale after": (lambda x, q, s: ((x @ q.astype(x.dtype).T).astype(jnp.float32) * s).astype(x.dtype),
                          (acts, int8_weight, scales)),
    "int8, dequantize first": (lambda x, q, s: x @ (q.astype(jnp.float32) * s[:, None]).astype(x.dtype).T,
                               (acts, int8_weight, scales)),
}
memory = {name: aot.compile_aot(fn, *args).memory for name, (fn, args) in programs.items()}
for name, m in memory.items():
    print(f"{name:24} arguments {aot.format_bytes(m.arguments):>10}, temporaries {aot.format_bytes(m.temporaries):>10}")

# %% tags=["check"]
assert memory["bf16 weight"].arguments - memory["int8, scale after"].arguments == 8192 * 8192 - 4 * 8192
assert memory["int8, scale after"].temporaries == 0 < memory["int8, dequantize first"].temporaries

# %% [markdown]
# A run does this to every linear of the denoise stage's transformers (`Request(quantize="int8")`,
# `generate --quantize int8`), on the host after any LoRA fuse and before sharding, except the
# layers its family's `QUANTIZE_KEEP` table keeps in bf16, each with its reason: the embedders that
# condition every block and the last projection, whose errors are the prediction's. On the
# transformer's shapes (`meta`: no weights), the table and what it leaves:

# %%
import re

shapes = shapes_only(configs).to(torch.bfloat16)
bf16_bytes = sum(t.numel() * t.element_size() for t in shapes.parameters())
swapped = quantize.quantize_linears(shapes, "int8", keep=[rule for rule, _ in family.QUANTIZE_KEEP])
int8_bytes = sum(t.numel() * t.element_size() for t in (*shapes.parameters(), *shapes.buffers()))
kept = [n for n, m in shapes.named_modules() if isinstance(m, torch.nn.Linear)]
for rule, why in family.QUANTIZE_KEEP:
    print(f"kept in bf16, {rule}: {why}")
print(f"{len(swapped)} linears in int8, {len(kept)} kept; the transformer's weights "
      f"{bf16_bytes / 2**20:.2f} MiB in bf16, {int8_bytes / 2**20:.2f} MiB quantized ({int8_bytes / bf16_bytes:.2f} of it)")

# %% tags=["check"]
assert kept and all(any(re.fullmatch(rule, n) for rule, _ in family.QUANTIZE_KEEP) for n in kept)
assert 0.5 < int8_bytes / bf16_bytes < 0.75  # the blocks' linears are most of the bytes; the rest stays at two a weight

# %% [markdown]
# ### Exercise 5: a transformer's largest weight, in int8
#
# Wan 2.1 14B's feed-forward layers map 5120 features to 13824 and back. **Predict** the argument
# bytes of one up-projection on one v6e chip against 1024 tokens of bf16 activations, with the
# weight in bf16 and in int8 with its scales. Then compile both. (A hint for the last bytes: the
# TPU lays a float32 vector out in tiles of 8 x 128 values, and 13,824 is not a multiple of 1,024;
# section 5's 8,192 scales were.)

# %% tags=["solution"]
tokens_in = aot.abstract((1024, 5120), jnp.bfloat16, one_chip)
up_bf16 = aot.compile_aot(programs["bf16 weight"][0], tokens_in,
                          aot.abstract((13824, 5120), jnp.bfloat16, one_chip)).memory
up_int8 = aot.compile_aot(programs["int8, scale after"][0], tokens_in, aot.abstract((13824, 5120), jnp.int8, one_chip),
                          aot.abstract((13824,), jnp.float32, one_chip)).memory
tile = 8 * 128
scale_bytes = 4 * -(-13824 // tile) * tile  # 13,824 floats padded to 14 tiles of 1,024
print(f"bf16: {up_bf16.arguments:,} bytes of arguments; int8: {up_int8.arguments:,}, of which scales "
      f"{scale_bytes:,} ({4 * 13824:,} unpadded)")

# %% tags=["check"]
assert up_bf16.arguments == 2 * 1024 * 5120 + 2 * 13824 * 5120
assert up_int8.arguments == 2 * 1024 * 5120 + 13824 * 5120 + scale_bytes and scale_bytes > 4 * 13824

# %% [markdown]
# ## Takeaways
#
# - A video costs its transformer calls: steps times guidance branches. Few-step releases cut the
#   steps and turn guidance off (section 1); step caches keep the calls and make most cheap
#   (section 4).
# - A LoRA adapter fused on the host, before sharding, costs nothing per step and leaves the
#   transformer's names and shapes, so the sharding table is the stock one; a misfit is refused
#   in one line before any weight loads (section 2).
# - A release is data in its family's module: steps, guidance, shift and adapters, each with its
#   source (section 3).
# - A step cache under `jax.jit` is a schedule fixed on the host and two compiled programs; a
#   calibration run turns a threshold into the schedule, replaying stock's choices gives stock's
#   latents, and the FLOPs of the two programs bound the gain (section 4).
# - Weight-only int8 keeps a byte a weight and one scale per output channel; applied after the
#   matmul, the scale never builds a bf16 copy. It halves a weight's HBM, not its FLOPs (section 5).

# %% [markdown]
# ## Further reading
#
# - [Step caches](../kb/step-caches.md): which cache to use when, and what each costs in quality
#   as reported upstream.
# - [What a video costs](../kb/cost-per-video.md): the few-step rows beside the 50-step runs.
# - The guide [CogVideoX on a TPU VM](../guides/cogvideox-tpu-vm.md): `--lora`, `--release` and
#   `--step-cache` on the command line.

# %% [markdown]
# ## Self-check
#
# 1. Why is an adapter fused into the weights on the host here, rather than kept as PEFT layers?
#
#    <details><summary>Answer</summary>
#
#    Fused, it costs nothing per step, and once the adapter layers are unloaded the transformer
#    has its original names and shapes, so the family's sharding rules place every weight as they
#    place the stock ones. PEFT's extra layers would add matmuls to every step and carry names no
#    rule matches, so they would be replicated. The price is a reload to change adapters.
#
#    </details>
#
# 2. An adapter written for CogVideoX1.5-5B is given to a checkpoint twice as wide. When is it
#    refused, and from what?
#
#    <details><summary>Answer</summary>
#
#    Before any weight loads: `lora.check` builds the transformer on the `meta` device from its
#    config and compares each `lora_A`/`lora_B` shape with the layer it names, refusing the first
#    that does not fit in one line.
#
#    </details>
#
# 3. Wan 2.2 Lightning runs 4 steps with guidance 1. How many transformer calls is that, against
#    the stock default's, and why does guidance 1 halve the calls?
#
#    <details><summary>Answer</summary>
#
#    4 calls against 100 (50 steps x 2). diffusers turns classifier-free guidance on only for a
#    scale above 1; at 1 the negative prompt's branch is not run, so each step is one call.
#
#    </details>
#
# 4. diffusers' First-Block-Cache decides at every step from a tensor's value. Why is that
#    decision made before the run here, and how is a threshold still honoured?
#
#    <details><summary>Answer</summary>
#
#    Under `jax.jit` a decision from a device value is a host wait every step, or both programs
#    compiled into a `lax.cond`. A calibration run, every step full, records the first block's
#    change per step; the threshold turns that record into a list of full steps, replayed with
#    two compiled programs picked on the host.
#
#    </details>
#
# 5. What does the speed-up bound of a step cache count, and why can a measured speed-up only
#    fall below it?
#
#    <details><summary>Answer</summary>
#
#    The FLOPs of the full and the cached compiled programs, weighted by how many steps run each:
#    all-full FLOPs over the schedule's. A measured time also pays for what FLOPs do not count,
#    memory traffic and the host's loop, which a cached step does not shrink in proportion.
#
#    </details>
