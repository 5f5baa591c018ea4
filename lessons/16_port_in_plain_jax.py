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
# # 16 · Appendix: a port in plain JAX and torchax
#
# Every notebook so far leaned on `tpupedia`: the stage files, the sharding tables, the plans.
# A reader who brings a fourth model needs to see the path without them. Here is one family's
# text-to-video, CogVideoX in its 1.0 layout with the DDIM sampler, written with nothing but
# diffusers, torchax and JAX:
#
# 1. load the stock pipeline with diffusers;
# 2. move the transformer's weights to JAX and shard them over a `("dp", "tp")` mesh with
#    `NamedSharding`, by a five-line rule;
# 3. write the sampler as a pure function of the step index, its tables computed on the host;
# 4. compile one denoising step and run the loop;
# 5. decode the latents with the VAE under `jax.jit`;
#
# and then show that the frames are the package's pipeline's (notebook `cogvideox_pipeline`),
# and end with a checklist for porting another model. The port imports one thing from the
# package, `tpupedia.compat`, which makes torchax 0.0.13 importable beside the pinned torch.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | a random 2-layer CogVideoX checkpoint in the 1.0 layout with the DDIM scheduler, 8 simulated devices | under 1 GB of host RAM | about 30 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | `zai-org/CogVideoX-2b` (the 1.0 layout, DDIM): a 1.7B-parameter transformer, T5-XXL run once on the host, the VAE | per chip: the transformer's shard and one step's activations at 720x480, 49 frames (not compiled here) | not measured here: this notebook's full path has not been run on a TPU |
#
# *Reading time: about 13 minutes.*

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
# ## 0. The checkpoint and the request
#
# The tiny preset writes a random checkpoint in the release's layout (the same helper every
# CogVideoX notebook uses); the full preset names the release. The request is what the package's
# pipeline will be asked for at the end, field by field.

# %%
import torch

from tpupedia.models import cogvideox

if preset.pretrained:
    source, size = "zai-org/CogVideoX-2b", dict(frames=49, height=480, width=720, steps=50)
else:
    source, size = str(cogvideox.tiny_checkpoint(scheduler="ddim", patch_size_t=None)), dict(
        frames=9, height=32, width=32, steps=4)
dtype = getattr(torch, preset.dtype)
prompt, negative, guidance, seed = "a red fox in the snow", "blurry", 6.0, 42
print(source if preset.pretrained else "tiny checkpoint", size)

# %% tags=["check"]
assert (size["frames"] - 1) % 4 == 0  # 4k + 1 frames: the VAE keeps the first and packs the rest by 4
assert size["height"] % 16 == 0 and size["width"] % 16 == 0  # the VAE's 8x, then the 2x2 patches

# %% [markdown]
# ## 1. The port
#
# Load with diffusers. The text encoder runs once on the host (one T5 forward per prompt: not
# worth compiling for one video), and so do the pieces the pipeline computes before its loop: the
# initial noise from a seeded generator, and the rotary tables of the 3-D positions.

# %%
import functools

import jax
import jax.numpy as jnp
import numpy as np
from diffusers import CogVideoXPipeline
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia.compat import import_torchax

torchax = import_torchax()
pipe = CogVideoXPipeline.from_pretrained(source, dtype=dtype, use_safetensors=True)
config = pipe.transformer.config
with torch.no_grad():
    text, negative_text = pipe.encode_prompt(prompt, negative, max_sequence_length=config.max_text_seq_length,
                                             device="cpu", dtype=dtype)
latent_frames = (size["frames"] - 1) // pipe.vae_scale_factor_temporal + 1
noise = pipe.prepare_latents(1, config.in_channels, size["frames"], size["height"], size["width"], dtype, "cpu",
                             torch.Generator().manual_seed(seed))
rope = (pipe._prepare_rotary_positional_embeddings(size["height"], size["width"], latent_frames, "cpu")
        if config.use_rotary_positional_embeddings else None)
print("text", tuple(text.shape), "| latents", tuple(noise.shape), "| rope", rope is not None)

# %% [markdown]
# One change before tracing. diffusers' CogVideoX attention writes the rotated video part back
# into the query and key in place (`query[:, :, text_len:] = ...`). Under `jax.jit` on a mesh
# whose `tp` axis splits the heads, XLA's partitioner got that write wrong (notebook
# `cogvideox_pipeline`, section 5, reproduces it in plain JAX). The processor below computes the
# same thing by concatenation; everything else is the stock computation.

# %%
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb


class RopeByConcatenation:
    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        assert attention_mask is None  # CogVideoX attends to every token
        n = encoder_hidden_states.size(1)
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        q, k, v = (layer(x).unflatten(2, (attn.heads, -1)).transpose(1, 2) for layer in (attn.to_q, attn.to_k, attn.to_v))
        q, k = (norm(t) if norm is not None else t for norm, t in ((attn.norm_q, q), (attn.norm_k, k)))
        if image_rotary_emb is not None:
            q, k = (torch.cat([t[:, :, :n], apply_rotary_emb(t[:, :, n:], image_rotary_emb)], dim=2) for t in (q, k))
        out = attn.to_out[0](F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        return out[:, n:], out[:, :n]


pipe.transformer.set_attn_processor(RopeByConcatenation())

# %% [markdown]
# To JAX, sharded. `torchax.extract_jax` turns the module into a dict of JAX arrays and a pure
# function of that dict. The rule is Megatron's (notebook `sharding`): the layers that produce
# heads or the MLP's hidden units split their output rows over `tp`, the layers that consume them
# split their input columns, and anything that does not divide is replicated.

# %%
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))
with jax.default_device(jax.devices("cpu")[0]):  # staged in host RAM: no chip ever holds all of it
    weights, forward = torchax.extract_jax(pipe.transformer)


def spec(name, w):
    if name.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "ff.net.0.proj.weight")) and w.shape[0] % 4 == 0:
        return P("tp", None)
    if name.endswith(("to_out.0.weight", "ff.net.2.weight")) and w.shape[1] % 4 == 0:
        return P(None, "tp")
    return P()


weights = {name: jax.device_put(w, NamedSharding(mesh, spec(name, w))) for name, w in weights.items()}
split = sorted({str(w.sharding.spec) for w in weights.values()})
print(f"{len(weights)} arrays, specs used: {split}")

# %% [markdown]
# The sampler as tables. `CogVideoXDDIMScheduler.step` with v-prediction predicts the clean
# latents `x0 = sqrt(a_t) x - sqrt(1 - a_t) v` and returns `a x + b x0`, with `a` and `b` from
# the cumulative alphas at this step's timestep and the previous one. All of it depends only on
# the step index, so the host computes one row per step, and the step reads its row.

# %%
scheduler = pipe.scheduler
scheduler.set_timesteps(size["steps"])
t = scheduler.timesteps.numpy()
alphas = scheduler.alphas_cumprod.double().numpy()
previous = t - scheduler.config.num_train_timesteps // size["steps"]
a_t = alphas[t]
a_prev = np.where(previous >= 0, alphas[np.maximum(previous, 0)], float(scheduler.final_alpha_cumprod))
a = np.sqrt((1 - a_prev) / (1 - a_t))
tables = {name: jnp.asarray(col, jnp.float32) for name, col in
          dict(sqrt_a=np.sqrt(a_t), sqrt_b=np.sqrt(1 - a_t), a=a, b=np.sqrt(a_prev) - np.sqrt(a_t) * a).items()}
tables["t"] = jnp.asarray(t, jnp.int32)


# %% [markdown]
# One step, compiled once: the guidance pair is a batch of two split over `dp`, the transformer
# runs on the sharded weights, and the sampler reads row `i`, a traced integer, so every step
# reuses the first step's program.

# %%
whole = NamedSharding(mesh, P())  # the latents keep one placement in and out: one program


@functools.partial(jax.jit, out_shardings=whole)
def step(weights, latents, text_pair, rope, i):
    x = jax.lax.with_sharding_constraint(jnp.concatenate([latents, latents]), NamedSharding(mesh, P("dp")))
    v = forward(weights, (), dict(hidden_states=x, encoder_hidden_states=text_pair, image_rotary_emb=rope,
                                  timestep=jnp.broadcast_to(tables["t"][i], (2,)), return_dict=False))[0]
    v = v[:1] + guidance * (v[1:] - v[:1])
    x0 = tables["sqrt_a"][i] * latents - tables["sqrt_b"][i] * v
    return tables["a"][i] * latents + tables["b"][i] * x0


to_jax = lambda x: jnp.asarray(x.float().numpy()).astype(jnp.dtype(preset.dtype))  # noqa: E731
latents = jax.device_put(to_jax(noise), whole)
text_pair = to_jax(torch.cat([negative_text, text]))
rope_jax = tuple(to_jax(r) for r in rope) if rope is not None else None
with jax.default_matmul_precision("highest"):  # the parity below is meant to hold on a TPU too
    for i in range(size["steps"]):
        latents = step(weights, latents, text_pair, rope_jax, i)
print("latents", latents.shape, latents.dtype, "| step compiled", step._cache_size(), "time(s)")


# %% [markdown]
# The decode. The VAE's `decode` is a method, not `forward`, so a four-line module makes it one
# and `extract_jax` gives it to JAX the same way. Its weights stay whole (the VAE is small; how
# to split its activations instead is notebook `cogvideox_vae_flax`'s subject).

# %%
class Decode(torch.nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, z):
        return self.vae.decode(z / self.vae.config.scaling_factor).sample


vae_weights, decode = torchax.extract_jax(Decode(pipe.vae))
with jax.default_matmul_precision("highest"):
    video = jax.jit(decode)(vae_weights, (jnp.transpose(latents, (0, 2, 1, 3, 4)),))
frames = pipe.video_processor.postprocess_video(torch.from_numpy(np.asarray(video, np.float32)), output_type="np")[0]
print("frames", frames.shape)

# %% tags=["check"]
assert frames.shape == (size["frames"], size["height"], size["width"], 3)
assert type(scheduler).__name__ == "CogVideoXDDIMScheduler"  # the sampler the tables encode
assert step._cache_size() == 1  # one program for every step
assert P("tp", None) in {w.sharding.spec for w in weights.values()}  # the rule split something

# %% [markdown]
# ### Exercise 1: one row of the tables against `scheduler.step`
#
# The port never calls the scheduler in its loop; it trusts four tables. Check that trust for one
# step: take step 1, a random sample `x` and a random model output `v`, and compare the
# table formula `a x + b (sqrt_a x - sqrt_b v)` with diffusers' `scheduler.step(v, t, x)` at that step.
# **Predict** first: should they agree to float32 rounding or only roughly, given that the tables
# were computed in float64 on the host? Then run the solution.

# %% tags=["solution"]
from tpupedia.results import error_text

row = 1
x_check = torch.randn((1, 2, 4, 4, 4), generator=torch.Generator().manual_seed(0))
v_check = torch.randn((1, 2, 4, 4, 4), generator=torch.Generator().manual_seed(1))
scheduler.set_timesteps(size["steps"])  # a fresh schedule: step() reads and advances its own state
stock = scheduler.step(v_check, scheduler.timesteps[row], x_check, return_dict=False)[0].numpy()
xj, vj = jnp.asarray(x_check.numpy()), jnp.asarray(v_check.numpy())
from_tables = np.asarray(tables["a"][row] * xj + tables["b"][row] * (tables["sqrt_a"][row] * xj - tables["sqrt_b"][row] * vj))
table_error = float(np.abs(from_tables - stock).max())
print(f"tables vs scheduler.step at step {row}: max abs diff", error_text(table_error))

# %% tags=["check"]
# float32 rounding: the tables hold the same numbers scheduler.step computes from alphas_cumprod
assert table_error < 1e-5, table_error

# %% [markdown]
# ## 2. The same frames as the package
#
# The package's CogVideoX pipeline (notebook `cogvideox_pipeline`) runs the same request in its
# three stages, with diffusers' VAE under torchax (`vae="torchax"`) as the port uses it. The
# text encoder runs there on the mesh and here on the host, and attention takes other routes, so
# the two agree to float32 rounding, not bit for bit: within 1e-4 on the tiny preset; on a TPU in
# bf16, within bf16's relative bound. A constant image would match anything, so the frames must
# also vary.

# %%
from tpupedia import devices, llm, results
from tpupedia.pipelines import cogvideox as pipeline

ours = pipeline.CogVideoX(source, "port", dtype, devices.make_mesh((2, 4), ("dp", "tp")),
                          pipeline.Options(quiet=True, vae="torchax", matmul_precision="highest"))
request = pipeline.Request(prompt=prompt, negative_prompt=negative, guidance=guidance, seed=seed, fps=8, **size)
embeds, _ = ours.encode_text(request)
denoised, _ = ours.denoise(request, embeds)
decoded, _ = ours.decode(request, denoised["latents"])
expected = decoded["frames"].numpy()
error = float(np.abs(frames - expected).max())
bound = 1e-4 if preset.dtype == "float32" else llm.BF16_RELATIVE_BOUND
print("port vs package: max abs difference", results.error_text(error, bound))

# %% tags=["check"]
assert expected.shape == frames.shape and error <= bound
assert frames.std() > 0.01

# %% [markdown]
# ### Exercise 2: make the step index static, and count the programs
#
# `step` takes `i` as a traced integer, so one program serves every step. Suppose `i` were a
# static argument instead (`static_argnums`), as a Python `int` often ends up in ported code.
# **Predict** first: after the same loop, how many programs has the jitted function compiled, and
# do the latents change? Then run the solution: it jits the same Python function with `i` static
# and runs the loop again from the same noise.

# %% tags=["solution"]
def step_static_i(weights, latents, text_pair, rope, i):  # its own function: its own cache of programs
    return step.__wrapped__(weights, latents, text_pair, rope, i)


static_step = jax.jit(step_static_i, static_argnums=4, out_shardings=whole)
again = jax.device_put(to_jax(noise), whole)
with jax.default_matmul_precision("highest"):
    for i in range(size["steps"]):
        again = static_step(weights, again, text_pair, rope_jax, i)
static_diff = float(jnp.abs(again - latents).max())
print(f"static i: {static_step._cache_size()} programs for {size['steps']} steps; traced i: {step._cache_size()};",
      "latents differ by", error_text(static_diff))

# %% tags=["check"]
# One compile per distinct static value: a 50-step run would compile 50 programs, for the same result.
assert static_step._cache_size() == size["steps"] and step._cache_size() == 1
assert static_diff < 1e-5

# %% [markdown]
# ## 3. A checklist for the next model
#
# What the port needed, as questions to ask of any diffusers model:
#
# 1. **What is pure?** The transformer's forward is, once its weights are arguments
#    (`extract_jax`). The sampler is not (`scheduler.step` mutates a step counter): write its
#    step as a function of the step index and compute the per-step numbers on the host.
# 2. **Where does `jax.jit` break?** Python `if` on a tensor's value, boolean indexing (shapes
#    that depend on data), and in-place writes into slices: the first two fail to trace
#    (notebook `torchax_internals` lists the errors), the last may trace and still be wrong once
#    the array is sharded (above). Replace them with fixed-shape, out-of-place operations.
# 3. **Which tensors are sharded, and how?** The large matmul weights, by Megatron's rule; the
#    guidance pair over `dp`; everything small replicated. Check what divides the mesh.
# 4. **What runs once on the host?** Text encoders for one prompt, the initial noise (drawn as
#    the stock pipeline draws it, for parity), position tables.
# 5. **How is parity proven?** Layer by layer first (one block against its stock twin), then end
#    to end against the stock pipeline from the same seed, in float32 with a stated tolerance,
#    and with a check that the output is not constant. The package's notebooks do the same for
#    each family: `cogvideox_pipeline`, `hunyuan_video`, `wan_on_tpu`.

# %% [markdown]
# ## Takeaways
#
# - A diffusers video model runs on a mesh with three moves: `extract_jax` for the transformer,
#   a sharding rule over the weights' names, and one jitted step (section 1).
# - The sampler becomes tables plus a few multiplications; the step index is a traced integer,
#   so one program serves every step (section 1).
# - An in-place write that traces can still be wrong once sharded: compute by concatenation
#   (section 1).
# - The port gives the package's frames within float32 rounding; the package adds what a real run
#   needs around the same core: stage files, plans, memory checks (section 2).

# %% [markdown]
# ## Self-check
#
# 1. What does `torchax.extract_jax(module)` return, and why does that make the transformer pure?
#
#    <details><summary>Answer</summary>
#
#    A dict of the module's weights as JAX arrays and a function of that dict and the inputs. The
#    weights become arguments instead of state held by the module, so the function's output
#    depends only on what it is given, which is what `jax.jit` needs.
#
#    </details>
#
# 2. Why is the sampler written as tables indexed by the step number rather than calling
#    `scheduler.step` inside the jitted step?
#
#    <details><summary>Answer</summary>
#
#    `scheduler.step` keeps Python state (its step counter) and is not a JAX function. Everything
#    it computes depends only on the step index, so the host computes it once per step, and the
#    jitted step reads its row with a traced index.
#
#    </details>
#
# 3. The stock attention processor writes the rotated queries back in place. Why did the port
#    replace it, if the write traces without error?
#
#    <details><summary>Answer</summary>
#
#    Tracing is not correctness: with the heads split over `tp`, XLA's partitioner computed that
#    in-place write wrongly. Building the tensor by concatenation computes the same values and
#    partitions correctly.
#
#    </details>
#
# 4. Where do the weights live between `extract_jax` and the sharded `device_put`, and why?
#
#    <details><summary>Answer</summary>
#
#    In host RAM, under `jax.default_device(jax.devices("cpu")[0])`. Each chip then receives only
#    its shards, so no chip ever holds the whole model.
#
#    </details>
#
# 5. Why does the parity check also assert that the frames vary?
#
#    <details><summary>Answer</summary>
#
#    Two constant images can agree within any tolerance while both are wrong, for example if the
#    decode returned zeros. Requiring a spread makes the comparison about real content.
#
#    </details>
