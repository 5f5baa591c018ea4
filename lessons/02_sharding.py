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
# # 02 · Distributed sharding: mesh, rule tables, TP vs FSDP
#
# On a GPU you shard a model with DDP, FSDP or Megatron code that calls NCCL by hand. In JAX you
# write the model once, say where each array lives, and the compiler (GSPMD) inserts the
# communication. This notebook makes that concrete for a torch model running under torchax:
#
# 1. a **mesh** and **`NamedSharding`**: naming devices, placing arrays;
# 2. **rule tables as data**: regex → `PartitionSpec`, applied to a torchax module with
#    `tpupedia.sharding`;
# 3. **Megatron TP vs FSDP vs replicated** on a tiny Llama: same logits, different collectives
#    and different bytes per device, all measured; then an MLP written **by hand with
#    `shard_map`**, its all-reduce a `psum` in the code;
# 4. a **KV cache sharded on heads**;
# 5. the same forward **compiled ahead of time for a TPU v6e-8** (`v6e:2x4`), with per-chip memory
#    predicted from the rule table and confirmed by the TPU compiler.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | a tiny random Llama built in code | about 1.4 GB of host RAM | about 50 s, measured here on a 2-core CPU, most of it the TPU compile of section 5 |
# | `full` (TPU v6e-8) | the same tiny Llama; section 5 compiles a 2-layer, 2,048-wide Llama for the chips | about 175 MiB per chip for the section-5 program (AOT here: 122.5 arguments + 31.3 outputs + 20.1 temporaries) | about the same: the section-5 compile runs on the host CPU (not measured on a TPU VM) |
#
# The sharding lessons need eight devices: on a machine with fewer (one GPU, say), run this
# notebook with `tiny`, which simulates eight. *Reading time: about 29 minutes.*

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

from tpupedia import devices, session

preset = session.start()  # preset, simulated devices, known warnings silenced (notebook `hf_model_in_jax`)

# %% [markdown]
# ## 1. A mesh and a `NamedSharding`
#
# A mesh arranges the 8 devices in a grid and names its axes. We use `("dp", "tp")` of shape
# `(2, 4)`: two data-parallel groups of four tensor-parallel devices. `devices.make_mesh` builds
# it with `AxisType.Auto` axes; jax 0.10's default, `Explicit`, makes torchax's op lowerings
# fail (notebook `start_here`).

# %%
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = devices.make_mesh((2, 4), ("dp", "tp"))
dict(mesh.shape)

# %% [markdown]
# A `PartitionSpec` has one entry per array dimension: a mesh axis name splits that dimension
# over the axis, `None` keeps it whole. `P("dp", "tp")` on an `(8, 8)` array gives every device
# a `(4, 2)` block.

# %%
x = jnp.arange(64.0).reshape(8, 8)
x_sharded = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
jax.debug.visualize_array_sharding(x_sharded)

# %% [markdown]
# With `P(None, "tp")` the rows stay whole and the `dp` axis is not mentioned, so each block is
# *replicated* over `dp`: two devices hold the same `(8, 2)` slice.

# %%
x_cols = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
jax.debug.visualize_array_sharding(x_cols)

# %% [markdown]
# Both placements as one picture, drawn from `mesh` and from the two arrays' shardings
# (`sharding.devices_indices_map(shape)` gives the block of the array each device holds). On the
# left, the mesh: its axis names and sizes, and each device's id where the mesh puts it, coloured
# by the block it holds. On the right, the array cut into those blocks. Under `P(None, "tp")` the
# two devices of each mesh column share a colour: one block, held twice.

# %% tags=["diagram-mesh"]
from tpupedia.diagrams import mesh as mesh_diagram

fig = mesh_diagram.draw(mesh, {"x_sharded": x_sharded, "x_cols": x_cols},
                        title="One mesh, two PartitionSpecs: which block of x each device holds")

# %% tags=["check"]
assert x_sharded.sharding.shard_shape(x.shape) == (4, 2)
assert x_cols.sharding.shard_shape(x.shape) == (8, 2)
assert {s.data.shape for s in x_sharded.addressable_shards} == {(4, 2)}
np.testing.assert_array_equal(np.asarray(x_sharded), np.asarray(x))  # same values, split storage

# %% [markdown]
# ## 2. Sharding rules as data
#
# A real model has hundreds of weights. Rather than placing each by hand, we write a *rule
# table*: `(regex, spec)` pairs. The first regex that fully matches a parameter's name decides
# its spec; a name no rule matches is replicated **and listed**, so a typo in a regex shows up
# instead of silently replicating a 1 GB matrix.
#
# One fact decides the Megatron table: PyTorch stores `nn.Linear.weight` as
# `(out_features, in_features)`, the transpose of the `(in, out)` kernels of JAX/Flax.
#
# * **Column-parallel** (q, k, v, gate, up): split the *output* features, so **dim 0** of a torch
#   weight, `P("tp", None)`. Each device computes whole heads / whole MLP columns; no
#   communication.
# * **Row-parallel** (o, down): split the *input* features, **dim 1**, `P(None, "tp")`. Each
#   device holds a partial sum, and one all-reduce adds them up.
# * **Vocabulary-parallel** embedding and `lm_head` (both `(vocab, hidden)`): split the
#   vocabulary, **dim 0**, as Megatron's `VocabParallelEmbedding` does. Each device looks the
#   token ids up in its quarter of the rows (zeros for ids it does not hold) and one all-reduce
#   sums the lookups; `lm_head` gives each device a quarter of the logits.
#
# Here is the table this notebook measures, `("llama", "tp")`:

# %%
from tpupedia import sharding

sharding.rules("llama", "tp")

# %% [markdown]
# Section 3 measures it against three others, shown here side by side (an empty cell means no
# rule: replicated). `tp_transposed` swaps every matrix's dims; `fsdp` splits every matrix on
# dim 0 over all eight devices.

# %%
from IPython.display import Markdown

llama_strategies = ["tp", "tp_transposed", "fsdp", "replicated"]
patterns = list(dict.fromkeys(pat for s in llama_strategies for pat, _ in sharding.RULES[("llama", s)]))
lines = ["| rule (regex) | " + " | ".join(f"`{s}`" for s in llama_strategies) + " |",
         "|---|" + "---|" * len(llama_strategies)]
for pat in patterns:
    cells = [next((f"P({', '.join(map(repr, spec))})" for p_, spec in sharding.RULES[("llama", s)] if p_ == pat), "") for s in llama_strategies]
    escaped = pat.replace("|", "\\|")  # a | inside a table cell ends the cell unless escaped
    lines.append(f"| `{escaped}` | " + " | ".join(cells) + " |")
Markdown("\n".join(lines))

# %% [markdown]
# The same `llama` tables serve Qwen2 and Mistral, which share the naming (the tests check
# them on those families). A video family keeps its transformer's tables in its own module
# (`tpupedia.models.cogvideox.SHARDING`, used in notebook `cogvideox_pipeline`; HunyuanVideo-1.5's, in notebook `hunyuan_video`), and
# `sharding.rules(spec, strategy)` takes them from the family's registry entry.
#
# **A naming trap from upstream.** Upstream's CogVideoX scripts (yangwhale/gpu-tpu-pedia, commit
# 3fa9ce1: `tpu/CogVideoX/generate_torchax.py` and the staged `stage2_transformer.py`) label a
# table "TP (Megatron column-row)" that shards the attention projections `to_q/to_k/to_v` and the
# first MLP layer on **dim 1**, and the output projection and second MLP layer on **dim 0**. For
# torch's `(out, in)` weights that is the opposite of Megatron, and the same scripts' "FSDP" table
# is the actual Megatron layout; their HunyuanVideo-1.5 tables get it right (dim 0 for q/k/v and
# the first MLP layer). The `tp_transposed` column above is that upstream layout in Llama's
# names; section 3 measures it instead of trusting either label (the knowledge base's
# [corrections page](../kb/corrections.md#3-the-cogvideox-tp-megatron-table-is-the-transpose-of-megatron)
# has the entry).

# %% [markdown]
# Our model for this lesson: a tiny random Llama (hidden 64, 2 layers, 8 query heads and 4
# key/value heads of size 8, vocabulary 1000). The head counts divide the `tp` axis of 4, so
# every device gets whole heads.

# %%
import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                     use_cache=False, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
ids = torch.randint(0, config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    reference_logits = model(ids).logits.numpy()  # PyTorch on CPU: the ground truth
reference_logits.shape

# %% [markdown]
# `sharding.plan` applies a table to names and shapes only (no data moves), and checks that each
# spec divides its dimension. Here are layer 0's tensors under Megatron TP:

# %%
tp_plan = sharding.plan(model, sharding.rules("llama", "tp"), mesh)
Markdown(tp_plan.table(pattern=r"layers\.0\.|lm_head|embed"))

# %% [markdown]
# Norm weights and the rotary-frequency buffers are in no rule: they are replicated, and the plan
# says so.

# %%
tp_plan.unmatched

# %%
q, o = tp_plan["model.layers.0.self_attn.q_proj.weight"], tp_plan["model.layers.0.self_attn.o_proj.weight"]
assert q.spec == P("tp", None) and q.shard_shape == (64 // 4, 64)  # column-parallel: dim 0
assert o.spec == P(None, "tp") and o.shard_shape == (64, 64 // 4)  # row-parallel: dim 1
assert all(not tp_plan[name].sharded for name in tp_plan.unmatched)

# %% [markdown]
# A spec must divide the dimension it splits. Real vocabularies often do not: many Llama-2
# fine-tunes add one pad token, giving 32,001 rows. A rule says what to do then. An embedding's
# lookups are the same split or whole, so its rule replicates the table and the plan lists it
# (`plan.indivisible`); a matmul's rule refuses. The check runs before any data moves and names
# the parameter, the dimension, the mesh axis and the axis sizes that would divide it: here the
# `lm_head`. (The model is built on the `meta` device: shapes only, no memory.)

# %% tags=["raises-exception"]
with torch.device("meta"):
    padded_vocab = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=1, num_attention_heads=8,
                                                num_key_value_heads=4, vocab_size=32_001))
sharding.plan(padded_vocab, sharding.rules("llama", "tp"), mesh)

# %% [markdown]
# ## 3. TP vs FSDP vs replicated, measured
#
# We run the same torch model under four tables, on the same 8 sequences:
#
# | strategy | mesh | weights | batch |
# |---|---|---|---|
# | `replicated` | `(2, 4)` | whole on every device | split over `dp` |
# | `tp` (Megatron) | `(2, 4)` | column/row split over `tp` | split over `dp` |
# | `tp_transposed` (upstream "TP") | `(2, 4)` | the dims swapped | split over `dp` |
# | `fsdp` | `(8,)` named `fsdp` | every matrix split on dim 0 over all 8 | split over all 8 |
#
# For each we shard a fresh copy of the model with `apply_rules` (in place, inside the torchax
# environment), run it through `JitModule` (notebook `hf_model_in_jax`), and compile the same forward with
# `torchax_utils.FunctionalModule`, which exposes the pure JAX function torchax jits. With it,
# `jax.jit(f).lower(params, buffers, ids).compile().as_text()` is the partitioned program.
# `aot.collective_ops` reads every collective in it: its kind, the shapes it moves and the size
# of its device group, hence the bytes each device sends (ring estimates: an all-reduce of `B`
# bytes over `n` devices sends `2 (n-1)/n B`, an all-gather `(n-1)/n B`).

# %%
import copy

from tpupedia import aot, torchax_utils

torchax_utils.register_common_outputs()
env = torchax_utils.default_env()
fsdp_mesh = devices.make_mesh((8,), ("fsdp",))
setups = {  # strategy: (mesh, batch spec)
    "replicated": (mesh, P("dp")),
    "tp": (mesh, P("dp")),
    "tp_transposed": (mesh, P("dp")),
    "fsdp": (fsdp_mesh, P("fsdp")),
}


def run(strategy):
    the_mesh, batch_spec = setups[strategy]
    m = copy.deepcopy(model)
    with env, jax.default_matmul_precision("highest"):  # a parity check, below: full fp32 matmuls on a TPU too
        m.to("jax")
        plan = sharding.apply_rules(m, sharding.rules("llama", strategy), the_mesh)
        ids_jax = jax.device_put(jnp.asarray(ids.numpy()), NamedSharding(the_mesh, batch_spec))
        logits = torchax_utils.JitModule(m)(env.j2t_iso(ids_jax)).logits.jax()
        hlo = torchax_utils.FunctionalModule(m, return_dict=False).hlo(ids_jax)
    return {"plan": plan, "described": sharding.describe(m), "logits": logits,
            "collectives": aot.collective_counts(hlo), "ops": aot.collective_ops(hlo, len(the_mesh.devices.flat))}


results = {strategy: run(strategy) for strategy in setups}

# %% [markdown]
# First the claim everything else rests on: every layout computes the same function, to float32
# rounding. `run` asked for full-precision matmuls (`jax.default_matmul_precision("highest")`):
# a CPU ignores the request, but a TPU would otherwise run these float32 matmuls as bfloat16
# passes and miss 1e-5 by orders of magnitude (notebook `image_processing` shows the request in the compiled
# program). The collectives below do not depend on it.

# %%
from tpupedia import results as results_  # `results` already names the runs above

for strategy, r in results.items():
    diff = np.abs(np.asarray(r["logits"]) - reference_logits).max()
    print(f"{strategy:>14}: max |logits - PyTorch CPU| {results_.error_text(diff)}; "
          f"logits sharding {r['logits'].sharding.spec}")

# %% tags=["check"]
for r in results.values():
    np.testing.assert_allclose(np.asarray(r["logits"]), reference_logits, atol=1e-5, rtol=0)

# %% [markdown]
# Now what differs: the collectives in the compiled program (how many, and the bytes one device
# sends per forward) and the weight bytes per device (`describe` reads the placement back from
# the arrays). Measured here on 8 simulated CPU devices.

# %%
kinds = ["all-reduce", "all-gather", "all-to-all", "collective-permute"]
sent = {s: sum(op.bytes_sent for op in r["ops"]) for s, r in results.items()}
lines = ["| strategy | " + " | ".join(kinds) + " | bytes sent per device | weight bytes per device | of total |",
         "|---|" + "---:|" * (len(kinds) + 3)]
for strategy, r in results.items():
    d = r["described"]
    counts = " | ".join(str(r["collectives"].get(k, 0)) for k in kinds)
    lines.append(f"| `{strategy}` | {counts} | {sent[strategy]:,.0f} | {d.bytes_per_device:,} | "
                 f"{d.bytes_per_device / d.bytes_total:.1%} |")
Markdown("\n".join(lines))

# %%
import matplotlib.pyplot as plt

names = list(results)
fig, (ax_w, ax_c) = plt.subplots(1, 2, figsize=(9, 3.2))
ax_w.bar(names, [results[n]["described"].bytes_per_device / 1024 for n in names], color="C0")
ax_w.set_title("weight bytes per device (KiB)", fontsize=9)
bottom = np.zeros(len(names))
for i, kind in enumerate(kinds):
    kib = np.array([sum(op.bytes_sent for op in results[n]["ops"] if op.kind == kind) / 1024 for n in names])
    if kib.any():
        ax_c.bar(names, kib, bottom=bottom, label=kind, color=f"C{i + 1}")
        bottom += kib
for x, n in enumerate(names):
    ax_c.text(x, bottom[x], f"{len(results[n]['ops'])} ops", ha="center", va="bottom", fontsize=8)
ax_c.set_title("bytes sent per device per forward (KiB)", fontsize=9)
ax_c.legend(fontsize=7)
for ax in (ax_w, ax_c):
    ax.tick_params(axis="x", labelsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# How to read it (2 decoder layers, activations of `(4, 16, 64)` float32 per `dp` group):
#
# * **replicated**: no collectives at all. Each `dp` group computes its own half of the batch
#   with the whole model: plain data parallelism, and every device pays for every byte.
# * **tp**: one all-reduce of the activations after each row-parallel layer (`o_proj`,
#   `down_proj`) in each layer, and one more for the vocabulary-parallel embedding lookup. The
#   all-gathers (three per layer) are inside attention: the compiler gathers q, k and the
#   repeated k/v heads over `tp` rather than keep each device's heads, which Megatron would do.
#   That is the compiler's choice for attention as torchax traces it here, not something the
#   table asks for; the splash override of notebook `splash_attention` will pin attention to each device's own heads with
#   `shard_map`. About a quarter of the weights per device (the `tp` axis has 4 devices; norms
#   stay replicated).
# * **fsdp**: one all-gather per weight matrix, fetched right before it is used; activations
#   barely move. The smallest weight footprint (an eighth), paid for in weight traffic on every
#   forward: here more bytes than `tp` sends. FSDP is cheap when the batch per device is large
#   compared with the weights, and this batch is tiny.
# * **tp_transposed**: the same bytes per device as `tp`, but with the contracting dimension
#   split for q/k/v/gate/up the compiler has to sum partial activations after each of them,
#   reshuffle for attention (an all-to-all, a collective-permute), and all-reduce the full
#   `(batch, seq, vocab)` logits at the end, where Megatron's vocab-parallel `lm_head` needs
#   none. It sends several times the bytes of `tp`. "TP" is not a layout; the dims are.
#
# The checks below are structural, not exact counts: a compiler may combine or split
# collectives differently on another backend, but which tensors cross devices follows from
# the layout.

# %%
nlayers = config.num_hidden_layers
activation = (8 // 2, 16, config.hidden_size)  # one dp group's hidden states
logits_shape = (8 // 2, 16, config.vocab_size)
weight_shapes = {tuple(p.shape) for p in model.parameters() if p.ndim == 2}


def moved(strategy, kind, shape):
    """How many tensors of `shape` the strategy's collectives of `kind` move."""
    return sum(op.shapes.count(shape) for op in results[strategy]["ops"] if op.kind == kind)


assert results["replicated"]["ops"] == []
assert moved("tp", "all-reduce", activation) >= 2 * nlayers + 1  # o_proj, down_proj per layer + embedding
assert not any(shape in weight_shapes for op in results["tp"]["ops"] for shape in op.shapes)  # weights stay put
assert moved("tp", "all-reduce", logits_shape) == 0 < moved("tp_transposed", "all-reduce", logits_shape)
fsdp_gathered = sum(shape in weight_shapes for op in results["fsdp"]["ops"] if op.kind == "all-gather"
                    for shape in op.shapes)
assert fsdp_gathered >= 7 * nlayers  # every decoder weight matrix, gathered where it is used
assert sent["tp_transposed"] > 2 * sent["tp"] and sent["fsdp"] > sent["tp"]

# %% [markdown]
# ### Exercise 1: a table that splits only the MLP
#
# Write a rule table of two rules that shards only the MLP the Megatron way (`gate_proj` and
# `up_proj` column-parallel, `down_proj` row-parallel over `tp`) and leaves attention and the
# embeddings replicated. **Predict** first: how many all-reduces does the compiled forward hold
# for this 2-layer model, and how many all-gathers? Then run the solution, which shards a fresh copy
# with your table exactly as `run` does, and compare.

# %% tags=["solution"]
mlp_only = [(r".*\.mlp\.(gate_proj|up_proj)\.weight", P("tp", None)),  # column-parallel
            (r".*\.mlp\.down_proj\.weight", P(None, "tp"))]  # row-parallel: one all-reduce after it
m = copy.deepcopy(model)
with env, jax.default_matmul_precision("highest"):
    m.to("jax")
    sharding.apply_rules(m, mlp_only, mesh)
    ids_jax = jax.device_put(jnp.asarray(ids.numpy()), NamedSharding(mesh, P("dp")))
    mlp_logits = torchax_utils.JitModule(m)(env.j2t_iso(ids_jax)).logits.jax()
    mlp_only_ops = aot.collective_counts(torchax_utils.FunctionalModule(m, return_dict=False).hlo(ids_jax))
print("MLP-only table:", mlp_only_ops, "| Megatron tp table:", results["tp"]["collectives"])

# %% tags=["check"]
# One all-reduce per layer, after down_proj; replicated attention needs nothing gathered.
assert mlp_only_ops == {"all-reduce": nlayers}, mlp_only_ops
np.testing.assert_allclose(np.asarray(mlp_logits), reference_logits, atol=1e-5, rtol=0)

# %% [markdown]
# ### Megatron's MLP pair, in plain JAX
#
# Exercise 1's table compiled to one all-reduce per MLP. Out of the model, the pair is two matmuls,
# with the weights in torch's `(out, in)` layout: `fc1` of `(F, D)` split on dim 0
# (column-parallel), `fc2` of `(D, F)` split on dim 1 (row-parallel), and the batch of `x` split
# over `dp`. `jax.jit` compiles it and places the communication; `aot.collective_ops` reads it
# back from the compiled program, as `run` did for the Llama.

# %%
B, S, D, F = 8, 16, 64, 256
x_act = jax.device_put(jax.random.normal(jax.random.key(0), (B, S, D)), NamedSharding(mesh, P("dp")))
fc1 = jax.device_put(jax.random.normal(jax.random.key(1), (F, D)) / np.sqrt(D),
                     NamedSharding(mesh, P("tp", None)))  # column-parallel: dim 0, the output features
fc2 = jax.device_put(jax.random.normal(jax.random.key(2), (D, F)) / np.sqrt(F),
                     NamedSharding(mesh, P(None, "tp")))  # row-parallel: dim 1, the input features
mlp = jax.jit(lambda x, w1, w2: jax.nn.gelu(x @ w1.T) @ w2.T, out_shardings=NamedSharding(mesh, P("dp")))
with jax.default_matmul_precision("highest"):  # compared with hand-written versions below
    y_compiler = mlp(x_act, fc1, fc2)
    mlp_ops = aot.collective_ops(mlp.lower(x_act, fc1, fc2).compile().as_text(), 8)
for op in mlp_ops:
    print(f"{op.kind} of {op.shapes[0]} over {op.group_size} devices")

# %% [markdown]
# The picture below is drawn from `x_act`, `fc1` and `fc2` (their shardings say which features
# each device holds) and from `mlp_ops`. Read it left to right, one lane per position along `tp`
# (each lane is two devices, one per `dp` row). Every device has all the features of its `x`, so
# with its rows of `fc1` it computes its quarter of the hidden features without talking to anyone.
# Its columns of `fc2` are the matching quarter of `fc2`'s inputs, so it can go on alone to a
# partial output of full size, `(4, 16, 64)`, that holds only its quarter of the sum over the
# hidden features. The one all-reduce that the compiled program holds adds the four partials.

# %% tags=["diagram-mlp-split"]
from tpupedia.diagrams import mlp_split

fig = mlp_split.draw(x_act, fc1, fc2, mlp_ops,
                     title="Megatron's MLP over tp: column-parallel fc1, row-parallel fc2")

# %% [markdown]
# **A variant from upstream: a replicated second layer.** The upstream HunyuanVideo-1.5 scripts
# (notebook `hunyuan_video` runs that model) keep Megatron's column-parallel first layer but replicate the second (`fc2`,
# the `tp_fc2_replicated` table), described as having "no row-parallel all-reduce". The
# column-parallel layer leaves each device a quarter of the hidden vector, and a replicated
# `fc2` needs all of it: either the activations are all-gathered first, or each device
# multiplies its quarter by the matching columns of its (whole) `fc2` and the partial outputs
# are all-reduced, which is the row-parallel all-reduce again. Which one does the compiler
# choose? The pair above, compiled with each `fc2` layout:

# %%
fc2_layouts = {"tp (row-parallel fc2)": P(None, "tp"), "tp_fc2_replicated": P()}
fc2_ops = {}
for name, spec in fc2_layouts.items():
    fc2_placed = jax.device_put(fc2, NamedSharding(mesh, spec))
    fc2_ops[name] = aot.collective_ops(mlp.lower(x_act, fc1, fc2_placed).compile().as_text(), 8)
    fc2_bytes = int(np.prod(fc2_placed.sharding.shard_shape(fc2_placed.shape))) * 4
    print(f"{name:>22}: fc2 {fc2_bytes:,} bytes per device; "
          + ", ".join(f"{op.kind} of {op.shapes[0]} over {op.group_size} devices" for op in fc2_ops[name]))

# %% [markdown]
# In this lone MLP, GSPMD picks the all-reduce for both (compiled for the TPU, the same MLP
# gives the same choice): replicating `fc2` removes no communication, it only holds four times
# the `fc2` weights per device. The choice depends on the surrounding program, though. Here is
# the full HunyuanVideo-1.5 transformer under both tables, compiled for `v6e:2x4` (AOT here:
# `tpupedia dryrun hunyuan` with one layer at 480p and 5 frames, a few minutes each on a
# 2-core CPU, so this notebook reads the recorded results; bytes are scaled to all 54 layers):

# %%
import json
from pathlib import Path

from tpupedia import dryrun

hy_records = {r["sharding"]: r for r in json.loads((Path("..") / dryrun.DEFAULT_RECORDS).read_text())["records"]
              if (r["model"], r["width"], r["height"], r["frames"], r["layers_compiled"]) == ("hunyuan", 848, 480, 5, 1)}
for name in ("tp", "tp_fc2_replicated"):
    r = hy_records[name]
    print(f"{name:>17}: collectives {r['collectives']}; {sum(r['collective_bytes'].values()) / 2**30:.2f} GiB sent "
          f"and {r['arguments_bytes'] / 2**30:.2f} GiB of weights and inputs per chip")

# %% [markdown]
# In the real block the compiler does gather the column-parallel activations for the
# replicated layers: fewer all-reduces, more all-gathers, fewer bytes sent, more weights held.
# A replicated `fc2` never means "no communication": it means an all-gather of the activations
# in place of the all-reduce, or the same all-reduce. Read the compiled collectives rather than
# the table's name.

# %%
assert [op.kind for op in fc2_ops["tp (row-parallel fc2)"]] == ["all-reduce"]
assert [op.kind for op in fc2_ops["tp_fc2_replicated"]] == ["all-reduce"]
hy_tp, hy_fc2 = hy_records["tp"], hy_records["tp_fc2_replicated"]
assert hy_fc2["collectives"].get("all-gather", 0) > hy_tp["collectives"].get("all-gather", 0)
assert hy_fc2["collectives"]["all-reduce"] < hy_tp["collectives"]["all-reduce"]
assert hy_fc2["arguments_bytes"] > hy_tp["arguments_bytes"]

# %% [markdown]
# ### The MLP by hand, with `shard_map`
#
# So far the compiler placed every collective. In PyTorch, Megatron's layers do it by hand: each
# rank multiplies its shard and calls `dist.all_reduce` on the tensor-parallel group.
# `jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)` is that style in JAX: `f` runs once
# per device on that device's block of each argument, as `in_specs` names it, and communicates
# only where you write a collective. `jax.lax.psum(v, "tp")` is the all-reduce: the sum of `v`
# over the devices along `tp`, left on each of them. `out_specs` says how the per-device results
# form the global output: `P("dp")` stacks the `dp` blocks and claims the result is the same on
# every `tp` device, which `shard_map` checks (after a `psum` it is).
#
# Here is the pair above, written per device. The functions see local shapes: `x` is
# `(B/2, S, D)`, `w1` is `(F/4, D)`, `w2` is `(D, F/4)`.

# %%
def fc1_column(x, w1):  # w1: this device's F/4 rows of fc1
    return jax.nn.gelu(x @ w1.T)  # (B/2, S, F/4): a quarter of the hidden features, no communication


def fc2_row(h, w2):  # w2: the matching F/4 columns of fc2
    return h @ w2.T  # (B/2, S, D): full size, but only this device's share of the sum over F


def mlp_by_hand(x, w1, w2):
    return jax.lax.psum(fc2_row(fc1_column(x, w1), w2), "tp")  # the all-reduce, written by us


mlp_specs = (P("dp"), P("tp", None), P(None, "tp"))  # the blocks of x, fc1, fc2 that each device gets
mlp_shard_map = jax.jit(jax.shard_map(mlp_by_hand, mesh=mesh, in_specs=mlp_specs, out_specs=P("dp")))
with jax.default_matmul_precision("highest"):
    y_by_hand = mlp_shard_map(x_act, fc1, fc2)
    by_hand_ops = aot.collective_counts(mlp_shard_map.lower(x_act, fc1, fc2).compile().as_text())
print("collectives:", by_hand_ops, "| output sharding:", y_by_hand.sharding.spec,
      "| max diff from the compiler's version", results_.error_text(np.abs(y_by_hand - y_compiler).max()))

# %% [markdown]
# By hand we can also take the other road the variant above described: gather the hidden
# features and give every device the whole of `fc2` (replicated, `P()`). `jax.lax.all_gather(h,
# "tp", axis=2, tiled=True)` concatenates the four devices' `(B/2, S, F/4)` slices along the
# features into `(B/2, S, F)`, on every device; `to="invarying"` tells `shard_map` that the result
# is the same on every `tp` device, so `out_specs` may again leave `tp` out. The compiler did not
# choose this here; written by hand, it is what runs.

# %%
def mlp_gathered(x, w1, w2_whole):
    h_whole = jax.lax.all_gather(fc1_column(x, w1), "tp", axis=2, tiled=True, to="invarying")  # (B/2, S, F)
    return h_whole @ w2_whole.T  # each device computes all of fc2 itself: (B/2, S, D), no sum needed


fc2_whole = jax.device_put(fc2, NamedSharding(mesh, P()))
mlp_gather_map = jax.jit(jax.shard_map(mlp_gathered, mesh=mesh, in_specs=(P("dp"), P("tp", None), P()),
                                       out_specs=P("dp")))
with jax.default_matmul_precision("highest"):
    y_gathered = mlp_gather_map(x_act, fc1, fc2_whole)
    gathered_ops = aot.collective_ops(mlp_gather_map.lower(x_act, fc1, fc2_whole).compile().as_text(), 8)
print("collectives:", ", ".join(f"{op.kind} of {op.shapes[0]} over {op.group_size} devices" for op in gathered_ops),
      "| max diff from the compiler's version", results_.error_text(np.abs(y_gathered - y_compiler).max()))

# %% [markdown]
# Both compute what `jit` computed, to float32 rounding (the sums run in another order), and
# each compiled program holds exactly the collective we wrote: one all-reduce, or one
# all-gather of the `(4, 16, 256)` hidden activations, a tensor four times the size of the
# all-reduce's `(4, 16, 64)`. By the ring estimates of the table above each device sends twice
# the bytes (an all-gather sends each byte once, an all-reduce twice). That is the price of a
# replicated `fc2`, on top of holding all of it.

# %% tags=["check"]
assert [op.kind for op in mlp_ops] == ["all-reduce"]  # what jit placed for this layout
assert by_hand_ops == {"all-reduce": 1}  # the psum we wrote, and nothing else
assert [(op.kind, op.shapes) for op in gathered_ops] == [("all-gather", ((B // 2, S, F),))]  # the all_gather
assert gathered_ops[0].bytes_sent == 2 * mlp_ops[0].bytes_sent
np.testing.assert_allclose(np.asarray(y_by_hand), np.asarray(y_compiler), atol=1e-5, rtol=0)
np.testing.assert_allclose(np.asarray(y_gathered), np.asarray(y_compiler), atol=1e-5, rtol=0)
assert y_by_hand.sharding.is_equivalent_to(y_compiler.sharding, y_compiler.ndim)

# %% [markdown]
# ### Exercise 2: sum and split in one collective
#
# After `psum`, all four `tp` devices hold the same `(B/2, S, D)` output: four copies. When the
# next layer wants that output split over `tp` anyway, one collective can add the partials and
# hand each device only its part of the sum: `jax.lax.psum_scatter(v, "tp",
# scatter_dimension=2, tiled=True)`, where device `i` along `tp` keeps the `i`-th quarter of
# dimension 2 of the sum. Replace the `psum` of `mlp_by_hand` with it, reusing `fc1_column` and
# `fc2_row`. **Predict** first: the shape each device returns, the `out_specs` that puts the
# blocks back together into the `(B, S, D)` output, and which collective the compiled program
# holds. Then run the solution.

# %% tags=["solution"]
def mlp_scattered(x, w1, w2):
    partial = fc2_row(fc1_column(x, w1), w2)  # (B/2, S, D), this device's share of the sum
    return jax.lax.psum_scatter(partial, "tp", scatter_dimension=2, tiled=True)  # (B/2, S, D/4), summed


mlp_scatter_map = jax.jit(jax.shard_map(mlp_scattered, mesh=mesh, in_specs=mlp_specs,
                                        out_specs=P("dp", None, "tp")))  # D is now split over tp
with jax.default_matmul_precision("highest"):
    y_scattered = mlp_scatter_map(x_act, fc1, fc2)
    scattered_ops = aot.collective_counts(mlp_scatter_map.lower(x_act, fc1, fc2).compile().as_text())
print("per device", y_scattered.sharding.shard_shape(y_scattered.shape), "| out_specs", y_scattered.sharding.spec,
      "| collectives", scattered_ops)

# %% tags=["check"]
# A reduce-scatter: each device keeps a quarter of the summed features, and the blocks form the same y.
assert y_scattered.sharding.shard_shape(y_scattered.shape) == (B // 2, S, D // 4)
assert {s.data.shape for s in y_scattered.addressable_shards} == {(B // 2, S, D // 4)}
assert scattered_ops == {"reduce-scatter": 1}
np.testing.assert_allclose(np.asarray(y_scattered), np.asarray(y_compiler), atol=1e-5, rtol=0)

# %% [markdown]
# And the memory claim, per tensor: every sharded tensor holds exactly `1 / axis size` of its
# bytes per device, everything else its full size.

# %%
def axis_size(spec, the_mesh):
    return int(np.prod([the_mesh.shape[a] for e in spec if e is not None
                        for a in (e if isinstance(e, tuple) else (e,))]))


for strategy, r in results.items():
    the_mesh = setups[strategy][0]
    for p in r["described"].placements:
        assert p.bytes_per_device * axis_size(p.spec, the_mesh) == p.bytes_total, (strategy, p.name)
d = {s: r["described"] for s, r in results.items()}
assert d["replicated"].bytes_per_device == d["replicated"].bytes_total
assert d["tp"].bytes_per_device == d["tp_transposed"].bytes_per_device < d["replicated"].bytes_total / 3
assert d["fsdp"].bytes_per_device < d["replicated"].bytes_total / 7
assert results["tp"]["plan"].specs() == d["tp"].specs()  # apply_rules did what the plan said

# %% [markdown]
# ### Placing a model without staging it on one device
#
# `run` moved each copy with `m.to("jax")` and then resharded it. The first step puts every
# tensor, whole, on the default device: harmless for this model, fatal for a 16.6 GB video
# transformer on a 31.25 GiB chip (HunyuanVideo-1.5's, at full size). `sharding.place` builds each
# device's shards straight from host memory (`jax.make_array_from_callback` hands every device
# the slice of the CPU tensor its shard covers) after checking every spec, and is what the
# pipelines of notebooks `cogvideox_pipeline` and `hunyuan_video` use. `devices.live_bytes()` sums what each device holds from
# `jax.live_arrays()`, so the difference is measured rather than claimed.

# %%
before = devices.live_bytes()


def grown():
    return {d: n - before[d] for d, n in devices.live_bytes().items()}


staged = copy.deepcopy(model)
with env:
    staged.to("jax")  # step one of to("jax") + apply_rules
staged_bytes = grown()
sharding.free(staged)  # delete its device buffers now

placed = copy.deepcopy(model)
placed_plan = sharding.place(placed, sharding.rules("llama", "tp"), mesh, env)
placed_bytes = grown()
print("device  | to('jax') | place")
for d in before:
    print(f"{d:7s} | {staged_bytes[d]:>9,} | {placed_bytes[d]:>7,}")

# %%
first = str(jax.devices()[0])
assert staged_bytes[first] == placed_plan.bytes_total and sum(staged_bytes.values()) == placed_plan.bytes_total
assert set(placed_bytes.values()) == {placed_plan.bytes_per_device}  # each device: its shards, nothing more
assert sharding.describe(placed).specs() == results["tp"]["plan"].specs()  # the same layout as apply_rules
sharding.free(placed)

# %% [markdown]
# ## 4. Sharding a KV cache on heads
#
# In tensor-parallel decoding each device owns whole attention heads, so its cache slice is just
# its own heads: split the cache on the *key/value-head* dimension and attention needs no
# communication. A static cache laid out `(layers, batch, kv_heads, seq, head_dim)` takes
# `P(None, None, "tp", None, None)`; the batch could also go over `dp`.

# %%
kv_shape = (config.num_hidden_layers, 8, config.num_key_value_heads, 32, config.head_dim)
cache_sharding = NamedSharding(mesh, P(None, "dp", "tp", None, None))
k_cache = jax.device_put(jnp.zeros(kv_shape, jnp.float32), cache_sharding)
print("cache", k_cache.shape, "-> per device", k_cache.sharding.shard_shape(k_cache.shape))

# %%
assert k_cache.sharding.shard_shape(kv_shape) == (2, 8 // 2, 4 // 4, 32, 8)
slices = {tuple((i.start, i.stop) for i in s.index) for s in k_cache.addressable_shards}
assert len(slices) == 8  # 8 distinct slices, no copies

# %% [markdown]
# ### Exercise 3: the cache split on heads alone
#
# Decoding one long sequence leaves nothing for `dp` to split: take
# `P(None, None, "tp", None, None)`, heads over `tp` only. **Predict** first: the shape of each
# device's slice, how many distinct slices the eight devices hold, and how many devices hold each.
# Then run the solution.

# %% tags=["solution"]
heads_only = jax.device_put(jnp.zeros(kv_shape, jnp.float32), NamedSharding(mesh, P(None, None, "tp", None, None)))
holders = {}
for shard in heads_only.addressable_shards:
    holders.setdefault(tuple((i.start, i.stop) for i in shard.index), []).append(shard.device)
print("per device", heads_only.sharding.shard_shape(kv_shape), "|", len(holders), "distinct slices, each on",
      sorted({len(d) for d in holders.values()}), "devices")

# %% tags=["check"]
# Four head groups, each copied on both dp rows of the mesh: replication along the axis not named.
assert heads_only.sharding.shard_shape(kv_shape) == (2, 8, 4 // 4, 32, 8)
assert len(holders) == mesh.shape["tp"] and all(len(d) == mesh.shape["dp"] for d in holders.values())

# %% [markdown]
# ## 5. The same program, compiled for a TPU v6e-8
#
# Is the rule table right for a model that does not fit on this machine? Ahead-of-time
# compilation (notebook `start_here`) answers without weights: build the model on torch's `meta` device
# (shapes, no memory), turn every parameter into a `jax.ShapeDtypeStruct` carrying the spec from
# the plan, and compile the forward for a `v6e:2x4` slice with the TPU compiler from libtpu.
#
# The size: a Llama of 2,048 width, 16 query / 8 key-value heads, MLP 8,192, vocabulary 32,000,
# in bfloat16, two decoder layers (enough to see the pattern; more layers only take longer to
# compile on a 2-core CPU), batch 8 × 512 tokens.

# %%
big_config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32_000,
                         use_cache=False, tie_word_embeddings=False)
with torch.device("meta"):
    big = LlamaForCausalLM(big_config).to(torch.bfloat16)
tpu_mesh = devices.topology_mesh("v6e:2x4", (2, 4), ("dp", "tp"))
big_plan = sharding.plan(big, sharding.rules("llama", "tp"), tpu_mesh)
big_plan

# %% [markdown]
# The plan predicts the per-chip argument bytes: sharded weights plus each chip's slice of the
# token ids (int32, batch split over `dp`).

# %%
tokens = aot.abstract((8, 512), jnp.int32, NamedSharding(tpu_mesh, P("dp", None)))
predicted = big_plan.bytes_per_device + (8 // 2) * 512 * 4
print(f"predicted arguments per chip: {predicted:,} bytes ({aot.format_bytes(predicted)}) "
      f"of {aot.format_bytes(big_plan.bytes_total)} in total")

# %%
# NBVAL_IGNORE_OUTPUT
import time

start = time.perf_counter()
with env:
    big_forward = torchax_utils.FunctionalModule(big, return_dict=False)
    params, buffers = big_forward.abstract_state(big_plan)
    compiled = aot.compile_aot(big_forward, params, buffers, tokens)
print(f"AOT compile for v6e:2x4 on this host: {time.perf_counter() - start:.0f} s")

# %% [markdown]
# What the TPU compiler reports (AOT here, libtpu 0.0.42.1):

# %%
print(compiled.summary())
print("collectives:", compiled.collectives)
tpu_ops = aot.collective_ops(compiled.compiled.as_text(), 8)
print(f"bytes sent per chip per forward: {sum(op.bytes_sent for op in tpu_ops):,.0f}")
print(f"arguments per chip: {compiled.memory.arguments:,} bytes; "
      f"predicted {predicted:,}; difference {compiled.memory.arguments - predicted} bytes")

# %% [markdown]
# The prediction holds to within a few hundred bytes of 122 MiB. The difference, 256 bytes in
# our runs, is no larger than the two 128-byte rotary-frequency vectors; the TPU layout pads
# small arrays, which is the most likely source. On a real v6e-8 the full 32-layer model
# would be sharded by the same table.

# %%
big_activation = (8 // 2, 512, big_config.hidden_size)
big_weights = {tuple(p.shape) for p in big.parameters() if p.ndim == 2}
assert compiled.fits
assert 0 <= compiled.memory.arguments - predicted <= 1024
# the same structure as on CPU: the activations all-reduced after every row-parallel layer
# and the embedding lookup, and no weight ever crosses a chip
assert sum(op.shapes.count(big_activation) for op in tpu_ops if op.kind == "all-reduce") >= 2 * big_config.num_hidden_layers + 1
assert not any(shape in big_weights for op in tpu_ops for shape in op.shapes)

# %% [markdown]
# ## Takeaways
#
# * A `Mesh` names devices; a `PartitionSpec` says which array dimension goes over which axis;
#   the compiler inserts the communication.
# * Keep sharding as data: a regex → spec table per model family and strategy, applied with
#   `sharding.apply_rules`, checked before anything moves, with the unmatched tensors listed.
#   For a model still on the CPU, `sharding.place` builds each device's shards from host memory,
#   so no device ever holds the whole model.
# * Torch weights are `(out, in)`: Megatron column-parallel is **dim 0**, row-parallel **dim 1**.
#   Labels in other people's tables can be backwards; count the collectives.
# * TP, FSDP and replication compute the same logits here (within 1e-5 of PyTorch on CPU); they
#   differ in collectives (all-reduces of activations vs all-gathers of weights vs none) and in
#   bytes per device (1/4, 1/8, all).
# * Shard a KV cache on heads; compile ahead of time for the TPU you plan to rent to see per-chip
#   memory before paying for it.
#
# Next: notebook `torchax_internals`, torchax internals and the pitfall catalog.

# %% [markdown]
# ## Self-check
#
# 1. A torch `nn.Linear(512, 2048)` is the first layer of an MLP. Which dimension of its
#    `weight` does Megatron's column-parallel rule split, and why does that layer need no
#    communication?
#
#    <details><summary>Answer</summary>
#
#    Dim 0: torch stores the weight as `(out_features, in_features)`, here `(2048, 512)`, and
#    column-parallel splits the output features. Each device then computes whole output columns
#    from the whole input; nothing is summed across devices.
#
#    </details>
#
# 2. Why does a rule table list the tensors no rule matches instead of silently replicating them?
#
#    <details><summary>Answer</summary>
#
#    A typo in a regex would otherwise replicate a large matrix on every device without a word,
#    costing memory the plan never showed. Listing them makes the mistake visible before anything
#    moves.
#
#    </details>
#
# 3. FSDP held the fewest weight bytes per device here, yet sent more bytes than `tp`. When does
#    FSDP pay off?
#
#    <details><summary>Answer</summary>
#
#    When the batch per device is large compared with the weights: FSDP all-gathers every weight
#    matrix on every forward, a cost that does not grow with the batch, while `tp` moves
#    activations, which do. With this tiny batch, the weight traffic dominates.
#
#    </details>
#
# 4. Inside `jax.shard_map`, what does `jax.lax.psum(v, "tp")` compute, and what would a
#    row-parallel layer return without it?
#
#    <details><summary>Answer</summary>
#
#    The sum of `v` over the devices along the `tp` axis, an all-reduce, so every device ends with
#    the full result. Without it each device returns only its partial sum over its quarter of the
#    contracting dimension.
#
#    </details>
#
# 5. A `NamedSharding` with `P(None, None, "tp", None, None)` on a `(2, 4)` mesh of `("dp", "tp")`:
#    how many copies of each slice exist, and why?
#
#    <details><summary>Answer</summary>
#
#    Two. The spec does not name `dp`, so the array is replicated along it: each of the four `tp`
#    slices is held by both devices in its column of the mesh.
#
#    </details>
