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
# # 08 · Plan a TPU run without a TPU
#
# Before renting eight TPU chips for a video model, you want three answers: how long a step can
# take at best, whether the step fits in each chip's memory, and what the chips will spend their
# time talking about. This notebook gets all three on a CPU host:
#
# 1. **roofline first**: count the FLOPs of a diffusion-transformer step and see which part
#    dominates as videos get longer;
# 2. **memory per chip, by plan**: what tensor parallelism and FSDP do to the weights;
# 3. **memory per chip, by compiler**: an ahead-of-time (AOT) dry-run of a full-size CogVideoX
#    step for a `v6e:2x4` slice, with `libtpu`'s real compiler;
# 4. **MFU from reported step times**: how close the upstream project's TPU runs came to the
#    chips' peak, and a **predicted step time** from the TPU compiler's own counts, set against
#    the four step times upstream reports;
# 5. **the whole run**: every stage's programs compiled for the slice (`tpupedia plan`), for one
#    video and for a batch.
#
# The CI run compiles one transformer layer (`layers=1`) and scales the weights to full depth, to
# stay fast; `tpupedia dryrun` produces the full-depth numbers, stored on the results page.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | no weights: abstract shapes only; the compiles read from their records | about 1.8 GB of host RAM | about 10–120 s, measured here on a 2-core CPU (10 s with the TPU compiles kept, as CI keeps them) |
# | `full` (TPU VM or any host with libtpu) | no weights either: this notebook only compiles, on the host CPU | the program it plans: 3.8 GiB of arguments + 1.6 GiB of temporaries per chip (AOT here); host RAM for the 42-layer compile not recorded (the 54-block HunyuanVideo-1.5 compiles took 3.6–8.7 GB, measured here) | adds one live compile at all 42 layers, the splash-attention step of section 3: 182 s, measured on a shared 2-core CPU; the 42-layer reference-attention compile is read from its record, and section 4 compiles at one layer, as on tiny; section 5's four predictions compile eight more programs at 1 and 2 layers (about a minute a pair on a CPU host, measured here) |
#
# *Reading time: about 34 minutes.*

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

preset = session.start()
layers = None if preset.compile_full_size else 1  # None: all 42 layers (section 3's splash step only)
print(preset.name, "| layers compiled in section 3:", layers or "all")

# %% [markdown]
# ## 1. Roofline first: where the FLOPs of a step go
#
# One CogVideoX1.5-5B denoising step runs the transformer on a batch of 2 (classifier-free
# guidance: the prompt and the negative prompt). Per layer and token, the four attention
# projections and the 4x MLP cost `2 × 12 d²` FLOPs with `d = 3072`; attention itself costs
# `4 S² d` per layer for a sequence of `S` tokens. The linear part grows with `S`, attention
# with `S²`, so attention takes over as videos get longer or sharper: its share of the FLOPs is
# `S / (S + 6d)`, one half at `S = 6d = 18,432` tokens.

# %%
from tpupedia import dryrun, hardware
from tpupedia.models import cogvideox, hunyuan

v6e = hardware.chip("v6e")
rows = []
for label, (width, height) in [("480p", (848, 480)), ("720p", (1280, 720))]:
    for frames in (49, 81):
        f = cogvideox.step_flops(width, height, frames)
        floor = f["total"] / (8 * v6e.bf16_flops)
        rows.append((label, frames, f["tokens"], f["total"], f["attention"] / f["total"], floor))
print(f"{'size':>5} {'frames':>6} {'tokens':>7} {'FLOPs/step':>11} {'attention':>9} {'v6e-8 floor':>11}")
for label, frames, tokens, total, share, floor in rows:
    print(f"{label:>5} {frames:>6} {tokens:>7,} {total:>11.3e} {share:>9.0%} {floor:>10.3f}s")

# %% [markdown]
# The last column is the roofline floor: the step's FLOPs divided by the peak bf16 throughput of
# eight v6e chips (7.3 PFLOP/s). No schedule of the computation can beat it. The step is far
# above the v6e's ridge point (notebook `start_here`), so memory bandwidth does not set the floor: each
# weight is read once per step and used for tens of thousands of tokens.

# %%
import matplotlib.pyplot as plt
import numpy as np

d = 3072
tokens = np.linspace(2_000, 120_000, 60)
share = tokens / (tokens + 6 * d)  # 4 S^2 d / (4 S^2 d + 24 S d^2)
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(tokens / 1000, share * 100)
for label, frames, s, _, sh, _ in rows:
    ax.scatter(s / 1000, sh * 100, color="C1")
    ax.annotate(f"{label}, {frames}f", (s / 1000, sh * 100), textcoords="offset points", xytext=(4, -10), fontsize=8)
ax.set_xlabel("tokens per sample (thousands)")
ax.set_ylabel("attention share of FLOPs (%)")
ax.set_title("CogVideoX1.5-5B step: attention vs linear layers")
ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %%
shares = {(label, frames): sh for label, frames, _, _, sh, _ in rows}
assert shares[("720p", 81)] > shares[("720p", 49)] > shares[("480p", 49)]
assert shares[("720p", 81)] > 0.5  # at 720p and 81 frames, attention is most of the work
assert cogvideox.step_flops(1280, 720, 81)["tokens"] == 39_600 + 226

# %% [markdown]
# ### Exercise 1: CogVideoX 1.0's floor at 720p
#
# CogVideoX 1.0's 2B release (`cogvideox.full_configs(size="2b")`, built in) has 30 layers of 30
# heads of 64, against 1.5-5B's 42 layers of 48, and no temporal patch: every latent frame is its
# own row of tokens (notebook `cogvideox_pipeline`, Exercise 1). **Predict** first: at 1280x720
# and 49 frames, is its step's roofline floor on a v6e-8 below or above 1.5-5B's 0.157 s, and is
# its attention share higher or lower? Count the tokens with `cogvideox.video_tokens` and the
# release's shape facts, and the FLOPs with this section's formula; `cogvideox.step_flops` counts
# 1.5's temporal patches, so it cannot count 1.0's tokens. Then open the solution, run it, and
# compare.

# %% tags=["solution"]
v1 = cogvideox.full_configs(size="2b")
v1_t = v1["transformer"]
v1_d, v1_layers = v1_t["num_attention_heads"] * v1_t["attention_head_dim"], v1_t["num_layers"]
v1_tokens = cogvideox.video_tokens(1280, 720, 49, cogvideox.shape_facts(v1)) + v1_t["max_text_seq_length"]


def step_flops_by_formula(tokens, d, layers, batch=cogvideox.CFG_BATCH):
    """This section's count: 2 x 12 d^2 per token and layer, 4 S^2 d of attention per layer."""
    linear, attention = batch * layers * 2 * tokens * 12 * d * d, batch * layers * 4 * tokens**2 * d
    return {"tokens": tokens, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


v1_flops = step_flops_by_formula(v1_tokens, v1_d, v1_layers)
v15_flops = cogvideox.step_flops(1280, 720, 49)
for name, f in (("CogVideoX 1.0 (2B)", v1_flops), ("CogVideoX1.5-5B", v15_flops)):
    print(f"{name:18} {f['tokens']:>7,} tokens {f['total']:.3e} FLOPs/step, attention {f['attention'] / f['total']:.0%}, "
          f"v6e-8 floor {f['total'] / (8 * v6e.bf16_flops):.3f} s")

# %% tags=["check"]
assert step_flops_by_formula(v15_flops["tokens"], 3072, 42) == v15_flops  # the formula is the helper's
assert v1_tokens == cogvideox.latent_frames(49) * (720 // 16) * (1280 // 16) + 226  # 13 latent frames, no pairs
assert v1_flops["total"] > v15_flops["total"]  # fewer, narrower layers, but almost twice the tokens
assert v1_flops["attention"] / v1_flops["total"] > v15_flops["attention"] / v15_flops["total"]
assert abs(v1_flops["attention"] / v1_flops["total"] - v1_tokens / (v1_tokens + 6 * v1_d)) < 1e-12  # S / (S + 6d)

# %% [markdown]
# ## 2. Memory per chip, by plan
#
# Weights are the part of memory we can compute exactly from shapes. The model is built on
# PyTorch's `meta` device: every parameter has a shape and a dtype and no storage, so a
# 5-billion-parameter model costs nothing to build. `tpupedia.sharding.plan` applies a rule table
# to it and reports each tensor's bytes per device on a mesh, here the `(dp=2, tp=4)` mesh of a
# `v6e:2x4` slice.

# %%
import torch
from diffusers import CogVideoXTransformer3DModel

from tpupedia import devices, sharding

with torch.device("meta"):
    transformer = CogVideoXTransformer3DModel(**cogvideox.full_transformer_config()).to(torch.bfloat16)
tpu_mesh = devices.topology_mesh("v6e:2x4", (2, 4), ("dp", "tp"))
n_params = sum(p.numel() for p in transformer.parameters())
plans = {
    "replicated": sharding.plan(transformer, sharding.rules(cogvideox.SPEC, "replicated"), tpu_mesh),
    "tp (over 4)": sharding.plan(transformer, sharding.rules(cogvideox.SPEC, "tp"), tpu_mesh),
    "fsdp (over 8)": sharding.plan(transformer, sharding.rules(cogvideox.SPEC, "fsdp", axis=("dp", "tp")), tpu_mesh),
}
print(f"CogVideoX1.5-5B transformer: {n_params / 1e9:.2f} B parameters, bf16")
for name, p in plans.items():
    print(f"  {name:<14} {p.bytes_per_device / 2**30:6.2f} GiB of weights per chip")

# %% [markdown]
# Tensor parallelism over 4 chips leaves more than a quarter per chip, and FSDP over 8 more than
# an eighth. The plan says why: every tensor no rule matches stays whole on every chip. The
# biggest of those are CogVideoX's adaptive-norm modulation layers, which the tables (ours and
# upstream's) leave replicated.

# %%
tp_plan = plans["tp (over 4)"]
leftover = sorted(((tp_plan[name].bytes_total, name) for name in tp_plan.unmatched), reverse=True)
leftover_bytes = sum(b for b, _ in leftover)
print(f"{len(leftover)} tensors match no rule; together {leftover_bytes / 2**30:.2f} GiB on every chip")
for b, name in leftover[:3]:
    print(f"  {name}: {b / 2**20:.0f} MiB")

# %%
full = plans["replicated"].bytes_per_device
assert full == 2 * n_params
assert full / 4 < tp_plan.bytes_per_device < full / 2
assert full / 8 < plans["fsdp (over 8)"].bytes_per_device < full / 3
assert abs(tp_plan.bytes_per_device - ((full - leftover_bytes) / 4 + leftover_bytes)) < 0.01 * full

# %% [markdown]
# ### Exercise 2: tensor parallelism over all eight chips
#
# The same `tp` table on a `(dp=1, tp=8)` mesh of the same slice splits every matched tensor
# eight ways instead of four. **Predict** first, in GiB: the weights per chip, and how they
# compare with `tp` over 4 (half?) and with `fsdp` over 8. Use the totals printed above. Then
# open the solution, run it, and compare.

# %% tags=["solution"]
tp8_mesh = devices.topology_mesh("v6e:2x4", (1, 8), ("dp", "tp"))
tp8_plan = sharding.plan(transformer, sharding.rules(cogvideox.SPEC, "tp"), tp8_mesh)
print(f"tp over 8: {tp8_plan.bytes_per_device / 2**30:.2f} GiB of weights per chip; tp over 4: "
      f"{tp_plan.bytes_per_device / 2**30:.2f} GiB; fsdp over 8: {plans['fsdp (over 8)'].bytes_per_device / 2**30:.2f} GiB")
print(f"(the {leftover_bytes / 2**30:.2f} GiB that match no rule stay whole on every chip)")

# %% tags=["check"]
assert abs(tp8_plan.bytes_per_device - ((full - leftover_bytes) / 8 + leftover_bytes)) < 0.01 * full
assert tp8_plan.bytes_per_device > tp_plan.bytes_per_device / 2  # not half: the unmatched part does not shrink
assert abs(tp8_plan.bytes_per_device - plans["fsdp (over 8)"].bytes_per_device) < 0.01 * full

# %% [markdown]
# Weights are not the problem: even replicated, 10.4 GiB fit in a v6e's 31.25 GiB. The problem
# is what a step *computes*: reference attention materialises, per head, an `S × S` score
# matrix, and at 720p and 81 frames `S` is almost 40,000.
#
# ## 3. Memory per chip, by compiler: the dry-run
#
# `tpupedia.dryrun.run` builds the full-size model on `meta`, gives every parameter an
# abstract, sharded `ShapeDtypeStruct`, traces one denoising step (batch 2) through torchax, and
# compiles it for the TPU slice. A program that does not fit comes back with the compiler's own
# figures.

# %%
import dataclasses
import json
from pathlib import Path

if preset.compile_full_size:  # the 42-layer compile that fails, read from its record (tpupedia dryrun --record)
    fields = {f.name for f in dataclasses.fields(dryrun.DryRunReport)}
    record = next(r for r in json.loads((Path("..") / dryrun.DEFAULT_RECORDS).read_text())["records"]
                  if (r["model"], r["attention"], r["width"], r["height"], r["frames"], r["layers_compiled"])
                  == ("cogvideox", "reference", 1280, 720, 81, 42))
    reference = dryrun.DryRunReport(**{k: v for k, v in record.items() if k in fields})
else:
    reference = dryrun.run("cogvideox", topology="v6e:2x4", resolution="720p", frames=81,
                           sharding="tp", attention="reference", layers=layers)
print(reference.summary())

# %%
assert not reference.fits
assert reference.oom_required_bytes > reference.oom_available_bytes
print(f"reference attention needs {reference.oom_required_bytes / reference.oom_available_bytes:.2f}x "
      "the HBM a v6e chip gives a program")

# %% [markdown]
# *AOT here: libtpu 0.0.42.1 (from `jax[tpu]==0.10.2`), compiled on a CPU host.* With one
# layer compiled, the temporaries are those of one layer. Layers run one after another and
# reuse most of their working set, but not all of it: the full-depth compile that
# `tpupedia dryrun cogvideox --attention reference --record` stored on the results page needs
# more (39.84 GiB against 35.96 GiB here). A shallow "does not fit" stands; a shallow "fits"
# close to the limit deserves a full-depth compile.
#
# Now the same step with Splash attention (notebook `splash_attention`): the kernel streams keys and values
# through on-chip memory block by block and never materialises the score matrix. The dry-run
# installs `tpupedia.attention`'s override, compiled for the TPU (not in interpret mode), with
# heads split over the `tp` axis, and removes it afterwards.

# %%
import time

start = time.perf_counter()
splash = dryrun.run("cogvideox", topology="v6e:2x4", resolution="720p", frames=81,
                    sharding="tp", attention="splash", layers=layers)
print(splash.summary())
if preset.compile_full_size:
    print(f"compiled all 42 layers for v6e:2x4 in {time.perf_counter() - start:.0f} s on this host")

# %%
assert splash.fits
assert splash.arguments_bytes + splash.temporaries_bytes + splash.outputs_bytes < splash.hbm_bytes
assert splash.temporaries_bytes < reference.oom_required_bytes / 10
print(f"temporaries: {reference.oom_required_bytes / 2**30:.2f} GiB with reference attention, "
      f"{splash.temporaries_bytes / 2**30:.2f} GiB with splash")

# %% [markdown]
# ## 4. Sharding strategies side by side
#
# At 480p and 49 frames reference attention fits, so we can compare what the strategies cost in
# memory and in communication (replicating everything, the baseline, needs no collectives and
# holds the 10.4 GiB of section 2 on every chip). `tp` is Megatron tensor parallelism for torch's `(out, in)`
# weights (column-parallel projections split dimension 0, row-parallel ones dimension 1);
# `tp_transposed` is the upstream project's "TP" table, which splits the other dimension of every
# matrix (notebook `sharding` measures it on a tiny Llama: more collectives than `tp`, several times
# the bytes sent, and an all-reduce of the full logits); `fsdp` splits every matrix over all
# eight chips and gathers it before use. Each strategy compiles one layer, on every preset, and
# its collectives are scaled to the 42 layers.

# %%
strategies = {}
for name in ("tp", "tp_transposed", "fsdp"):
    strategies[name] = dryrun.run("cogvideox", resolution="480p", frames=49, sharding=name,
                                  attention="reference", layers=1)
print(f"{'strategy':<14} {'weights+inputs':>14} {'temporaries':>11} {'sent/chip':>10} {'ICI floor':>9}  collectives")
for name, r in strategies.items():
    sent = sum(r.collective_bytes.values())
    print(f"{name:<14} {r.arguments_bytes / 2**30:>10.2f} GiB {r.temporaries_bytes / 2**30:>7.2f} GiB "
          f"{sent / 2**30:>6.2f} GiB {r.floors['communication'] * 1e3:>6.1f} ms  {r.collectives or 'none'}")
print(f"compute floor of the step: {strategies['tp'].floors['compute'] * 1e3:.1f} ms (the same for every strategy)")

# %% [markdown]
# Read the table per strategy. `tp` has exactly Megatron's two all-reduces per layer (after the
# attention output projection and after the MLP), and each chip runs attention for a quarter of
# the heads, so its temporaries are the smallest. The "sent/chip" column counts bytes, not
# operations: each collective's result shape in the compiled program, times the ring
# algorithm's traffic for its group size (`tpupedia.aot.collective_traffic`, scaled from the
# compiled layer to all 42). Divided by what one chip can send, that gives a communication
# floor to set beside the compute floor (How to Scale Your Model's method: the step's roofline
# is the largest of the compute, HBM and communication floors). What one chip can send is not
# the v6e's headline 800 GB/s: that counts four ports and both directions. A ring along one
# axis of the torus uses two ports, one direction each, 100 GB/s apiece: 200 GB/s
# (`hardware.Chip.ring_bytes_per_s`, from Google's v6e page; notebook `beyond_one_host` and the hardware page
# show the arithmetic). `tp_transposed` holds the same weight bytes,
# but every matmul now splits the wrong dimension for the next one: the compiler re-shards
# activations with many more collectives, and attention runs on all heads on every chip. That
# traffic makes it **communication-bound** even at 480p: its ICI floor is about three times the
# compute floor. `tp` and `fsdp` stay compute-bound, with ICI floors close below it.
# `fsdp` holds the fewest weight bytes and pays with all-gathers of each weight before use,
# and, like `tp_transposed`, with whole-head attention per chip.

# %%
depth = 1  # layers compiled per strategy
assert all(r.fits for r in strategies.values())
assert strategies["tp"].collectives == {"all-reduce": 2 * depth}
assert sum(strategies["tp_transposed"].collectives.values()) > 5 * sum(strategies["tp"].collectives.values())
assert strategies["tp_transposed"].temporaries_bytes > 2 * strategies["tp"].temporaries_bytes
assert strategies["fsdp"].arguments_bytes < strategies["tp"].arguments_bytes
assert strategies["tp"].collectives.get("all-reduce", 0) >= 1
assert strategies["fsdp"].collectives.get("all-gather", 0) >= 1
sent = {name: sum(r.collective_bytes.values()) for name, r in strategies.items()}
assert sent["tp_transposed"] > 2 * sent["tp"]  # more bytes, not just more operations
# at 480p, with ICI at 200 GB/s per chip (a one-axis ring): tp and fsdp compute-bound, tp_transposed not
assert strategies["tp"].bound == strategies["fsdp"].bound == "compute"
assert strategies["tp_transposed"].bound == "communication"
assert strategies["tp_transposed"].floors["communication"] > 2 * strategies["tp_transposed"].floors["compute"]
for r in strategies.values():  # the floor is the bytes sent over 2 ports x 100 GB/s, not over the 800 GB/s total
    assert abs(r.floors["communication"] - sum(r.collective_bytes.values()) / 200e9) < 1e-12

# %% [markdown]
# ## 5. From reported step times to MFU
#
# Model FLOPs utilisation (MFU) is the step's useful FLOPs divided by what the chips could do in
# the time it took. The upstream project reports, on a TPU v6e-8, **2.13 s per step** for
# CogVideoX1.5-5B at 720p, 81 frames, and **7.29 s per step** for HunyuanVideo-1.5 at 720p, 121
# frames (with its "TP + fc2 replicated" sharding). Both are *reported upstream*, not measured
# here; the FLOPs are our analytic counts, for the guidance pair as a batch of 2. Mind what each
# time is: the CogVideoX figure is the whole run (text encoder and VAE included) divided by 50,
# so the MFU below is a lower bound for its denoising steps; the HunyuanVideo-1.5 figure times
# the denoising steps (the knowledge base's corrections page, entry 21, sorts the CogVideoX
# figures out).

# %%
reported = {
    "CogVideoX1.5-5B, 720p, 81 frames": (cogvideox.step_flops(1280, 720, 81), 2.13),
    "HunyuanVideo-1.5, 720p, 121 frames": (hunyuan.step_flops(1280, 720, 121), 7.29),
}
peak = 8 * v6e.bf16_flops
for name, (f, seconds) in reported.items():
    floor = f["total"] / peak
    print(f"{name}: {f['total']:.3e} FLOPs/step, floor {floor:.2f} s, reported {seconds} s "
          f"-> MFU {f['total'] / (seconds * peak):.0%}, attention {f['attention'] / f['total']:.0%} of FLOPs")

# %%
mfu = {name: f["total"] / (seconds * peak) for name, (f, seconds) in reported.items()}
assert all(0.05 < m < 0.5 for m in mfu.values())

# %% [markdown]
# Both runs sit well below the chips' peak, and attention is most of the work in both. That
# points at the attention kernel: Splash attention's block sizes, the padding of sequences to
# those blocks (notebook `splash_attention`), and the exp/softmax work on the vector units, which the MXU peak
# does not count. The upstream profile of a HunyuanVideo-1.5 block (reported upstream, v6e-8:
# about 35 ms in splash attention and 45 ms in linear layers plus all-reduces) agrees that both
# halves matter. The roofline says how much room there is; the profile says where to look.
#
# Drawn to scale, each floor split into its attention and linear FLOPs at the bf16 peak, beside
# the time reported for it. The CogVideoX bar is the whole run over 50 (106.47 s for a 720p
# video, yangwhale/gpu-tpu-pedia, commit 3fa9ce1, `tpu/CogVideoX/README.md`), so part of its
# gap is the text encoder and the VAE; the HunyuanVideo-1.5 bar times the denoising steps alone.
# Notebook `hunyuan_tuning_and_i2v` (section 3) splits that model's gap with upstream's per-block profile, and
# notebook `beyond_one_host` (section 5) prices both gaps per video.

# %%
fig, ax = plt.subplots(figsize=(7.5, 2.8))
labels = []
for i, (name, (f, seconds)) in enumerate(reported.items()):
    model = name.split(",")[0]
    attention, linear = f["attention"] / peak, f["linear"] / peak
    ax.barh(2 * i + 1, attention, color="tab:blue", label="floor: attention FLOPs at peak" if i == 0 else None)
    ax.barh(2 * i + 1, linear, left=attention, color="tab:orange", label="floor: linear FLOPs at peak" if i == 0 else None)
    ax.barh(2 * i, seconds, color="tab:gray", label="reported upstream (v6e-8)" if i == 0 else None)
    ax.text(seconds, 2 * i, f" {seconds} s = {seconds / (attention + linear):.1f}x the floor", va="center", fontsize=9)
    labels += [f"{model} reported", f"{model} floor"]
ax.set_yticks(range(4), labels)
ax.set_xlim(0, 11)
ax.set_xlabel("seconds per denoising step")
ax.legend(loc="lower right", fontsize=8)
ax.set_title("Roofline floor against reported step time, TPU v6e-8")
plt.tight_layout()
plt.show()

# %%
gaps = {name.split(",")[0]: seconds / (f["total"] / peak) for name, (f, seconds) in reported.items()}
print({name: round(gap, 1) for name, gap in gaps.items()})
assert 6 < gaps["CogVideoX1.5-5B"] < 7 and 4 < gaps["HunyuanVideo-1.5"] < 4.5

# %% [markdown]
# ### From the floor to a prediction
#
# A floor says how fast a step could possibly be; renting a slice needs how fast it will be. The
# TPU compiler has a cost model of its own: every executable it compiles carries a cost analysis
# (`aot.compiled_cost`) with the program's per-chip FLOPs, its HBM bytes and the compiler's time
# estimate, `optimal_seconds`. Before leaning on any of it, three programs whose time is known,
# compiled here for the same v6e-8 (a few seconds each): an elementwise op, bound by HBM; a
# matmul split so that it needs no collective, bound by the MXU; and an all-reduce, bound by the
# ICI links.

# %%
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot


def on_slice(shape, spec):
    return aot.abstract(shape, jnp.bfloat16, NamedSharding(tpu_mesh, spec))


def all_reduce(a):
    return jax.shard_map(lambda b: jax.lax.psum(b, "tp"), mesh=tpu_mesh, in_specs=P(("dp", "tp"), None),
                         out_specs=P(("dp", "tp"), None))(a)


n = 8192
known = {  # the program, its abstract arguments, what its time is known to be and why
    "elementwise, 128 MiB per chip": (lambda a: a * 2 + 1, [on_slice((16384, 65536), P("dp", "tp"))],
                                      2 * 2 * 16384 * 65536 / 8 / v6e.hbm_bytes_per_s, "its bytes at HBM bandwidth"),
    "matmul 8192^3, no collective": (lambda a, b: a @ b, [on_slice((n, n), P("dp", None)), on_slice((n, n), P(None, "tp"))],
                                     2 * n**3 / 8 / v6e.bf16_flops, "its FLOPs at the bf16 peak"),
    "all-reduce, 64 MiB per chip, tp=4": (all_reduce, [on_slice((8 * 4096, 8192), P(("dp", "tp"), None))],
                                          2 * 3 / 4 * 64 * 2**20 / v6e.ring_bytes_per_s, "its ring traffic at ICI bandwidth"),
}
estimated = {}
for name, (fn, args, seconds, why) in known.items():
    estimated[name] = aot.compiled_cost(aot.compile_aot(fn, *args))["seconds"]
    print(f"{name:36} compiler {estimated[name] * 1e6:6.0f} us | {why}: {seconds * 1e6:6.0f} us")

# %% [markdown]
# The elementwise op is exact: the compiler's model of HBM is the chip's bandwidth. The matmul
# comes out above its compute floor, as a real one runs. The all-reduce comes out several times
# too fast: the compiler counts a collective as the memory it touches, not the time its bytes
# spend on the links. And what the table cannot show: a Pallas kernel is a custom call the
# compiler cannot see into, so a splash attention call counts as almost nothing. Worse, for a
# whole CogVideoX1.5-5B layer (attention stood in) the estimate comes out **negative**. So
# `tpupedia.predict` keeps the compiler's counts and drops its estimate, and builds a step time
# from three parts:
#
# 1. **XLA**: the step compiled with attention replaced by a stand-in that reads the same
#    queries, keys and values and writes an output of the same shape, at 1 and at 2 layers (the
#    difference is one layer, scaled to full depth); its FLOPs at the bf16 peak plus its bytes at
#    the HBM bandwidth;
# 2. **splash**: every attention call the stand-in saw, padded to the kernel's blocks, as the MXU
#    passes it takes at the bf16 peak: the head dimension counted at the MXU's width (a 64-wide
#    head fills a quarter of a v6e's 256 x 256 array; the next cells say why this matters);
# 3. **ICI**: the compiled collectives' bytes at a one-axis ring's bandwidth, not overlapped.
#
# Nothing is fitted to the step times it is compared with. The four predictions, made with
# `tpupedia predict ... --record` (the full preset makes them again, eight full-size compiles,
# minutes each on a CPU host; the tiny one reads the records):

# %%
from tpupedia import predict, results

if preset.compile_full_size:
    predictions = [predict.predict_step(r["model"], "v6e:2x4", r["resolution"], r["frames"], sharding=r["sharding"],
                                        mesh_shape=r["mesh"], reported_step_s=r["step_s"]).as_dict()
                   for r in predict.REPORTED]
else:
    recorded = results.load(Path("..") / predict.DEFAULT_RECORDS)
    predictions = [next(x for x in recorded if (x["model"], f"{x['width']}x{x['height']}", x["sharding"], x["batch"])
                        == (r["model"], r["resolution"], r["sharding"], 2)) for r in predict.REPORTED]
print(f"{'run':34} {'XLA':>6} {'splash':>7} {'ICI':>6} {'predicted':>10} {'reported':>9} {'error':>6}  compiler's own")
for x in predictions:
    print(f"{x['model'] + ' ' + str(x['width']) + 'x' + str(x['height']) + ', ' + str(x['frames']) + 'f':34} "
          f"{x['xla_s']:6.2f} {x['attention_s']:7.2f} {x['ici_s']:6.2f} {x['step_s']:10.2f} "
          f"{x['reported_step_s']:9.2f} {x['error']:+6.0%}  {x['compiler_estimate_s']:.2f} s for 1 layer")

# %% tags=["check"]
# the compiler's estimate on the known programs: exact for HBM, above the floor for the MXU, far under the ring
elementwise, matmul, reduce = (estimated[k] / known[k][2] for k in known)
assert abs(elementwise - 1) < 0.01 and 1 < matmul < 3 and reduce < 1 / 3
# each prediction: three positive parts that add up, against the time reported for the same run
assert all(abs(x["xla_s"] + x["attention_s"] + x["ici_s"] - x["step_s"]) < 1e-9 for x in predictions)
assert all(min(x["xla_s"], x["attention_s"], x["ici_s"]) > 0 and x["reported_step_s"] for x in predictions)
assert all(x["compiler_estimate_s"] < 0 for x in predictions)  # why the estimate is not used
# each prediction within 35% of the time reported for its run, on either side
assert all(abs(x["error"]) < 0.35 for x in predictions), [round(x["error"], 3) for x in predictions]

# %% [markdown]
# Two come out close (Wan, 1% and 7% over), two about 30% under (CogVideoX and
# HunyuanVideo-1.5). These are not the first predictions this notebook made. Until 2026-12-02
# splash ran at 83% of the bf16 peak, the rate upstream's profile of one HunyuanVideo-1.5 block
# implies, and all four came out 9% to 61% under. Three hypotheses were named for the gaps; each
# can be tested without a chip, and the model changed only where a cause showed. Never fit a model
# to the four numbers it is checked against: that would leave nothing to check it with.
#
# 1. **Heads narrower than the MXU.** QK^T contracts over the head dimension and PV's output is
#    that wide, so a 64-wide head fills a quarter of each pass of a v6e's 256 x 256 MXU and a
#    128-wide one half; on a v5e's 128 x 128 a 128-wide head fills it. That is arithmetic on
#    the array's shape (Google's TPU architecture page gives it).
# 2. **The profile.** Taken at the shape it was assumed to have (720p, 121 frames, the guidance
#    pair), its 35 ms is more than the MXU can do with 128-wide heads.
# 3. **CogVideoX's report is a whole run over 50.** Its staged run reports the 50 steps alone.

# %%
from tpupedia.models import cogvideox as cogvideox_facts

heads = {"cogvideox": 64, "hunyuan": 128, "wan": 128}
for family, d in heads.items():
    print(f"{family:10} {d:3}-wide heads fill {predict.mxu_fill(d, v6e):.0%} of a v6e MXU pass, "
          f"{predict.mxu_fill(d, hardware.chip('v5e')):.0%} of a v5e's")
ceiling = predict.mxu_fill(predict.SPLASH_REPORT["head_dim"], v6e)
print(f"profile at its assumed shape: {predict.profile_rate():.0%} of peak, against a ceiling of {ceiling:.0%}")
whole = next(r for r in predict.REPORTED if r["model"] == "cogvideox")
staged = {(s["resolution"], s["stage"]): s["seconds"] for s in cogvideox_facts.REPORTED_STAGES if s["what"] == "run"}
print(f"CogVideoX 720p: {whole['step_s']:.2f} s/step whole run, {staged[('1280x720', 'denoise')] / 50:.2f} steps alone; "
      f"768p steps alone {staged[('1360x768', 'denoise')] / 50:.2f} s/step")

# %% tags=["check"]
# 1: the model pads each head to the MXU's width: the recorded predictions ran splash at that fill
assert [x["splash_efficiency"] for x in predictions] == [predict.mxu_fill(heads[x["model"]], v6e) for x in predictions]
# 2: the profile would beat the MXU at its assumed shape, so it cannot be of that program
assert predict.profile_rate() > 1.5 * ceiling
# 3: the whole run explains under 3% of CogVideoX's step; its 768p run, with more tokens, is faster
assert whole["step_s"] / (staged[("1280x720", "denoise")] / 50) - 1 < 0.03
assert staged[("1360x768", "denoise")] < staged[("1280x720", "denoise")]

# %% [markdown]
# What each showed:
#
# 1. **A cause, and the model changed.** Splash is now its MXU passes at the peak
#    (`tpupedia.predict.mxu_fill`, `splash_flops(..., chip)`), with no rate taken from a
#    profile. That is the MXU's ceiling, a floor on the kernel's time: the softmax's
#    exponentials on the vector unit are not counted.
# 2. **The profile retired.** Upstream's guide says it was taken with `stage2_transformer_flax.py`,
#    a script that is not in the repository at commit 3fa9ce1, and gives no size or frames. At
#    the shape assumed it runs 1.66x faster than the array allows, so it is not of that program;
#    and its 80 of 135 ms per block tells nothing about the 7.29 s run.
# 3. **Not the cause.** The steps alone take 2.08 s, 2% under the whole run's 2.13. The same
#    table has the 768p run, with 13% more tokens, 1.8x faster, and upstream suspects its own
#    conditions. No model that scales with the work meets both reports: the recorded plan of the
#    768p run comes out over its report (notebook `tune_before_you_rent`), this step 30% under.
#
# HunyuanVideo-1.5 is still 31% under with nothing left to blame. Only a profile on a slice can
# find what is missing (notebook `profiling`). The prediction is for ranking settings on one model,
# which is what the tuning loop needs. It is not a promise of seconds.

# %% [markdown]
# ## 6. The whole run: every stage, planned before it runs
#
# A denoising step is one program of a run, not the run. Before it, the text encoders turn the
# prompt into embeddings; after it, the VAE decodes the latents into frames, in several calls of
# different shapes. Each stage loads its own models and frees them when it ends, so what must fit
# a chip is each stage's peak, not the sum. A batch (`--prompts`) keeps every stage's models
# resident between prompts, so there each stage's peak also holds the other stages' weights.
# A dry-run of one step cannot see any of that.
#
# `tpupedia.plan.make` can. It builds the pipeline class that `tpupedia generate` runs, with
# abstract weights on PyTorch's `meta` device, and asks each stage for the programs it compiles.
# Each stage's text encoders come at their real token lengths, the denoise step is built by the
# same code the pipeline runs, and the decoder is planned at every call shape. It then compiles
# each program for the slice. The report gives, per stage and per chip, the weights, the
# compiler's arguments, temporaries and outputs, and what other stages leave resident. It names
# the binding stage, and `Plan.check()` refuses a run that will not fit, naming the stage and
# the option that would fix it.
#
# Here we plan the text and denoise stages for `v6e:2x4`. On `tiny` this uses the tiny
# checkpoint's configs, which takes seconds. On `full` it uses the release's configs with one
# layer per model; the other layers' weight shards are added from their shapes. We plan each
# run twice: once for one video, once for a batch. The decode stage is left out because the VAE
# decoder's compile takes over a minute on this host even for a tiny VAE (HunyuanVideo-1.5's: 75 s,
# measured here).
# `tests/test_plan.py` plans it.

# %%
from tpupedia import aot, plan, results
from tpupedia.pipelines import cogvideox as cogvideox_pipeline

configs = (cogvideox.full_configs() if preset.pretrained
           else cogvideox.component_configs(cogvideox.model_source(preset)[0]))
request = cogvideox_pipeline.Request(prompt="a panda playing a guitar", **cogvideox.default_request(preset))
runs = {kind: plan.make("cogvideox", request, cogvideox_pipeline.Options(), configs=configs, topology="v6e:2x4",
                        layers=1 if preset.pretrained else None, stages=("text", "denoise"), resident=kind == "batch")
        for kind in ("one video", "batch")}
print(f"{request.width}x{request.height}, {request.frames} frames, {request.steps} steps; "
      f"mesh {runs['one video'].mesh}, attention {runs['one video'].attention}")
for kind, p in runs.items():
    for s in p.stages:
        print(f"{kind:>9} {s.stage:>8}: peak {aot.format_bytes(s.peak):>10} per chip = largest program "
              f"{aot.format_bytes(s.peak - s.resident):>10} + resident from other stages {aot.format_bytes(s.resident)}")
    print(f"{kind:>9} binding stage: {p.binding}; {'fits' if p.fits else p.advice()}")

# %% [markdown]
# For one video, nothing is resident: the text stage's weights are gone before the transformer
# loads. In a batch, the denoise peak also carries the text encoders, and the text peak carries
# the transformer. The attention the step compiled with is splash at CogVideoX's block sizes
# (`cogvideox.SPLASH_BLOCK_SIZES`, upstream's tuned values), as a run on the TPU picks it.

# %%
one, batch = runs["one video"], runs["batch"]
assert one.fits and batch.fits and one.binding == "denoise"
assert all(s.resident == 0 for s in one.stages)
for stage, other in (("text", "denoise"), ("denoise", "text")):
    assert batch.stage(stage).resident == one.stage(other).weights > 0
    assert batch.stage(stage).peak == one.stage(stage).peak + one.stage(other).weights
assert one.attention == "splash " + "/".join(map(str, cogvideox.SPLASH_BLOCK_SIZES))

# %% [markdown]
# At full size, the release configs were planned this way for both families, on a whole v6e-8
# and on a 4-chip host, with `tpupedia plan FAMILY --topology T --layers 1 --stages text,denoise
# --record`. The figures below are AOT here, on a CPU host. The results page shows them with
# their commands.

# %%
from IPython.display import Markdown

full_plans = [r for r in results.load(Path("..") / plan.DEFAULT_RECORDS)  # the two families' releases on v6e
              if r["layers"] == 1 and [s["stage"] for s in r["stages"]] == ["text", "denoise"]
              and r["topology"].startswith("v6e:") and r.get("checkpoint") in (cogvideox.FULL_ID, hunyuan.FULL_ID)]
peaks = {(r["family"], r["chips"]): {s["stage"]: s["peak"] for s in r["stages"]} for r in full_plans}
rows = ["| model | request | slice | text | denoise | binding |", "|---|---|---|---|---|---|"]
for r in sorted(full_plans, key=lambda r: (r["family"], -r["chips"])):
    q, p = r["request"], peaks[(r["family"], r["chips"])]
    rows.append(f"| {r['family']} | {q['width']}x{q['height']}, {q['frames']} frames | {r['topology']} ({r['chips']} chips) "
                f"| {aot.format_bytes(p['text'])} | {aot.format_bytes(p['denoise'])} | {r['binding']} |")
Markdown("\n".join(rows))

# %% tags=["check"]
assert {(f, c) for f, c in peaks} == {(f, c) for f in ("cogvideox", "hunyuan") for c in (8, 4)}
assert all(r["fits"] and r["binding"] == "denoise" for r in full_plans)
for f in ("cogvideox", "hunyuan"):  # half the chips: each chip holds twice the shard
    assert peaks[(f, 4)]["denoise"] > peaks[(f, 8)]["denoise"] and peaks[(f, 4)]["text"] > peaks[(f, 8)]["text"]

# %% [markdown]
# Those plans leave the decode out. The recorded full-depth CogVideoX plans for the v6e-8 put it
# back (`tpupedia plan cogvideox --topology v6e:2x4 --stages text,denoise --record`, then
# `--stages decode`). The stages run one after another and each frees its model, so the run's
# peak per chip is its largest stage, not the sum, and the largest is the decode: the VAE's
# activations at 1360x768, split over the host's chips, outweigh the transformer's shards.

# %%
cogvideox_plans = [r for r in results.load(Path("..") / plan.DEFAULT_RECORDS)
                   if r["family"] == "cogvideox" and r["topology"] == "v6e:2x4" and r["layers"] is None]
budget = {s["stage"]: s["peak"] for r in cogvideox_plans for s in r["stages"]}
hbm = cogvideox_plans[0]["hbm"]
for stage, size in sorted(budget.items(), key=lambda item: ("text", "denoise", "decode").index(item[0])):
    print(f"{stage:>8}: {size / 2**30:6.2f} GiB per chip of {hbm / 2**30:.2f}")
print("binding stage:", max(budget, key=budget.get))

# %% tags=["check"]
assert set(budget) == {"text", "denoise", "decode"} and max(budget, key=budget.get) == "decode"
assert all(size < hbm for size in budget.values())

# %% [markdown]
# ### Exercise 3: one chip, and the binding stage moves
#
# The results page also holds a plan of CogVideoX 1.0's 2B release at its own default video
# (720x480, 49 frames) on a single v5e chip (15.75 GiB of HBM for a program), made the same way
# (the solution prints its command). On the v6e-8 the denoise stage binds. **Predict** first: on one chip, which stage
# binds, and roughly how large its peak is? Weigh what each stage must hold whole now that
# nothing is split: T5-XXL (`cogvideox.full_text_encoder_config()`) against the 2B transformer,
# both counted from their shapes on `meta` as in section 2. Then compile it: the solution plans the
# release for one v5e chip (`plan.make(..., topology="v5e:1x1")`; on the tiny preset the tiny
# checkpoint, in seconds, whose shapes are too small to say what binds at full size) and sets the
# recorded full-size plan beside it.

# %% tags=["solution"]
from transformers import T5Config, T5EncoderModel

with torch.device("meta"):
    t5 = T5EncoderModel(T5Config(**cogvideox.full_text_encoder_config())).to(torch.bfloat16)
    transformer_2b = CogVideoXTransformer3DModel(**cogvideox.full_transformer_config(size="2b")).to(torch.bfloat16)
weights_2b = {stage: sum(2 * t.numel() for t in (*model.parameters(), *model.buffers()))  # 1.0's positions are a buffer
              for stage, model in (("text", t5), ("denoise", transformer_2b))}
(one_chip,) = [r for r in results.load(Path("..") / plan.DEFAULT_RECORDS)
               if r["checkpoint"] == cogvideox.SMALL_ID and r["topology"] == "v5e:1x1" and r["fits"]
               and [st["stage"] for st in r["stages"]] == ["text", "denoise"]  # its decode is a plan of its own
               and "--block-sizes" not in r["command"]]  # the blocks the plan chose for the chip
for st in one_chip["stages"]:
    print(f"{st['stage']:>8}: peak {st['peak'] / 2**30:5.2f} GiB, of which weights {weights_2b[st['stage']] / 2**30:5.2f} GiB "
          "(from shapes)")
print(one_chip["command"])
print(f"binding stage on {one_chip['topology']}: {one_chip['binding']} (of {one_chip['hbm'] / 2**30:.2f} GiB)")

if preset.compile_full_size:  # the 2B release's own configs, one layer per model: minutes on a CPU host
    small_configs = cogvideox.full_configs(size="2b")
    small_request = cogvideox_pipeline.Request(prompt="a panda playing a guitar", **cogvideox.RELEASE_REQUESTS[cogvideox.SMALL_ID])
else:
    small_configs, small_request = configs, request
compiled = plan.make("cogvideox", small_request, cogvideox_pipeline.Options(), configs=small_configs, topology="v5e:1x1",
                     layers=1 if preset.pretrained else None, stages=("text", "denoise"))
print(f"compiled now for {compiled.topology}: " + ", ".join(f"{s.stage} peak {aot.format_bytes(s.peak)}" for s in compiled.stages)
      + f"; binding: {compiled.binding}, attention {compiled.attention}")

# %% tags=["check"]
assert one_chip["chips"] == 1 and one_chip["binding"] == "text" and runs["one video"].binding == "denoise"
assert weights_2b["text"] > weights_2b["denoise"]  # T5-XXL outweighs the 2B transformer
assert all(abs(st["weights"] - weights_2b[st["stage"]]) < 0.01 * st["weights"] for st in one_chip["stages"])
one_chip_peaks = {st["stage"]: st["peak"] for st in one_chip["stages"]}
assert weights_2b["text"] <= one_chip_peaks["text"] < 1.1 * weights_2b["text"]  # the text peak is its weights
# the compile just made: one chip, every stage planned, the binding stage the one with the highest peak
assert compiled.chips == 1 and compiled.fits and [s.stage for s in compiled.stages] == ["text", "denoise"]
assert compiled.binding == max(compiled.stages, key=lambda s: s.peak).stage

# %% [markdown]
# On a TPU VM every full-size run checks its plan itself, before it loads any weight, on the VM's
# own chips (`plan.preflight`): `tpupedia generate --preset full`, and a notebook's or a script's
# `pipeline.run`, `run_batch` or the stage methods of a pipeline built by hand
# (`pipelines.common.check_plan`). It compiles one layer per model, caches the
# answer per shape, and refuses a run that will not fit in one line. It also decides VAE tiling
# (`--vae-tiling auto`): on only when the untiled decode does not fit one chip. What a one-layer
# plan cannot prove is the full depth's temporaries. Layers run one after another and reuse most
# of their working set, but section 3 showed that a full-depth compile can need more, so a plan
# that fits close to the limit deserves `tpupedia plan` without `--layers`.
#
# The same check can run here, before you rent anything: with `TPUPEDIA_REHEARSE=v6e:2x4` set,
# every way in plans its run for that slice instead of this host's devices, reads the release's
# configs from the family module instead of the Hub, and stops before a weight loads with one line
# saying what it planned (`tpupedia.rehearsal`). So
# `TPUPEDIA_REHEARSE=v6e:2x4 tpupedia generate hunyuan --preset full --prompt "..."` tells you on
# your laptop whether that command fits a v6e-8, and `make rehearse` does it for every `generate`
# path and every notebook's full-preset calls (`tpupedia.rehearse`).
#
# ## 7. A chip with two devices: TPU7x
#
# Everything above counted chips, because on a v5e or a v6e a chip is one JAX device. A TPU7x
# (Ironwood) chip is not: its two TensorCores are two devices, each with half the chip's 192 GiB
# of HBM and half its compute (Google's [TPU7x page](https://docs.cloud.google.com/tpu/docs/tpu7x),
# read 2026-12-02). libtpu describes a `tpu7x:2x2x1` slice, a `tpu7x-8`, as four chips and eight
# devices. A mesh, a sharding and a compile budget count devices; peaks, HBM per chip and prices
# count chips (`hardware.Topology`: `num_chips`, `num_devices`, `hosts`).

# %%
seven = hardware.parse_topology("tpu7x:2x2x1")
found = devices.tpu_topology(seven)
print(f"{seven.name} ({seven.accelerator_type}): {seven.num_chips} chips, {seven.num_devices} devices, "
      f"{seven.hosts} host; a device's compile budget {aot.hbm_budget(found) / 2**30:.2f} GiB")
mesh7 = devices.topology_mesh(seven, (2, 4), ("dp", "tp"))
for i, row in enumerate(mesh7.devices):
    print(f"dp={i}: tp group", " ".join(f"chip{tuple(d.coords)}/core{d.core_on_chip}" for d in row))

# %% tags=["check"]
assert (seven.num_chips, seven.num_devices, len(found)) == (4, 8, 8)
assert aot.hbm_budget(found) < hardware.chip("tpu7x").hbm_bytes / 2  # a device has half the chip's HBM
for row in mesh7.devices:  # each chip's two cores sit side by side along tp
    assert [tuple(d.coords) for d in row[0::2]] == [tuple(d.coords) for d in row[1::2]]

# %% [markdown]
# JAX's mesh builder puts a chip's two cores next to each other along the last axis, `tp`. That
# is the axis to keep close: tensor parallelism all-reduces inside every layer, while `dp` splits
# the guidance pair and sends nothing during a step. So each `tp` group of four is two chips of two
# cores, and half of every all-reduce stays on a chip.
#
# Now one program on both slices: CogVideoX1.5's denoising step at 480p and 49 frames, one layer
# compiled with splash attention (memory), and the predictor's full-depth step time (section 5's
# model: the compiler's counts at each device's share of its chip's peak, splash as its MXU
# passes at the chips' peak). The TPU7x time is predicted, and no one has reported one for this
# course's code: read it as what the model expects, not as a measurement.

# %%
from tpupedia import predict

side = {}
for name in ("v6e:2x4", "tpu7x:2x2x1"):
    memory = dryrun.run("cogvideox", topology=name, resolution="480p", frames=49, attention="splash", layers=1)
    step = predict.predict_step("cogvideox", name, "480p", 49)
    side[name] = (memory, step)
print(f"{'slice':<12} {'devices':>7} {'per device':>11} {'budget':>9}  predicted step (not measured)")
for name, (memory, step) in side.items():
    peak = memory.arguments_bytes + memory.temporaries_bytes + memory.outputs_bytes
    print(f"{name:<12} {hardware.parse_topology(name).num_devices:>7} {peak / 2**30:>7.2f} GiB "
          f"{memory.hbm_bytes / 2**30:>5.2f} GiB  {step.step_s:.2f} s")

# %% tags=["check"]
(v6e_memory, v6e_step), (tpu7x_memory, tpu7x_step) = side["v6e:2x4"], side["tpu7x:2x2x1"]
assert v6e_memory.fits and tpu7x_memory.fits and tpu7x_memory.hbm_bytes > 2.5 * v6e_memory.hbm_bytes
assert v6e_memory.mesh == tpu7x_memory.mesh == {"dp": 2, "tp": 4}  # the same mesh: 8 devices each
assert tpu7x_step.step_s < v6e_step.step_s  # 4 chips of 2,307 TFLOP/s against 8 of 918

# %% [markdown]
# The same mesh, the same shards per device, three times the budget per device; and half the
# chips, each 2.5 times a v6e's bf16 peak, so the model predicts a faster step. Whether the
# kernels reach that peak on TPU7x is what the predictor cannot know: its splash is the MXU's
# ceiling on both, and TPU7x's MXU width (256, as v6e's) is on no page read here, only assumed.
#
# A one-chip slice is the other end. The blocks the families tuned on v6e need more scoped VMEM
# than a v5e's compiler gives a kernel (16 MiB against the v6e's 32, `Chip.scoped_vmem_bytes`, measured
# here from libtpu's refusals), so a pipeline, a plan and the dry-run on a v5e step them down until
# the compiler fits them (`attention.chip_block_sizes`), and a plan that still fails names the
# limit flag to raise instead.

# %%
from tpupedia import attention

v5e_chip = devices.tpu_topology("v5e:1x1")[0]
v5e_blocks = attention.chip_block_sizes(v5e_chip, cogvideox.SPLASH_BLOCK_SIZES)
print(f"CogVideoX's splash blocks: {'/'.join(map(str, cogvideox.SPLASH_BLOCK_SIZES))} on a v6e, "
      f"{'/'.join(map(str, v5e_blocks))} on a v5e")

# %% tags=["check"]
assert attention.chip_block_sizes(found[0], cogvideox.SPLASH_BLOCK_SIZES) == cogvideox.SPLASH_BLOCK_SIZES
assert v5e_blocks in attention.block_candidates(cogvideox.SPLASH_BLOCK_SIZES)[1:]

# %% [markdown]
# ## Takeaways
#
# * Count FLOPs first. At 720p and 81 frames, attention is over two thirds of a CogVideoX step.
# * Weights are computed from shapes on the `meta` device; sharding plans are exact and free.
# * The TPU compiler, run ahead of time on a CPU host, answers "does it fit": reference
#   attention at 720p/81 frames does not, by the compiler's own figures; splash attention does,
#   with room to spare.
# * Compare strategies by per-chip bytes *and* collectives, from the compiled program.
# * MFU turns a reported step time into a statement about headroom.
# * A run is several programs: `tpupedia plan` compiles each stage's, and the largest stage's peak
#   per chip, with what a batch keeps resident, is what must fit.

# %% [markdown]
# ## Self-check
#
# 1. Why does a step's cost grow faster than its token count as videos get longer, and which part
#    of the transformer decides it?
#
#    <details><summary>Answer</summary>
#
#    The linear layers cost `24 S d²` per layer, linear in the tokens `S`; attention costs
#    `4 S² d`, quadratic. Its share is `S / (S + 6d)`, so past `S = 6d` tokens attention is most
#    of the work and each added token costs more than the last.
#
#    </details>
#
# 2. A compile of one layer says the step fits with 1 GiB to spare. Why is that not yet a reason
#    to rent the slice?
#
#    <details><summary>Answer</summary>
#
#    The weights of the other layers are added from their shapes, but the temporaries are those
#    of the shallow copy. The full-depth compile can need more (section 3: 39.84 GiB against
#    35.96 GiB), so a plan close to the limit deserves `tpupedia plan` without `--layers`.
#
#    </details>
#
# 3. `tp` and `tp_transposed` hold the same weight bytes per chip. Why is one compute-bound and
#    the other communication-bound at 480p?
#
#    <details><summary>Answer</summary>
#
#    `tp_transposed` splits the other dimension of every matrix, so each matmul's output is laid
#    out wrong for the next one and the compiler re-shards activations with many more
#    collectives, several times the bytes. Its communication floor ends above its compute
#    floor; Megatron's `tp` needs only two all-reduces per layer.
#
#    </details>
#
# 4. CogVideoX's reported 2.13 s per step gives an MFU of 15%. Why is that a lower bound, and
#    what does the number not say?
#
#    <details><summary>Answer</summary>
#
#    The reported time is the whole run divided by 50, text encoder and VAE included, so the
#    denoising steps alone ran faster than that. MFU says how much room there is, not where the
#    time goes: that takes a profile.
#
#    </details>
#
# 5. Why does the denoise stage's peak include the text encoder's weights in a batch but not for
#    one video?
#
#    <details><summary>Answer</summary>
#
#    For one video each stage loads its models and frees them before the next stage, so only the
#    largest stage must fit. A batch keeps every stage's models resident between prompts, so
#    each stage's peak also carries the other stages' weights.
#
#    </details>
