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
#    and different bytes per device, all measured;
# 4. a **KV cache sharded on heads**;
# 5. the same forward **compiled ahead of time for a TPU v6e-8** (`v6e:2x4`), with per-chip memory
#    predicted from the rule table and confirmed by the TPU compiler.
#
# *Budget: a few minutes on a 2-core CPU (tiny), most of it the TPU compile in section 5.*

# %%
# %xmode Minimal
from tpupedia import devices, session

preset = session.start()  # preset, simulated devices, known warnings silenced (notebook 01)

# %% [markdown]
# ## 1. A mesh and a `NamedSharding`
#
# A mesh arranges the 8 devices in a grid and names its axes. We use `("dp", "tp")` of shape
# `(2, 4)`: two data-parallel groups of four tensor-parallel devices. `devices.make_mesh` builds
# it with `AxisType.Auto` axes; jax 0.10's default, `Explicit`, makes torchax's op lowerings
# fail (lesson 00).

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

# %%
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

# %%
from tpupedia import sharding

sharding.rules("llama", "tp")

# %% [markdown]
# The same `llama` tables serve Qwen2 and Mistral, which share the naming (the tests check
# them on those families). `sharding.RULES` also has tables for the CogVideoX and
# HunyuanVideo-1.5 transformers used in lessons 06 and 07.
#
# **A naming trap from upstream.** Some public CogVideoX TPU scripts (summarised in this course's
# reference notes) label a table "TP (Megatron column-row)" that shards `to_q/to_k/to_v` and the
# first MLP layer on **dim 1** and `to_out`/the second MLP layer on **dim 0**. For torch's
# `(out, in)` weights that is the opposite of Megatron, and the same scripts' "FSDP" table is the
# actual Megatron layout. The HunyuanVideo scripts get it right (dim 0 for q/k/v/fc1). We keep the
# upstream layout as the strategy `"tp_transposed"` and measure it below instead of trusting
# either label.

# %%
sharding.RULES[("cogvideox", "tp_transposed")]

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
from IPython.display import Markdown

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
# fine-tunes add one pad token, giving 32,001 rows. The check runs before any data moves and
# names the parameter, the dimension and the mesh axis. (The model is built on the `meta`
# device: shapes only, no memory.)

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
# environment), run it through `JitModule` (lesson 01), and compile the same forward with
# `torchax_utils.FunctionalModule`, which exposes the pure JAX function torchax jits. With it,
# `jax.jit(f).lower(params, buffers, ids).compile().as_text()` is the partitioned program, and
# counting its collectives (`aot.collective_counts`) shows what each layout costs in
# communication.

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
    with env:
        m.to("jax")
        plan = sharding.apply_rules(m, sharding.rules("llama", strategy), the_mesh)
        ids_jax = jax.device_put(jnp.asarray(ids.numpy()), NamedSharding(the_mesh, batch_spec))
        logits = torchax_utils.JitModule(m)(env.j2t_iso(ids_jax)).logits.jax()
        hlo = torchax_utils.FunctionalModule(m, return_dict=False).hlo(ids_jax)
    return {"plan": plan, "described": sharding.describe(m), "logits": logits,
            "collectives": aot.collective_counts(hlo)}


results = {strategy: run(strategy) for strategy in setups}

# %% [markdown]
# First the claim everything else rests on: every layout computes the same function.

# %%
for strategy, r in results.items():
    diff = np.abs(np.asarray(r["logits"]) - reference_logits).max()
    print(f"{strategy:>14}: max |logits - PyTorch CPU| < 1e-5: {bool(diff < 1e-5)}; "
          f"logits sharding {r['logits'].sharding.spec}")

# %%
for r in results.values():
    np.testing.assert_allclose(np.asarray(r["logits"]), reference_logits, atol=1e-5, rtol=0)

# %% [markdown]
# Now what differs: collectives in the compiled program and weight bytes per device
# (`describe` reads the placement back from the arrays).

# %%
kinds = ["all-reduce", "all-gather", "all-to-all", "collective-permute"]
lines = ["| strategy | " + " | ".join(kinds) + " | bytes per device | of total |",
         "|---|" + "---:|" * (len(kinds) + 2)]
for strategy, r in results.items():
    d = r["described"]
    counts = " | ".join(str(r["collectives"].get(k, 0)) for k in kinds)
    lines.append(f"| `{strategy}` | {counts} | {d.bytes_per_device:,} | "
                 f"{d.bytes_per_device / d.bytes_total:.1%} |")
Markdown("\n".join(lines))

# %% [markdown]
# How to read it (2 decoder layers):
#
# * **replicated**: no collectives at all. Each `dp` group computes its own half of the batch
#   with the whole model: plain data parallelism, and every device pays for every byte.
# * **tp**: Megatron's all-reduce after each row-parallel layer (`o_proj`, `down_proj`) appears
#   once per layer and block. The extra small all-reduces and all-gathers come from the
#   embedding table being split on its hidden dimension (the upstream Llama table's choice):
#   the residual stream starts out split, so the RMSNorms need a cross-device sum. About a
#   quarter of the weights per device (the `tp` axis has 4 devices; norms stay replicated).
# * **fsdp**: one all-gather per weight matrix, fetched right before it is used; activations
#   never leave their device. The smallest weight footprint (an eighth), paid for in weight
#   traffic on every forward. That is FSDP's trade: cheap when the batch per device is large
#   compared with the weights.
# * **tp_transposed**: the same bytes per device as `tp`, but with the contracting dimension
#   split for q/k/v/gate/up the compiler has to reshuffle or sum activations differently,
#   including an all-reduce of the full `(batch, seq, vocab)` logits at the end, where
#   Megatron's vocab-parallel `lm_head` needs none. "TP" is not a layout; the dims are.

# %%
nlayers = config.num_hidden_layers
tp_counts, fsdp_counts = results["tp"]["collectives"], results["fsdp"]["collectives"]
assert results["replicated"]["collectives"] == {}
assert tp_counts.get("all-reduce", 0) >= 2 * nlayers  # o_proj + down_proj, each layer
assert fsdp_counts.get("all-gather", 0) >= 7 * nlayers  # one per weight matrix, each layer
assert fsdp_counts.get("all-reduce", 0) < tp_counts["all-reduce"]
assert results["tp_transposed"]["collectives"] != tp_counts

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
# ## 5. The same program, compiled for a TPU v6e-8
#
# Is the rule table right for a model that does not fit on this machine? Ahead-of-time
# compilation (lesson 00) answers without weights: build the model on torch's `meta` device
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
print(f"arguments per chip: {compiled.memory.arguments:,} bytes; "
      f"predicted {predicted:,}; difference {compiled.memory.arguments - predicted} bytes")

# %% [markdown]
# The prediction holds to within a few hundred bytes of 122 MiB. The difference, 256 bytes in
# our runs, is no larger than the two 128-byte rotary-frequency vectors; the TPU layout pads
# small arrays, which is the most likely source. On a real v6e-8 the full 32-layer model
# would be sharded by the same table.

# %%
assert compiled.fits
assert 0 <= compiled.memory.arguments - predicted <= 1024
assert compiled.collectives.get("all-reduce", 0) >= 2 * big_config.num_hidden_layers

# %% [markdown]
# ## Takeaways
#
# * A `Mesh` names devices; a `PartitionSpec` says which array dimension goes over which axis;
#   the compiler inserts the communication.
# * Keep sharding as data: a regex → spec table per model family and strategy, applied with
#   `sharding.apply_rules`, checked before anything moves, with the unmatched tensors listed.
# * Torch weights are `(out, in)`: Megatron column-parallel is **dim 0**, row-parallel **dim 1**.
#   Labels in other people's tables can be backwards; count the collectives.
# * TP, FSDP and replication compute the same logits here (within 1e-5 of PyTorch on CPU); they
#   differ in collectives (all-reduces of activations vs all-gathers of weights vs none) and in
#   bytes per device (1/4, 1/8, all).
# * Shard a KV cache on heads; compile ahead of time for the TPU you plan to rent to see per-chip
#   memory before paying for it.
#
# Next: lesson 03, torchax internals and the pitfall catalog.
