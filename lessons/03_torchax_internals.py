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
# # 03 · torchax internals and the pitfall catalog
#
# Notebooks `hf_model_in_jax` and `sharding` used torchax as a black box: move a model to `"jax"`, wrap it, call it.
# This notebook opens the box. You will see what a torchax tensor is, how it trades places with
# a `jax.Array`, how to replace one PyTorch operator with your own implementation, how to compile
# methods other than `forward`, and how to move state that is not inside an `nn.Module`. It ends
# with a small diffusers video pipeline whose every component is compiled, and with the other
# routes from PyTorch to a TPU beside this one.
#
# Along the way we hit, on purpose, the failures that everyone meets when porting a model. Each
# one gets a `### Pitfall` heading, the real error text, the cause, the fix, and asserts proving
# the fix (section 4's five pitfalls share one check cell at the end of the section). Where the
# fix is a helper of `tpupedia.torchax_utils`, the few lines that do it are written out on the
# page and checked equal to the helper. The [torchax pitfalls](../kb/torchax-pitfalls.md) page of
# the knowledge base indexes them.
#
# | section | idea | pitfalls met |
# |---|---|---|
# | 1 | the torchax tensor and the environment | math outside the environment; mixed torch/torchax math |
# | 2 | `jax_view`, `torch_view`, `call_jax` | |
# | 3 | overriding an operator (SDPA) | NaN for fully masked attention rows |
# | 4 | compiling a whole forward | not a valid JAX type; a cache in the outputs; ConcretizationTypeError; data-dependent shapes; the eager-dispatch slowdown |
# | 5 | compiling `decode` and other methods | |
# | 6 | state outside modules (schedulers) | `'Tensor' object has no attribute '_env'` |
# | 7 | a whole diffusers pipeline, compiled | |
# | 8 | three routes onto a TPU (torchax, torch_xla, TorchTPU), two of them run here | |
#
# The models are tiny and random on every preset: this notebook is about mechanics, not about
# any particular checkpoint, so `full` loads nothing more.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | tiny random GPT-2, Llama and CogVideoX models built in code | about 1.2 GB of host RAM | about 20 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | the same tiny models | a few MB per chip | under a minute, mostly compiling (not measured here: no TPU) |
#
# *Reading time: about 34 minutes.*

# %% [markdown]
# ## 0. Set-up
#
# The same first cell as every notebook: quiet, deterministic warnings and logs, then the preset
# and the simulated devices, before anything touches JAX. torchax itself is always imported
# through `tpupedia.compat.import_torchax`, which works around a torchax 0.0.13 / PyTorch 2.13
# incompatibility: torchax names 22 operator overloads that PyTorch 2.13 removed (such as
# `aten.prod.dim_Dimname`), so a plain `import torchax` fails, and the shim lets exactly those
# names resolve to inert placeholders (google/torchax fixed it upstream, #102).

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

# %%
import re
import time

import jax
import numpy as np
import torch
import transformers

from tpupedia import torchax_utils as tu
from tpupedia.compat import import_torchax

torchax = import_torchax()
from torchax.interop import JittableModule, call_jax, jax_jit, jax_view, torch_view

env = torchax.default_env()
print(f"torchax {torchax.__version__}, jax {jax.__version__}, torch {torch.__version__.split('+')[0]}")

# %% [markdown]
# Every section ends by comparing a torchax result with PyTorch on the CPU at float32 rounding
# (1e-5 or tighter). On a TPU, JAX runs float32 matmuls and convolutions as bfloat16 passes
# unless asked otherwise (notebook `image_processing` shows the request in the compiled program), which would
# break those checks by orders of magnitude; a CPU ignores the setting. This notebook is all
# parity checks on float32 models, so it asks for full precision once, for every cell. (The one
# timing in section 4 compares eager with compiled under the same setting.)

# %%
jax.config.update("jax_default_matmul_precision", "highest")
assert jax.config.jax_default_matmul_precision == "highest"

# %% [markdown]
# ## 1. The torchax tensor and the environment
#
# A `torchax.tensor.Tensor` is a `torch.Tensor` subclass that holds a `jax.Array` instead of
# storage. PyTorch does not know how to run `aten.add` on it, so it hands every operation to
# `__torch_dispatch__`, and torchax looks the operator up in its table of JAX implementations.
# That lookup only happens while the **environment** is active, because the environment is a
# pair of torch "modes" that intercept both tensor operations and factory calls
# (`torch.ones(..., device="jax")`). `with env:` turns them on; `.to("jax")` inside it moves a
# tensor, or every parameter and buffer of a module.

# %%
def kind(obj):
    """Which of the three array types `obj` is, by name."""
    if isinstance(obj, torchax.tensor.Tensor):
        return f"torchax.tensor.Tensor on {obj.device}"
    if isinstance(obj, torch.Tensor):
        return f"torch.Tensor on {obj.device}"
    return "jax.Array" if isinstance(obj, jax.Array) else type(obj).__name__


torch.manual_seed(0)
x_cpu = torch.randn(2, 3)
with env:
    x = x_cpu.to("jax")
    y = (x * 2).sin()
print("x:        ", kind(x), x.dtype, tuple(x.shape))
print("x.jax():  ", kind(x.jax()), x.jax().dtype)
print("y.torch():", kind(y.torch()))

# %% tags=["check"]
assert isinstance(x, torchax.tensor.Tensor) and isinstance(x, torch.Tensor)
assert isinstance(x.jax(), jax.Array)
torch.testing.assert_close(y.torch(), (x_cpu * 2).sin())

# %% [markdown]
# `.jax()` unwraps the array and `.torch()` copies it back to a plain CPU tensor; both work
# outside the environment because they do no math. Everything else needs it.
#
# ### Pitfall 1: math outside the environment
#
# The environment is a context manager, so it is easy to leave it and keep using its tensors:

# %% tags=["raises-exception"]
x + 1

# %% [markdown]
# **Cause.** Outside `with env:` no mode intercepts the operation; torchax's dispatch hook sees
# that and refuses rather than guessing. **Fix.** Keep the math inside `with env:` (or call
# `torchax.enable_globally()` once, at the top of a script). Prefer one explicit block: nested
# `with env:` blocks switch the modes off when the inner one exits.

# %%
with env:
    z = x + 1
torch.testing.assert_close(z.torch(), x_cpu + 1)

# %% [markdown]
# ### Pitfall 2: mixed torch and torchax math
#
# Inside the environment, a factory call *without* `device="jax"` still builds an ordinary CPU
# tensor, and so does anything that was created before the environment was entered. Adding one
# to a torchax tensor fails:

# %% tags=["raises-exception"]
with env:
    bias = torch.arange(3.0)  # a plain CPU tensor
    print("bias:", kind(bias))
    x + bias

# %% [markdown]
# **Cause.** torchax unwraps each argument to a `jax.Array`; a plain `torch.Tensor` has no array
# inside, and torchax will not copy host memory behind your back (that would hide a host-to-device
# transfer on every step). **Fix.** Move the stray tensor explicitly with `.to("jax")`, or create
# it with `device="jax"`. Most real cases are hidden state: a module attribute that is not a
# registered buffer, or a tensor built in `__init__`. Section 6 meets the scheduler version of
# this.

# %%
with env:
    total = x + bias.to("jax")
torch.testing.assert_close(total.torch(), x_cpu + torch.arange(3.0))

# %% [markdown]
# ## 2. Crossing the border: `jax_view`, `torch_view`, `call_jax`
#
# Sometimes the right tool is a JAX function (a Pallas kernel, `jax.lax.with_sharding_constraint`,
# a Flax layer) and the caller is PyTorch code, or the other way round. `torchax.interop` converts
# without copying:
#
# * `jax_view(obj)` replaces every torchax tensor in a pytree by its `jax.Array`; applied to a
#   function, it makes a function that takes and returns JAX arrays;
# * `torch_view(obj)` does the reverse: arrays become torchax tensors, and a JAX function becomes
#   a torch-callable one;
# * `call_jax(fn, *args)` calls a JAX function on torchax tensors and wraps the result.

# %%
def jax_gelu_mean(a):  # pure JAX
    return jax.nn.gelu(a, approximate=False).mean(axis=-1)


torch_gelu_mean = torch_view(jax_gelu_mean)  # now takes and returns torchax tensors
with env:
    from_view = torch_gelu_mean(x)
    from_call = call_jax(jax_gelu_mean, x)
    arrays = jax_view({"x": x, "y": y})
print("torch_view:", kind(from_view))
print("call_jax: ", kind(from_call))
print("jax_view: ", {name: kind(a) for name, a in arrays.items()})

# %%
reference = torch.nn.functional.gelu(x_cpu).mean(-1)
torch.testing.assert_close(from_view.torch(), reference, rtol=0, atol=1e-6)
torch.testing.assert_close(from_call.torch(), reference, rtol=0, atol=1e-6)
assert all(isinstance(v, jax.Array) for v in arrays.values())

# %% [markdown]
# The same works in the other direction: `jax_view(torch_fn)` turns a function written with
# torch ops into one that JAX can trace, and that is exactly what `torchax.interop.jax_jit` does
# before handing it to `jax.jit` (section 4).

# %% [markdown]
# ## 3. Overriding an operator: scaled dot-product attention
#
# The environment keeps a table from PyTorch operators to implementations, and
# `env.override_op_definition(op, impl)` replaces one entry. The implementation receives
# torchax tensors and may use torch ops (they are dispatched to JAX in turn) or call JAX
# directly through `call_jax`. This is how the course will plug in TPU kernels: notebook `splash_attention`, later, installs
# a Pallas splash-attention kernel as the implementation of
# `F.scaled_dot_product_attention`, through this same mechanism.
#
# Here we use it to fix a real difference between torchax and PyTorch.
#
# ### Pitfall 3: NaN from fully masked attention rows
#
# Video and text-to-video transformers pad their prompts and mask the padded *queries*, so some
# rows of the boolean attention mask are all `False`. PyTorch returns zeros for those rows;
# torchax 0.0.13's SDPA takes a softmax over nothing and returns NaN:

# %%
F = torch.nn.functional
torch.manual_seed(0)
q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
mask = torch.ones(1, 1, 4, 5, dtype=torch.bool)
mask[..., 3, :] = False  # query row 3 may attend to nothing

expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
with env:
    got = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"))
print("PyTorch, row 3:", expected[0, 0, 3, :4].tolist())
print("torchax, row 3:", got.torch()[0, 0, 3, :4].tolist())

# %% [markdown]
# **Cause.** Masked scores are set to `-inf`; a row of only `-inf` gives `0/0` in the softmax.
# PyTorch special-cases that row, torchax's reference implementation does not. In a transformer
# the NaN does not stay put: the next attention multiplies it by a zero weight, and `0 * NaN`
# is NaN, so the whole output becomes NaN (that is how HunyuanVideo-1.5 fails under torchax).
#
# **Fix.** Run torchax's own reference SDPA, then zero the rows whose mask is all `False`, and
# register that function for both entry points attention reaches torchax through: the
# functional `F.scaled_dot_product_attention` and the `aten` operator it lowers to. Those are
# the few lines below; `tu.masked_row_safe_sdpa` is the same function in the package, and
# `tu.install_masked_row_safe_sdpa(env)` registers it the same way. The override stays installed
# in this environment for the rest of the notebook; it changes nothing for rows that can attend
# to something.

# %%
from torchax.ops.jtorch import _sdpa_reference  # what torchax 0.0.13 runs for SDPA


def sdpa_zeroing_empty_rows(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
    out = _sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        can_attend = attn_mask.any(-1, keepdim=True)  # False for a query row that may attend to nothing
        out = torch.where(can_attend, out, torch.zeros_like(out))  # PyTorch's answer for that row: zeros
    return out


sdpa_ops = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)
for op in sdpa_ops:
    env.override_op_definition(op, sdpa_zeroing_empty_rows)
with env:
    fixed = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"))
    from_package = tu.masked_row_safe_sdpa(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"))
print("torchax with the override, row 3:", fixed.torch()[0, 0, 3, :4].tolist())

# %% tags=["check"]
# torchax's stock SDPA gives NaN; the override removes it and matches PyTorch
assert torch.isnan(got.torch()).any()
assert not torch.isnan(fixed.torch()).any()
torch.testing.assert_close(fixed.torch(), expected, rtol=0, atol=1e-5)
# the override above is the package's: same result, bit for bit, registered for the same operators
np.testing.assert_array_equal(fixed.torch().numpy(), from_package.torch().numpy())
assert sdpa_ops == tu.SDPA_OPS

# %% [markdown]
# ## 4. Compiling a whole forward
#
# Notebook `hf_model_in_jax` compiled a Llama forward with `JittableModule` (its sections 2 to
# 4: eager dispatch, output classes as pytrees, static flags). This section replays those
# failures on another model as a catalog, error text, cause and fix, in the order they come,
# and adds what that notebook only avoided or did not meet: the error a cache object in the
# outputs raises, and shapes that depend on the data.
#
# Our test subject is a tiny random GPT-2, first on the CPU as the reference, then eagerly under
# torchax.

# %%
torch.manual_seed(0)
gpt2 = transformers.GPT2LMHeadModel(
    transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64)
).eval()
ids = torch.randint(0, 256, (2, 8))
with torch.no_grad():
    logits_cpu = gpt2(ids, use_cache=False).logits

with env:
    gpt2.to("jax")
    ids_j = ids.to("jax")
    logits_eager = gpt2(ids_j, use_cache=False).logits
print("eager logits:", kind(logits_eager), tuple(logits_eager.shape))

# %% [markdown]
# Now compile it. The failures below come one after the other: each fix uncovers the next.
#
# ### Pitfall 4: not a valid JAX type
#
# `jax.jit` can only return *JAX pytrees*. Hugging Face's `ModelOutput` (and diffusers'
# `BaseOutput`) are registered as **torch** pytrees, which torchax uses to convert arguments,
# but not as JAX pytrees. The message names a file and line inside torchax; we print it without
# that path.

# %%
jm = JittableModule(gpt2)
try:
    with env:
        jm(ids_j)
except TypeError as err:
    message = re.sub(r" at \S+\.py:\d+", "", str(err).splitlines()[0])
    print(f"{type(err).__name__}: {message}")

# %% [markdown]
# **Cause.** The output class is unknown to `jax.tree_util`. **Fix.** Register it by field
# name: flattening gives the values of the fields that are set, with their names as static data,
# and unflattening rebuilds the class by keyword (notebook `hf_model_in_jax`, section 3, shows
# why by name and not by position). That is `tu.register_output_pytree(cls)` in the package, and
# `tu.register_common_outputs()` registers every output class this course meets. Here it is
# written out, and registered for GPT-2's output class:

# %%
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions


def register_by_field_name(cls):
    def flatten(out):
        names = tuple(out.keys())  # a ModelOutput's keys are its fields that are not None
        return tuple(out[name] for name in names), names  # children, static aux data

    def unflatten(names, values):
        return cls(**dict(zip(names, values)))  # by keyword: no field can shift into another

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


register_by_field_name(CausalLMOutputWithCrossAttentions)


class ByPackage(CausalLMOutputWithCrossAttentions):
    """The same fields, registered by the package's helper, to compare the two."""


tu.register_output_pytree(ByPackage)
output_fields = dict(logits=torch.arange(4.0), hidden_states=(torch.ones(2),))  # loss and the rest left None
page_leaves, page_tree = jax.tree_util.tree_flatten(CausalLMOutputWithCrossAttentions(**output_fields))
package_leaves, package_tree = jax.tree_util.tree_flatten(ByPackage(**output_fields))
round_trip = jax.tree_util.tree_unflatten(page_tree, page_leaves)
print("aux data, page:", page_tree.node_data()[1], "| package:", package_tree.node_data()[1])
print("round trip: loss", round_trip.loss, "| logits", round_trip.logits.tolist())

# %% [markdown]
# ### Pitfall 5: a cache in the outputs
#
# With the output class registered, the same call fails one level deeper: GPT-2 returns its
# key/value cache, a `DynamicCache` object, inside the output.

# %%
try:
    with env:
        jm(ids_j)
except TypeError as err:
    message = re.sub(r" at \S+\.py:\d+", "", str(err).splitlines()[0])
    print(f"{type(err).__name__}: {message}")

# %% [markdown]
# **Cause.** `DynamicCache` is not a pytree either, and it could not be one usefully: it grows by
# one position per generated token, so every step would have new shapes and a new compilation.
# (For generation, a fixed-size cache is the way: notebook `hf_model_in_jax`, section 7.)
# **Fix** for a single forward: do not build the cache. The natural way to say that is
# `use_cache=False`, which leads straight to the next pitfall.
#
# ### Pitfall 6: ConcretizationTypeError from a Python flag
#
# The failure of notebook `hf_model_in_jax`'s section 4: `jax.jit` traces every argument,
# `False` included, and the model's `if use_cache:` asks a tracer for its truth value:

# %%
try:
    with env:
        jm(ids_j, use_cache=False)
except jax.errors.ConcretizationTypeError as err:
    first = str(err).splitlines()[0]
    which = re.search(r"depends on the value of the argument (\S+)\.", str(err)).group(1)
    print(f"{type(err).__name__}: {first}")
    print(f"... depends on the value of the argument {which}")

# %% [markdown]
# **Cause.** `return_dict`, `use_cache` and friends are configuration, not data, and must be
# *static*. **Fix.** Split the keywords: tensors stay arguments of the jitted function, and
# everything else is closed over, so the trace sees plain Python values. Each distinct set of
# such values is its own program, compiled on first use and kept in a dict:

# %%
programs = {}  # one jitted program per distinct set of static keyword values


def call_with_static_keywords(jm, *args, **kwargs):
    static = {name: val for name, val in kwargs.items() if not isinstance(val, torch.Tensor)}  # flags
    tensors = {name: val for name, val in kwargs.items() if name not in static}  # data: traced
    key = repr(sorted(static.items()))
    if key not in programs:
        programs[key] = jax_jit(  # `static` is closed over: `if use_cache:` sees a Python bool
            lambda params, buffers, *a, **kw: jm.functional_call("forward", params, buffers, *a, **kw, **static)
        )
    return programs[key](jm.params, jm.buffers, *args, **tensors)


with env:
    page_a = call_with_static_keywords(jm, ids_j, use_cache=False)
    page_b = call_with_static_keywords(jm, ids_j, use_cache=False, return_dict=False)
    page_c = call_with_static_keywords(jm, ids_j, use_cache=False)  # same flags as page_a: no new program
print(type(page_a).__name__, type(page_b).__name__, "| programs:", len(programs))

# %% [markdown]
# `tu.JitModule` is the same mechanism (it also looks for tensors inside lists and tuples, and
# compiles other methods on request, section 5), wrapped as a module that stays an instance of
# the model's class and forwards attribute access to it, which is what a pipeline needs:

# %%
gpt2_jit = tu.JitModule(gpt2)
with env:
    out_a = gpt2_jit(ids_j, use_cache=False)
    out_b = gpt2_jit(ids_j, use_cache=False, return_dict=False)
    out_c = gpt2_jit(ids_j, use_cache=False)  # same static values as out_a: no new program
print(type(out_a).__name__, type(out_b).__name__, "| compiled programs:", gpt2_jit.compiled_variants)

# %% [markdown]
# Other ways out, when you control the call: set `model.config.use_cache = False`, or close over
# the constants, `jax_jit(lambda p, b, i: jm.functional_call("forward", p, b, i, use_cache=False))`.
#
# ### Pitfall 7: data-dependent shapes
#
# XLA compiles for fixed shapes. Eager torchax can run code whose output *shape* depends on the
# *values* in a tensor, such as boolean-mask indexing, because each op runs on concrete data:

# %%
def positive_sum(t):
    return t[t > 0].sum()  # how many elements survive depends on the data


with env:
    v = torch.randn(8, generator=torch.Generator().manual_seed(5)).to("jax")
    eager_sum = positive_sum(v)
print("eager:", round(float(eager_sum.torch()), 4))

# %% [markdown]
# Under `jax.jit` the mask is a tracer, and the indexed array would have an unknown length:

# %% tags=["raises-exception"]
with env:
    jax_jit(positive_sum)(v)

# %% [markdown]
# **Cause.** The number of selected elements is data, not shape. The same wall is hit by
# `.nonzero()`, `.item()` and `.tolist()`, and by Python `if` on a tensor value
# (`ConcretizationTypeError`). **Fix.** Rewrite with fixed shapes: keep every element and zero
# the ones you do not want (`torch.where`, or a multiplication by the mask). For a reordering,
# a stable `argsort` over the mask keeps the valid elements first while keeping the length.

# %%
def positive_sum_static(t):
    return torch.where(t > 0, t, torch.zeros_like(t)).sum()


with env:
    jitted_sum = jax_jit(positive_sum_static)(v)
print("jitted:", round(float(jitted_sum.torch()), 4))

# %% [markdown]
# ### Pitfall 8: the eager-dispatch slowdown
#
# Nothing fails here, which is what makes it a pitfall: a model moved to `"jax"` and called
# inside `with env:` gives the right answer, just slowly, one round trip per operator (notebook
# `hf_model_in_jax` timed it on its Llama). The fix is the compiled forward we already have;
# the tiny GPT-2 both ways, after a warm-up call, waiting for each result:

# %%
def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn().jax())
        times.append(time.perf_counter() - start)
    return min(times)


with env:
    best_of(lambda: gpt2(ids_j, use_cache=False).logits, 1)  # warm-up
    eager_s = best_of(lambda: gpt2(ids_j, use_cache=False).logits, 3)
    jit_s = best_of(lambda: gpt2_jit(ids_j, use_cache=False).logits, 20)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"measured here (tiny GPT-2, 2-core CPU in CI): eager {eager_s * 1e3:.1f} ms, "
      f"jitted {jit_s * 1e3:.2f} ms, eager/jit = {eager_s / jit_s:.0f}x")

# %% [markdown]
# The asserts for the whole section, one group per claim:

# %% tags=["check"]
# eager torchax runs GPT-2 as PyTorch does
torch.testing.assert_close(logits_eager.torch(), logits_cpu, rtol=0, atol=1e-5)
# pitfall 4: the field-name registration above is the package's (same leaves, same names) and keeps None fields None
assert page_tree.node_data()[1] == package_tree.node_data()[1] == ("logits", "hidden_states")
assert all(torch.equal(a, b) for a, b in zip(page_leaves, package_leaves, strict=True))
assert round_trip.loss is None and torch.equal(round_trip.logits, torch.arange(4.0))
# pitfall 6: static keywords, one program per set of flags; the page's mechanism gives tu.JitModule's results
assert len(programs) == gpt2_jit.compiled_variants == 2
assert isinstance(gpt2_jit, transformers.GPT2LMHeadModel)  # pipelines' isinstance checks still pass
for logits in (out_a.logits, out_b[0], out_c.logits):
    torch.testing.assert_close(logits.torch(), logits_cpu, rtol=0, atol=1e-5)
for page, package in ((page_a.logits, out_a.logits), (page_b[0], out_b[0]), (page_c.logits, out_c.logits)):
    np.testing.assert_array_equal(page.torch().numpy(), package.torch().numpy())
# pitfall 7: the fixed-shape rewrite compiles and gives the eager answer
torch.testing.assert_close(jitted_sum.torch(), eager_sum.torch(), rtol=0, atol=1e-6)
# pitfall 8: the compiled forward is faster than eager dispatch
assert eager_s > jit_s

# %% [markdown]
# The ratio grows with the number of operators, not with their size. Reported upstream (TPU
# v6e-8, YOLO11n at 640×640): about 21.7 s per forward eagerly against 8.1 ms with one `jax.jit`
# around the whole forward. On a real model, always compile the hot path, and check that the
# method you actually call is the compiled one, which is the subject of the next section.

# %% [markdown]
# ### Exercise 1: a mean over the selected elements, compiled
#
# Pitfall 7 summed the positive elements. Take the next step a real model takes, their *mean*:
# `positive_mean(t)` returns `t[t > 0].mean()`. **Predict** whether eager torchax runs it, and
# what `jax_jit(positive_mean)` raises. Then rewrite it with fixed shapes, as pitfall 7's fix
# did (the count of positive elements is itself a sum over the mask), compile the rewrite, and
# compare it with plain PyTorch on the CPU for the same vector `v`.

# %% tags=["solution"]
from tpupedia.errors import expect  # prints an expected error's cleaned message (notebook `hf_model_in_jax`)


def positive_mean(t):
    return t[t > 0].mean()


def positive_mean_static(t):
    keep = t > 0
    return torch.where(keep, t, torch.zeros_like(t)).sum() / keep.sum()


with env:
    eager_mean = positive_mean(v)  # eager: every op sees concrete data, so it runs
    mean_error = expect(lambda: jax_jit(positive_mean)(v), jax.errors.NonConcreteBooleanIndexError, max_lines=1)
    jitted_mean = jax_jit(positive_mean_static)(v)
cpu_mean = positive_mean(v.torch())
print(f"PyTorch CPU {float(cpu_mean):.4f} | eager torchax {float(eager_mean.torch()):.4f} "
      f"| jitted rewrite {float(jitted_mean.torch()):.4f}")

# %% tags=["check"]
assert isinstance(mean_error, jax.errors.NonConcreteBooleanIndexError)
torch.testing.assert_close(eager_mean.torch(), cpu_mean, rtol=0, atol=1e-6)
torch.testing.assert_close(jitted_mean.torch(), cpu_mean, rtol=0, atol=1e-6)

# %% [markdown]
# ## 5. Compiling `decode` and other methods
#
# A pipeline does not always call `forward`. A diffusion pipeline calls `vae.decode(latents)`,
# and `JittableModule` compiles only `forward`: any other method falls through to the wrapped
# module and runs eagerly, silently. `tu.JitModule(vae, methods=("decode",))` compiles `decode`
# the same way as `forward` (with the same static-keyword treatment), and
# `torchax.compile(vae, torchax.CompileOptions(methods_to_compile=["decode"]))` is torchax's own
# spelling. The VAE is CogVideoX's, with tiny random weights (diffusers' fast-test sizes): 4
# latent channels and 3 latent frames of 4×4 decode to 9 RGB frames of 32×32.

# %%
from diffusers import AutoencoderKLCogVideoX

tu.register_common_outputs()  # DecoderOutput and the other output classes this course meets


def tiny_cogvideox_vae():
    torch.manual_seed(0)
    return AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
    ).eval()


vae = tiny_cogvideox_vae()
latent = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    video_cpu = vae.decode(latent).sample

with env:
    vae.to("jax")
    vae_jit = tu.JitModule(vae, methods=("decode",))
    video_jax = vae_jit.decode(latent.to("jax")).sample
diff = (video_jax.torch() - video_cpu).abs().max().item()
print(f"decoded {tuple(video_jax.shape)}; compiled programs: {vae_jit.compiled_variants}; "
      f"max abs diff < 1e-4: {diff < 1e-4}")

# %% tags=["check"]
assert vae_jit.compiled_variants == 1
assert diff < 1e-4

# %% [markdown]
# ## 6. State that lives outside modules: schedulers
#
# `.to("jax")` on a module moves its parameters and registered buffers. Anything else stays
# where it was created. The usual offender is the diffusion scheduler: it is not an
# `nn.Module`, yet it keeps tensors (`alphas_cumprod`, `timesteps`, `sigmas`) that it indexes
# with the current timestep on every step.
#
# ### Pitfall 9: scheduler tensors left on the CPU
#
# The pipeline's timestep is a torchax tensor; the scheduler's tables are not:

# %%
from diffusers import CogVideoXDDIMScheduler

scheduler = CogVideoXDDIMScheduler()
scheduler.set_timesteps(4)
noise_pred = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(2))
sample_cpu = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(3))
step_cpu = scheduler.step(noise_pred, scheduler.timesteps[0], sample_cpu).prev_sample
print("alphas_cumprod:", kind(scheduler.alphas_cumprod), scheduler.alphas_cumprod.dtype)

# %% tags=["raises-exception"]
with env:
    t = scheduler.timesteps[0].to("jax")  # the pipeline's timestep lives on the device
    scheduler.step(noise_pred.to("jax"), t, sample_cpu.to("jax"))

# %% [markdown]
# **Cause.** `alphas_cumprod[t]` indexes a plain CPU tensor with a torchax tensor. torchax's
# indexing implementation expects every tensor involved to be its own and looks for the
# environment attribute (`_env`) that only torchax tensors carry. It is Pitfall 2 again, wearing
# a different message. **Fix.** Move the scheduler's tensors inside the environment: walk its
# attributes and move every tensor found there, the few lines of `move_tensor_attributes`
# below (`tu.move_tensors(scheduler)` in the package). We move this scheduler with the page's
# function and a second, identical one with the package's, and compare. (The float64 tables
# arrive as float32: JAX runs without 64-bit types unless `jax_enable_x64` is on, which is also
# what the "Explicitly requested dtype" warnings we filter are about.)

# %%
def move_tensor_attributes(obj):
    for name, value in list(vars(obj).items()):  # every attribute: a scheduler has no parameters or buffers
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to("jax"))
    return obj


twin = CogVideoXDDIMScheduler()
twin.set_timesteps(4)
with env:
    move_tensor_attributes(scheduler)
    tu.move_tensors(twin)
    step_jax = scheduler.step(noise_pred.to("jax"), t, sample_cpu.to("jax")).prev_sample
    step_twin = twin.step(noise_pred.to("jax"), t, sample_cpu.to("jax")).prev_sample
moved = sorted(n for n, val in vars(scheduler).items() if isinstance(val, torchax.tensor.Tensor))
moved_twin = sorted(n for n, val in vars(twin).items() if isinstance(val, torchax.tensor.Tensor))
print("moved:", moved)

# %% tags=["check"]
# the moved scheduler steps as the CPU one does
assert "alphas_cumprod" in moved
torch.testing.assert_close(step_jax.torch(), step_cpu, rtol=0, atol=1e-5)
# the page's function moves what tu.move_tensors moves, to the same values and the same step
assert moved == moved_twin
for name in moved:
    np.testing.assert_array_equal(getattr(scheduler, name).torch().numpy(), getattr(twin, name).torch().numpy())
np.testing.assert_array_equal(step_jax.torch().numpy(), step_twin.torch().numpy())

# %% [markdown]
# ### Exercise 2: a lookup table outside any module
#
# Schedulers are not the only objects that keep tensors outside a module. `GainTable` below holds
# a table of ten gains and multiplies its input by the gain at index `i`. Under `with env:`, call
# `apply` on a torchax tensor twice: once with the Python int `3`, once with the index as a
# torchax tensor, as a pipeline's timestep would be. **Predict** which of the two calls fails,
# and with which message. Then apply pitfall 9's fix and check the eager and the jitted results
# against plain PyTorch.

# %% tags=["solution"]
class GainTable:
    def __init__(self):
        self.gains = torch.linspace(1.0, 2.0, 10)  # a plain attribute, not a buffer

    def apply(self, x, i):
        return x * self.gains[i]


table, x_ones = GainTable(), torch.ones(3)
with env:
    by_int = table.apply(x_ones.to("jax"), 3)  # a CPU 0-d tensor from a Python index: used as a scalar
    index_error = expect(lambda: table.apply(x_ones.to("jax"), torch.tensor(3).to("jax")), AttributeError)
    tu.move_tensors(table)
    i_j = torch.tensor(3).to("jax")
    by_tensor = table.apply(x_ones.to("jax"), i_j)
    by_tensor_jit = jax_jit(table.apply)(x_ones.to("jax"), i_j)
expected_gain = x_ones * torch.linspace(1.0, 2.0, 10)[3]
print(f"gain 3: Python int index {float(by_int.torch()[0]):.4f} | after move_tensors, eager "
      f"{float(by_tensor.torch()[0]):.4f}, jitted {float(by_tensor_jit.torch()[0]):.4f}")

# %% tags=["check"]
assert "_env" in str(index_error)
for got in (by_int, by_tensor, by_tensor_jit):
    torch.testing.assert_close(got.torch(), expected_gain, rtol=0, atol=1e-6)

# %% [markdown]
# ## 7. A whole diffusers pipeline, every component compiled
#
# A diffusers pipeline is not an `nn.Module`, so there is nothing to compile as a whole. Instead
# we compile each component the pipeline calls, in place: the text encoder and the transformer
# (`forward`), and the VAE (`decode`); and we move the scheduler's state. `JitModule` passes the
# pipeline's `isinstance` checks and forwards attribute access (`vae.config`, `transformer.dtype`)
# to the wrapped module, so the pipeline code runs unchanged.
#
# The pipeline is CogVideoX with tiny random components (the same configs as diffusers' own fast
# tests) and a byte-level T5 tokenizer that needs no files. Passing the same `latents` to both
# runs makes them start from the same noise.

# %%
from diffusers import CogVideoXPipeline, CogVideoXTransformer3DModel


def tiny_cogvideox_pipeline():
    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
        text_embed_dim=32, num_layers=2, sample_width=4, sample_height=4, sample_frames=9,
        patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16,
    ).eval()
    text_encoder = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    ).eval()
    pipe = CogVideoXPipeline(
        tokenizer=transformers.ByT5Tokenizer(), text_encoder=text_encoder, vae=tiny_cogvideox_vae(),
        transformer=transformer, scheduler=CogVideoXDDIMScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


pipe = tiny_cogvideox_pipeline()
call = dict(prompt="a red panda surfing", height=32, width=32, num_frames=9, num_inference_steps=4,
            guidance_scale=6.0, max_sequence_length=16, output_type="np")
latents = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(4))
frames_cpu = pipe(**call, latents=latents.clone()).frames
print("torch CPU frames:", frames_cpu.shape, frames_cpu.dtype)

# %% [markdown]
# Now the same pipeline object, under torchax. Everything happens inside one `with env:` block.

# %%
with env:
    for name in ("text_encoder", "transformer", "vae"):
        getattr(pipe, name).to("jax")
    tu.move_tensors(pipe.scheduler)
    pipe.text_encoder = tu.JitModule(pipe.text_encoder)
    pipe.transformer = tu.JitModule(pipe.transformer)
    pipe.vae = tu.JitModule(pipe.vae, methods=("decode",))
    frames_jax = pipe(**call, latents=latents.to("jax")).frames
pipe_diff = float(np.abs(np.asarray(frames_jax) - frames_cpu).max())
print("torchax frames:", np.asarray(frames_jax).shape, "| execution device:", pipe._execution_device)
print(f"max abs diff < 1e-4: {pipe_diff < 1e-4}")
print("compiled programs:", {n: getattr(pipe, n).compiled_variants for n in ("text_encoder", "transformer", "vae")})

# %%
# NBVAL_IGNORE_OUTPUT
print(f"measured here: max abs diff {pipe_diff:.1e}")

# %% tags=["check"]
assert pipe_diff < 1e-4
assert all(getattr(pipe, n).compiled_variants >= 1 for n in ("text_encoder", "transformer", "vae"))

# %% [markdown]
# Every step of the 4-step loop reused one transformer program: the classifier-free-guidance
# batch, the shapes and the static keywords are the same at each step. On a TPU the same recipe
# is what makes the pipeline fast; notebook `cogvideox_pipeline` shards its stages across eight
# chips with the tables of notebook `sharding`.
#
# ## 8. Three routes onto a TPU, two of them run here
#
# torchax is one of three public ways to run PyTorch code on a TPU, and they differ in one
# respect that decides the rest: **who builds the XLA program, and when**
# ([PyTorch on TPU](../kb/torch-on-tpu.md) has each in depth, with sources).
#
# * **torch_xla** records the operators on its `xla` device without running them and compiles
#   the recorded graph at a barrier (`torch_xla.sync()`), or under
#   `torch.compile(backend="openxla")`.
# * **TorchTPU**, Google's newer native backend, gives PyTorch a `tpu` device that runs eagerly,
#   with `torch.compile` for whole programs; diffusers has an open pull request (#14039) that
#   would let a pipeline's components go `.to("tpu")`.
# * **torchax**, this course's route, turns each torch operator into a JAX call: one call at a
#   time eagerly, or one program under `jax.jit`, in the same program as JAX's sharding, Pallas
#   kernels and Flax modules, and compilable ahead of time for a slice this host does not have
#   (notebook `start_here`).
#
# torch_xla needs its own build of torch (upstream's comparison ran torch_xla 2.9.0 with torch
# 2.9.0; this course pins torch 2.13) and TorchTPU needs a TPU, so on this CPU host two routes
# run: eager PyTorch, which is what a GPU engineer starts from, and torchax, eagerly and under
# `jax.jit`. One fresh tiny GPT-2, one forward each. JAX reports every program it compiles to
# `jax.monitoring`, so we can count what each route builds.

# %%
import collections

compile_events = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, seconds, **_: compile_events.update([event]))
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # one event per XLA program compiled

torch.manual_seed(1)
model = transformers.GPT2LMHeadModel(  # shapes unlike section 4's, so no program is cached yet
    transformers.GPT2Config(vocab_size=320, n_embd=48, n_layer=2, n_head=4, n_positions=64)
).eval()
prompt = torch.randint(0, 320, (1, 6))
with torch.no_grad():
    route_logits = {"eager PyTorch (CPU)": model(prompt, use_cache=False).logits}
route_programs = {"eager PyTorch (CPU)": (0, 0)}
with env:
    model.to("jax")
    prompt_j = prompt.to("jax")
    jitted = tu.JitModule(model)
    for route, forward in (("torchax, eager", lambda: model(prompt_j, use_cache=False).logits),
                           ("torchax, jax.jit", lambda: jitted(prompt_j, use_cache=False).logits)):
        counts = []
        for _ in range(2):  # the first call and a second one
            before = compile_events[BACKEND_COMPILE]
            logits = forward()
            jax.block_until_ready(logits.jax())
            counts.append(compile_events[BACKEND_COMPILE] - before)
        route_logits[route], route_programs[route] = logits.torch(), tuple(counts)
reference_logits = route_logits["eager PyTorch (CPU)"]
print(f"{'route':>20} {'programs compiled, 1st call':>28} {'2nd call':>9} {'max |diff| from PyTorch':>24}")
for route, logits in route_logits.items():
    first, second = route_programs[route]
    error = float((logits - reference_logits).abs().max())  # float32 noise: shown as its bound
    print(f"{route:>20} {first:>28} {second:>9} {'< 1e-06' if error < 1e-6 else f'{error:.1e}':>24}")

# %% [markdown]
# Eager torchax compiles one small program per distinct operator and shape, caches each, and
# dispatches them one by one from Python on every call (pitfall 8's slowdown); under `jax.jit`
# the whole forward is one program. torch_xla's lazy mode and TorchTPU's `torch.compile` also end
# in one program per graph; where they differ from torchax is in what you write. The same
# forward, route by route (torch_xla and TorchTPU from their documentation, not run here):
#
# | route | put the model on the chips | run a step | one compiled program | shard it | ran here |
# |---|---|---|---|---|---|
# | eager PyTorch | `.to("cuda")` | `model(x)` | `torch.compile(model)` | `torch.distributed` | yes, on the CPU |
# | torchax | `.to("jax")` inside `with env:` | `model(x)` | `tu.JitModule(model)` (a `jax.jit` over the weights) | `NamedSharding` tables (notebook `sharding`) | yes |
# | torch_xla | `.to(torch_xla.device())` | `model(x)`, then `torch_xla.sync()` | the lazy graph per step, or `torch.compile(backend="openxla")` | `xs.mark_sharding` | no: its own torch build |
# | TorchTPU | `.to("tpu")` | `model(x)` | `torch.compile` | `torch.distributed` | no: needs a TPU |
#
# Which route when: torch_xla for code that already runs on it; TorchTPU if a native `tpu`
# device is what you want and its maturity suits you (announced in 2026; the knowledge-base page
# says what could and could not be checked); torchax when the program should meet JAX, as every
# video pipeline of this course does: Splash attention as a Pallas kernel (notebook `splash_attention`), a Flax
# VAE in the same program (notebook `cogvideox_vae_flax`), shardings as data, and compiles for a TPU slice from a
# CPU host.

# %% tags=["check"]
for route in ("torchax, eager", "torchax, jax.jit"):
    torch.testing.assert_close(route_logits[route], reference_logits, rtol=0, atol=1e-5)
assert route_programs["torchax, jax.jit"] == (1, 0)  # one program, compiled once
assert route_programs["torchax, eager"][0] > 10 and route_programs["torchax, eager"][1] == 0  # many, cached

# %% [markdown]
# ### Exercise 3: which calls compile a new program
#
# The jitted route compiled one program for the `(1, 6)` prompt and nothing on the second call.
# Call `jitted` three more times: with a batch of two prompts of length 6 (the prompt and its
# reverse), with one prompt of length 9, and with the original prompt again. **Predict** how many
# programs each call compiles, counting with the same `compile_events` listener. Check that the
# batch's first row reproduces the PyTorch logits of the original prompt.

# %% tags=["solution"]
batch_of_two = torch.cat([prompt, prompt.flip(1)])
longer = torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(6))
new_programs = {}
with env:
    batch_of_two, longer = batch_of_two.to("jax"), longer.to("jax")
    for name, tokens in (("batch (2, 6)", batch_of_two), ("length (1, 9)", longer), ("again (1, 6)", prompt_j)):
        before = compile_events[BACKEND_COMPILE]
        out = jitted(tokens, use_cache=False).logits
        jax.block_until_ready(out.jax())
        new_programs[name] = compile_events[BACKEND_COMPILE] - before
        if name.startswith("batch"):
            batch_logits = out.torch()
print("programs compiled per call:", new_programs)
# A new shape is a new program; a shape already seen reuses its program. The values never matter.

# %% tags=["check"]
assert new_programs == {"batch (2, 6)": 1, "length (1, 9)": 1, "again (1, 6)": 0}
torch.testing.assert_close(batch_logits[:1], reference_logits, rtol=0, atol=1e-5)

# %% [markdown]
# ## Summary: nine pitfalls
#
# | pitfall | symptom | fix |
# |---|---|---|
# | [1](#pitfall-1-math-outside-the-environment) | `AssertionError: torchax Tensors can only do math within the torchax environment` | `with env:` |
# | [2](#pitfall-2-mixed-torch-and-torchax-math) | `AssertionError: Expect a Tensor or a View but got <class 'torch.Tensor'>` | `.to("jax")` the stray tensor |
# | [3](#pitfall-3-nan-from-fully-masked-attention-rows) | NaN rows from SDPA | zero the rows that attend to nothing, as an SDPA override: `tu.install_masked_row_safe_sdpa(env)` |
# | [4](#pitfall-4-not-a-valid-jax-type) | `... which is not a valid JAX type` | register the class as a pytree by field name: `tu.register_output_pytree` |
# | [5](#pitfall-5-a-cache-in-the-outputs) | `DynamicCache ... not a valid JAX type` | `use_cache=False`, static |
# | [6](#pitfall-6-concretizationtypeerror-from-a-python-flag) | `ConcretizationTypeError ... kwargs['use_cache']` | close over the non-tensor keywords, one program per set: `tu.JitModule` |
# | [7](#pitfall-7-data-dependent-shapes) | `NonConcreteBooleanIndexError` | fixed shapes: `torch.where` |
# | [8](#pitfall-8-the-eager-dispatch-slowdown) | correct but slow | compile the whole forward |
# | [9](#pitfall-9-scheduler-tensors-left-on-the-cpu) | `'Tensor' object has no attribute '_env'` | move every tensor attribute: `tu.move_tensors(scheduler)` |
#
# The [torchax pitfalls](../kb/torchax-pitfalls.md) page keeps the same list with the full error
# texts, for searching.


# %% [markdown]
# ## Takeaways
#
# - A torchax tensor is a torch tensor whose operators run as JAX calls, and only inside the
#   environment; mixing it with plain torch tensors is the first error everyone meets (section 1).
# - `jax_view`, `torch_view` and `call_jax` cross between the two worlds without copies, and an
#   operator's definition can be replaced: that is how a TPU kernel becomes torch's attention
#   (sections 2 and 3).
# - A whole forward compiles once its outputs are pytrees, its flags static and its shapes fixed
#   (notebook `hf_model_in_jax` met the first two); a shape that depends on the data is rewritten
#   with fixed shapes, `torch.where` instead of a boolean mask (section 4).
# - Methods other than `forward` and state outside modules (a scheduler's tensors) need the same
#   treatment; then a whole diffusers pipeline compiles component by component (sections 5 to 7).
# - torchax builds one JAX program that shares a mesh, Pallas kernels and Flax modules, and
#   compiles ahead of time for a slice this host lacks: why this course takes it over torch_xla
#   and TorchTPU (section 8).

# %% [markdown]
# ## Self-check
#
# 1. Why does torchax refuse to add a plain CPU tensor to a torchax tensor instead of copying it
#    to the device for you?
#
#    <details><summary>Answer</summary>
#
#    A silent copy would hide a host-to-device transfer inside every step that touches the stray
#    tensor, a slowdown nobody asked for. Failing makes you move it once, explicitly, with
#    `.to("jax")` (or `tu.move_tensors` for an object that is not a module).
#
#    </details>
#
# 2. A transformer masks its padded queries, and under torchax its whole output turns to NaN.
#    Why does one fully masked row spread, and what does the override change?
#
#    <details><summary>Answer</summary>
#
#    A row whose scores are all `-inf` gives `0/0` in the softmax, and the next layer multiplies
#    that NaN by weights, where `0 * NaN` is still NaN. `tu.install_masked_row_safe_sdpa` zeroes
#    the rows that can attend to nothing, as PyTorch does, and changes no other row.
#
#    </details>
#
# 3. `t[t > 0].sum()` runs eagerly under torchax but not under `jax.jit`. Why, and why does the
#    `torch.where` rewrite compile?
#
#    <details><summary>Answer</summary>
#
#    Eager dispatch runs each operator on concrete values, so the selection's length is known.
#    Under `jax.jit` the mask is a tracer and the selected array would have a length that depends
#    on data; `torch.where` keeps every element and zeroes the rest, so every shape is fixed.
#
#    </details>
#
# 4. A pipeline wraps its VAE in `JittableModule` and calls `vae.decode(latents)`. The result is
#    right. What is wrong, and how do you fix it?
#
#    <details><summary>Answer</summary>
#
#    `JittableModule` compiles only `forward`; `decode` falls through to the wrapped module and
#    runs eagerly, one dispatch per operator, correct but slow. `tu.JitModule(vae,
#    methods=("decode",))` compiles `decode` too (or torchax's `methods_to_compile`).
#
#    </details>
#
# 5. Why does this course take torchax rather than torch_xla or TorchTPU for its video
#    pipelines?
#
#    <details><summary>Answer</summary>
#
#    torchax turns torch operators into JAX calls, so the model lands in the same JAX program as
#    `NamedSharding` tables, Pallas kernels and Flax modules, and that program can be compiled
#    ahead of time for a TPU slice from a CPU host. The other two build their programs on their
#    own terms, outside JAX.
#
#    </details>
