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
# # 00 · Start here: what runs where
#
# This course takes a PyTorch model that runs on a GPU and ends with CogVideoX and
# HunyuanVideo-1.5 generating video on a TPU v6e-8. Most readers will not have a TPU while they
# read, and CI certainly does not, so every notebook is written to run in three places without
# changing a line:
#
# | where | preset | weights | devices | Pallas kernels |
# |---|---|---|---|---|
# | laptop or CI (CPU) | `tiny` | random, from configs in code | 8 *simulated* CPU devices | interpret mode |
# | TPU VM (v6e-8) | `full` | real checkpoints (`from_pretrained`) | 8 TPU v6e chips | compiled for the TPU |
# | GPU machine | `full` | real checkpoints | the GPU(s) | XLA / cuDNN instead |
#
# The switch is one environment variable, `TPUPEDIA_PRESET`. This notebook shows the three
# ideas everything else stands on:
#
# 1. **presets**: one code path, two sizes;
# 2. **simulated devices and meshes**: sharded programs on a laptop;
# 3. **ahead-of-time (AOT) compilation**: compiling for a TPU v6e-8 you do not have, and reading
#    how much memory each chip would need.
#
# **Upstream** means the project this course learns from and corrects: the Chinese-language
# yangwhale/gpu-tpu-pedia (commit 3fa9ce1), whose TPU ports of CogVideoX and HunyuanVideo-1.5
# these notebooks rebuild. Its figures appear here labelled *reported upstream* with their
# hardware; where they do not survive a check, the knowledge base's corrections page says why.
# Every number, measured here, compiled here (AOT) or reported upstream, is collected on the
# [results page](../results/index.md).
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | nothing: a few random arrays | about 0.6 GB of host RAM | about 7 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | nothing: the same arrays on the chips | a few MB per chip | seconds (not measured here: no TPU) |
#
# The AOT compile in section 5 runs on the host CPU in both cases.
# *Reading time: about 16 minutes.*

# %% [markdown]
# ## Coming from PyTorch
#
# Four habits change, and the course returns to each of them:
#
# * **A compiled function is pure.** `jax.jit` traces a function once per input shape and
#   compiles all of it; a Python `if` on a tensor's value cannot be traced (notebook
#   `hf_model_in_jax`).
# * **Arrays are immutable.** `x[i] = v` becomes `x = x.at[i].set(v)`, and the compiler makes it
#   an in-place write where it can.
# * **Randomness takes a key.** There is no global seed: `jax.random.key(0)` is passed to every
#   random call, as in section 4 below.
# * **You place the data; the compiler writes the communication.** DDP, FSDP and tensor
#   parallelism become a mesh and a `PartitionSpec` per array (section 4, and notebook
#   `sharding`).
#
# The [PyTorch-to-JAX map](../kb/pytorch-to-jax.md) pairs each PyTorch habit with its JAX
# counterpart and the first errors you will meet, each linked to the notebook cell that shows it.

# %% [markdown]
# ## 1. One switch: the preset
#
# The preset is read once, at the top of every notebook, because it decides how JAX must be set
# up, and JAX fixes its device set-up the first time anything touches a device. An unset
# variable means `tiny`.

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

import warnings

warnings.filterwarnings("ignore", message="Explicitly requested dtype")  # int64 -> int32 under x32

from tpupedia import presets

preset = presets.current()
preset

# %% [markdown]
# A typo should fail at once, naming what is allowed, before any model is loaded:

# %% tags=["raises-exception"]
presets.get("huge")

# %% [markdown]
# ## 2. Eight devices on a laptop
#
# A TPU v6e-8 has eight chips. To write and test sharded code without one, we ask XLA to split
# the host CPU into eight devices. They are slow and share one memory, but the *program* JAX
# builds for them (the partitioning, the collectives) is the same kind of program it builds for
# eight chips. This has to happen before JAX initialises a backend, which is why
# `simulate_cpu_devices` refuses, loudly, if it is called too late.
#
# On a host with one real TPU chip (a Colab or Kaggle TPU runtime, a v5e-1 VM), `chip=True`
# keeps the chip too, as a second backend. The CPU devices stay JAX's default, so every mesh and
# model in the course lands on them exactly as here, while the Pallas kernels of notebook
# `splash_attention` compile on the chip (`devices.kernel_chip()`). Without a chip, as in CI,
# it is `None`.

# %%
import jax

from tpupedia import devices

if preset.simulated_devices:
    devs = devices.simulate_cpu_devices(preset.simulated_devices, chip=True)
else:
    devs = jax.devices()
print(f"{len(devs)} devices, platform {devs[0].platform!r}, kind {devs[0].device_kind!r}")
print("chip for Pallas kernels:", devices.kernel_chip())

# %% tags=["check"]
if preset.simulated_devices:
    assert len(devs) == preset.simulated_devices and devices.platform() == "cpu"

# %% [markdown]
# ## 3. The chip we are targeting: TPU v6e (Trillium)
#
# Four numbers per chip decide almost everything later in the course: how much fits (HBM
# capacity), how fast math can go (peak bf16 FLOP/s), how fast bytes can move (HBM bandwidth) and
# how fast chips can talk (ICI). `tpupedia.hardware` keeps them, each with its source. These are
# vendor peaks, not measurements.

# %%
from IPython.display import Markdown

from tpupedia import hardware

columns = ["chip", "HBM (GiB)", "bf16 peak (TFLOP/s)", "HBM bandwidth (GB/s)", "ridge (FLOP/byte)", "link (GB/s)"]
rows = hardware.table_rows()
table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
table += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
Markdown("\n".join(table))

# %% [markdown]
# The *ridge point* is peak FLOP/s divided by HBM bandwidth: the arithmetic intensity (FLOPs per
# byte moved) a kernel needs before the chip's math units, rather than its memory, become the
# limit. For the v6e that is 918 TFLOP/s ÷ 1,638 GB/s, about 560 FLOP/byte (Google's
# [v6e page](https://cloud.google.com/tpu/docs/v6e); earlier revisions gave 1,600 GB/s, hence
# the 574 you may see elsewhere). For a bf16 matmul of a `(B, D)` activation with a `(D, F)` weight, intensity is roughly
# `B` FLOPs per byte when `D` and `F` are large. So on a v6e a layer needs on the order of
# several hundred tokens *per chip* in flight before it is compute-bound. Video diffusion
# transformers, with tens of thousands of tokens per frame batch, are far past that; a one-token
# decode step of a language model is far below it.

# %%
v6e = hardware.chip("v6e")
slice_ = hardware.parse_topology("v6e:2x4")
print(f"v6e ridge point: {v6e.ridge_flops_per_byte:.0f} FLOP/byte")
print(f"{slice_.name} is a {slice_.accelerator_type}: {slice_.num_chips} chips, "
      f"{slice_.num_chips * v6e.hbm_bytes / 2**30:.0f} GiB of HBM in total, "
      f"{slice_.num_chips * v6e.bf16_flops / 1e15:.2f} PFLOP/s bf16 peak")

# %% tags=["check"]
assert round(v6e.ridge_flops_per_byte) == 560  # 918e12 / 1638e9 = 560.4
assert slice_.accelerator_type == "v6e-8" and slice_.num_chips == 8

# %% [markdown]
# ### Exercise 1: the ridge point of the chip Colab lends
#
# Colab and Kaggle lend smaller TPUs than a v6e (guide: a free or small TPU); one of them is the
# v5e, whose facts `hardware.chip("v5e")` keeps. **Predict** first: is the v5e's ridge point above
# or below the v6e's 560 FLOP/byte, and so does a layer on a v5e need more or fewer tokens per chip
# in flight before it is compute-bound? Then open the solution and run it.

# %% tags=["solution"]
v5e = hardware.chip("v5e")
print(f"v5e: {v5e.bf16_flops / 1e12:.0f} TFLOP/s over {v5e.hbm_bytes_per_s / 1e9:.0f} GB/s = "
      f"{v5e.ridge_flops_per_byte:.0f} FLOP/byte, against the v6e's {v6e.ridge_flops_per_byte:.0f}")

# %% tags=["check"]
# lower: the v5e's math units are slower relative to its memory, so fewer tokens per chip keep it busy
assert v5e.ridge_flops_per_byte < v6e.ridge_flops_per_byte
assert round(v5e.ridge_flops_per_byte) == round(197e12 / 819e9)  # Google's v5e page: 197 TFLOP/s, 819 GB/s

# %% [markdown]
# ## 4. A mesh, and a sharded matmul
#
# A *mesh* names the devices along axes. With `("data", "model")` of shape `(2, 4)`, the batch
# is split in two and each weight matrix in four. We always build meshes with
# `AxisType.Auto` axes, because torchax (notebook `hf_model_in_jax`) relies on the compiler propagating
# shardings; `devices.make_mesh` does that, and checks the shape against the devices.
#
# The shape comes from the devices present (`devices.default_mesh_shape`): eight simulated CPU
# devices or eight v6e chips give `(2, 4)`; a machine with one GPU gets `(1, 1)` and runs the
# same cells, with nothing to communicate (section 5's TPU compile also needs `libtpu` there).

# %%
mesh = devices.make_mesh(devices.default_mesh_shape(jax.device_count()), ("data", "model"))
mesh

# %% tags=["raises-exception"]
devices.make_mesh((3, 4), ("data", "model"))

# %% [markdown]
# Now one MLP up-projection, `gelu(x @ w)`, with the tokens of `x` split over `data` and the
# output features of `w` split over `model`. Each device multiplies its block of rows by its
# block of columns; nothing has to be communicated.
#
# We are about to compare the result with NumPy at 1e-5, so the call asks for full float32
# matmuls. A TPU's default runs a float32 matmul as bfloat16 passes, about 1e-2 off at this size;
# a CPU ignores the request. Parity checks in this course ask for `"highest"` explicitly; paths
# that are timed keep the default (notebook `image_processing` measures the difference).

# %%
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def up_proj(x, w):
    return jax.nn.gelu(x @ w)


x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float32)
w = jax.random.normal(jax.random.key(1), (32, 16), jnp.float32) / np.sqrt(32)
x_sharded = jax.device_put(x, NamedSharding(mesh, P("data", None)))
w_sharded = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
with jax.default_matmul_precision("highest"):
    y = jax.jit(up_proj)(x_sharded, w_sharded)
print("output sharding:", y.sharding.spec)
jax.debug.visualize_array_sharding(y)

# %% [markdown]
# The compiler chose the output sharding by itself: rows by `data`, columns by `model`. Had we
# split the *contracting* dimension instead (`x` by columns, `w` by rows), every device would hold
# a partial sum, and XLA would have to insert an `all-reduce` to add them up. Counting
# collectives in the compiled program is how later lessons compare sharding strategies.

# %%
from tpupedia import aot

column_split = jax.jit(up_proj).lower(x_sharded, w_sharded).compile()
row_split = jax.jit(up_proj).lower(
    jax.device_put(x, NamedSharding(mesh, P(None, "model"))),
    jax.device_put(w, NamedSharding(mesh, P("model", None))),
).compile()
print("split output features:", aot.collective_counts(column_split.as_text()) or "no collectives")
print("split contracting dim:", aot.collective_counts(row_split.as_text()))

# %%
reference = np.asarray(jax.nn.gelu(np.asarray(x) @ np.asarray(w)))
assert y.sharding.spec == P("data", "model")
np.testing.assert_allclose(np.asarray(y), reference, atol=1e-5)
assert aot.collective_counts(column_split.as_text()) == {}
if mesh.shape["model"] > 1:  # partial sums exist only when the contracting dim is really split
    assert aot.collective_counts(row_split.as_text()).get("all-reduce", 0) >= 1

# %% [markdown]
# ### Exercise 2: split the weight over both axes
#
# Keep `x` whole on every device (`P()`) and split `w`'s output features over *both* mesh axes,
# `P(None, ("data", "model"))`, so each of the eight devices holds two of its sixteen columns.
# **Predict** first: does the compiled program need a collective, and what is the output's
# `PartitionSpec`? Then run the solution, which compiles it and checks the values.

# %% tags=["solution"]
both_axes = jax.jit(up_proj).lower(
    jax.device_put(x, NamedSharding(mesh, P())),
    jax.device_put(w, NamedSharding(mesh, P(None, ("data", "model")))),
).compile()
with jax.default_matmul_precision("highest"):
    y_both = both_axes(jax.device_put(x, NamedSharding(mesh, P())),
                       jax.device_put(w, NamedSharding(mesh, P(None, ("data", "model")))))
print("output sharding:", y_both.sharding.spec)
print("collectives:", aot.collective_counts(both_axes.as_text()) or "none")

# %% tags=["check"]
# No collective: each device still owns whole output columns; only the contracting dim needs a sum.
assert aot.collective_counts(both_axes.as_text()) == {}
assert y_both.sharding.spec == P(None, ("data", "model"))
np.testing.assert_allclose(np.asarray(y_both), reference, atol=1e-5)

# %% [markdown]
# ## 5. Compile for a TPU you do not have
#
# `jax.jit(f).lower(...)` needs only the *shapes, dtypes and shardings* of the arguments, not
# their values. With `libtpu` installed (`pip install "jax[tpu]"`), JAX can describe a TPU slice
# on any host, and the real TPU compiler will compile for it. We get back what each chip would
# hold. Here is the same up-projection at the size of a CogVideoX-5B MLP (hidden 3072, MLP
# 12288) over 32,768 tokens, in bf16, on a `v6e:2x4` slice.
#
# The trick takes four steps, each one call. First, `get_topology_desc` asks libtpu to describe
# the slice: a list of TPU devices with their ids and coordinates, which a compile can target and
# nothing can run on. They are not among `jax.devices()`, and nothing is placed on them. A `Mesh`
# over them works like any other; `mesh_utils.create_device_mesh` orders them so that
# neighbouring chips are neighbours along each mesh axis.

# %%
from jax.experimental import mesh_utils, topologies
from jax.sharding import AxisType, Mesh

devices.quiet_libtpu()  # on a host without a TPU, keep libtpu from probing for one (and printing warnings)
slice_devices = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x4").devices
print(len(slice_devices), "devices, kind", repr(slice_devices[0].device_kind), "| first:", slice_devices[0])
tpu_mesh = Mesh(mesh_utils.create_device_mesh((2, 4), devices=slice_devices), ("data", "model"),
                axis_types=(AxisType.Auto,) * 2)
print("device ids on the mesh:", np.vectorize(lambda d: d.id)(tpu_mesh.devices).tolist())

# %% [markdown]
# Second, the arguments: a `jax.ShapeDtypeStruct` is a shape, a dtype and a sharding, with no
# data (`aot.abstract` builds one in a call). Third, `lower` and `compile`, as for any jitted
# function; the compiler is libtpu's, running on this CPU.

# %%
tokens, hidden, mlp = 32_768, 3_072, 12_288
x_abstract = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=NamedSharding(tpu_mesh, P("data", None)))
w_abstract = jax.ShapeDtypeStruct((hidden, mlp), jnp.bfloat16, sharding=NamedSharding(tpu_mesh, P(None, "model")))
print(x_abstract.shape, x_abstract.dtype, x_abstract.sharding.spec)

# %%
# NBVAL_IGNORE_OUTPUT
import time

start = time.perf_counter()
compiled = jax.jit(up_proj).lower(x_abstract, w_abstract).compile()
print(f"AOT compile for v6e:2x4 on this host: {time.perf_counter() - start:.2f} s")

# %% [markdown]
# Fourth, the answer: `memory_analysis()` of the compiled program, per chip.

# %%
stats = compiled.memory_analysis()
for what in ("argument", "output", "temp"):
    print(f"{what:9} {aot.format_bytes(getattr(stats, f'{what}_size_in_bytes'))} per chip")

# %% [markdown]
# The rest of the course calls `aot.compile_aot`, which does these same steps and three things
# more: it counts the collectives in the compiled program, returns an out-of-memory refusal as a
# result instead of an exception (below), and keeps each answer on disk, because JAX's own
# compilation cache cannot store a program compiled for chips this host does not have. For the
# same program it reports the same figures, and `devices.topology_mesh` builds the same mesh:

# %%
result = aot.compile_aot(up_proj, x_abstract, w_abstract)
print(result.summary())
print("collectives:", result.collectives or "none")

# %% tags=["check"]
assert (result.memory.arguments, result.memory.outputs, result.memory.temporaries) == (
    stats.argument_size_in_bytes, stats.output_size_in_bytes, stats.temp_size_in_bytes)
assert [d.id for d in tpu_mesh.devices.flat] == [
    d.id for d in devices.topology_mesh("v6e:2x4", (2, 4), ("data", "model")).devices.flat]

# %% [markdown]
# The argument bytes are exactly what the shardings predict: half the tokens and a quarter of
# the weight columns per chip, two bytes per bf16 element.

# %%
expected_args = (tokens // 2 * hidden + hidden * mlp // 4) * 2
expected_out = (tokens // 2) * (mlp // 4) * 2
assert result.fits
assert result.memory.arguments == expected_args, (result.memory.arguments, expected_args)
assert result.memory.outputs == expected_out
assert result.memory.peak < v6e.hbm_bytes

# %% [markdown]
# ### Exercise 3: the same program for an 8-chip v5e host
#
# A v5e chip has half a v6e's HBM. **Predict** first: compiled for `v5e:2x4` with the same mesh and
# shardings, how many bytes of arguments does each chip hold, and does the program still fit? Then
# run the solution: it builds the v5e mesh and compiles the up-projection for it.

# %% tags=["solution"]
v5e_mesh = devices.topology_mesh("v5e:2x4", (2, 4), ("data", "model"))
on_v5e = aot.compile_aot(
    up_proj,
    aot.abstract((tokens, hidden), jnp.bfloat16, NamedSharding(v5e_mesh, P("data", None))),
    aot.abstract((hidden, mlp), jnp.bfloat16, NamedSharding(v5e_mesh, P(None, "model"))),
)
print(v5e_mesh.devices[0, 0].device_kind, "x", v5e_mesh.devices.size, "|", on_v5e.summary())

# %% tags=["check"]
# The shardings, not the chip, decide the bytes per chip; the chip decides whether they fit.
assert on_v5e.memory.arguments == expected_args and on_v5e.memory.outputs == expected_out
assert on_v5e.fits and on_v5e.memory.peak < hardware.chip("v5e").hbm_bytes

# %% [markdown]
# A program that does not fit is also an answer. Materialising one full attention score matrix
# for a 131,072-token sequence in float32 needs 64 GiB for the scores alone, twice a v6e's HBM,
# and the softmax writes a second matrix of that size for its result: about 128 GiB of
# temporaries. The TPU compiler refuses, with its own figures; `compile_aot` returns them rather than
# crashing. (Notebook `splash_attention` is about never materialising that matrix.) Note the budget it quotes:
# 31.25 GiB, in the binary units XLA prints, is what a v6e chip's 32 GiB of HBM leaves a program.

# %%
seq = 131_072
replicated = NamedSharding(tpu_mesh, P())
q_abstract = aot.abstract((seq, 128), jnp.bfloat16, replicated)


def attention_scores(q, k):
    return jax.nn.softmax((q @ k.T).astype(jnp.float32), axis=-1)


too_big = aot.compile_aot(attention_scores, q_abstract, q_abstract)
print(too_big.oom_message)
print(too_big.summary())

# %% tags=["check"]
assert not too_big.fits
assert too_big.oom_required_bytes > too_big.oom_available_bytes
assert too_big.oom_required_bytes >= 2 * seq * seq * 4  # the float32 scores and the softmax of them
assert too_big.oom_available_bytes <= v6e.hbm_bytes * 1.1  # the compiler's budget is one chip's HBM

# %% [markdown]
# ## Takeaways
#
# * `TPUPEDIA_PRESET` picks the size; the code path is the same for `tiny` and `full`.
# * Simulated CPU devices run real sharded programs; make the mesh with `Auto` axes, and choose
#   the device count before JAX starts.
# * Where you split a matmul decides whether chips must talk: splitting output features needs no
#   collective, splitting the contracting dimension needs an all-reduce.
# * With `libtpu` installed, any host can compile for a `v6e:2x4` slice and read per-chip memory:
#   `get_topology_desc`, a mesh over its devices, `ShapeDtypeStruct` arguments, `lower().compile()`,
#   `memory_analysis()`. "Will it fit, and how is it sharded?" becomes a question CI can answer.
#
# Next: notebook `hf_model_in_jax`, a Hugging Face model in JAX with torchax (see the learning path).

# %% [markdown]
# ## Self-check
#
# 1. Why must `simulate_cpu_devices` run before anything touches a JAX device, and what does it do
#    if it is called too late?
#
#    <details><summary>Answer</summary>
#
#    JAX fixes its device set when the first backend initialises; the number of CPU devices cannot
#    change afterwards. Called too late, it raises `DeviceSetupError` instead of silently leaving one
#    device, and the fix is to restart the kernel.
#
#    </details>
#
# 2. A layer on a v6e multiplies 64 tokens per chip by a large weight. Is it limited by the chip's
#    math units or by its memory, and why?
#
#    <details><summary>Answer</summary>
#
#    By memory. Its arithmetic intensity is about 64 FLOPs per byte, far below the v6e's ridge point
#    of about 560 FLOP/byte, so the chip waits on HBM to deliver the weight.
#
#    </details>
#
# 3. Which split of `x @ w` needs an all-reduce, and which needs none?
#
#    <details><summary>Answer</summary>
#
#    Splitting the contracting dimension (the columns of `x` and the rows of `w`) leaves each device
#    a partial sum, which an all-reduce adds up. Splitting the rows of `x` or the output columns of
#    `w` gives each device whole output values, with nothing to communicate.
#
#    </details>
#
# 4. What does an ahead-of-time compile for a TPU need to know about its arguments, and what does
#    it not need?
#
#    <details><summary>Answer</summary>
#
#    Their shapes, dtypes and shardings over the slice's devices (`jax.ShapeDtypeStruct`). It needs
#    no values and no chip, only `libtpu` on the host.
#
#    </details>
#
# 5. On a Colab runtime with one TPU chip, where do the tiny preset's meshes live, and what is the
#    chip used for?
#
#    <details><summary>Answer</summary>
#
#    On eight simulated CPU devices, which stay JAX's default backend, so every mesh in the course
#    has its eight devices. The chip is a second backend for the Pallas kernels, which compile on it
#    (`devices.kernel_chip()`).
#
#    </details>
