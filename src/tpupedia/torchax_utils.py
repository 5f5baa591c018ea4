"""Small, verified torchax idioms: outputs as pytrees, jit with static options, moving state.

Each helper exists because of a real failure met when running Hugging Face and diffusers models
under torchax 0.0.13:

* HF `ModelOutput` and diffusers `BaseOutput` classes are torch pytrees but not JAX
  pytrees, so a jitted forward fails with "... is not a valid JAX type".
  `register_output_pytree` registers a class *by field name*. Flattening by position
  (`to_tuple()`) is lossy: `to_tuple()` drops `None` fields, and rebuilding positionally
  shifts the remaining values into the wrong fields (logits landing in `loss`).
* Python `bool`/`None`/`str` keyword arguments (`return_dict=False`, `use_cache=False`)
  become tracers under `jax.jit`, and the model's `if use_cache:` raises
  `ConcretizationTypeError`. `JitModule` treats every non-tensor keyword as static
  (one compiled program per distinct value).
* diffusers schedulers keep tensors (`alphas_cumprod`, `sigmas`) that are indexed with
  device timesteps; `move_tensors` moves such non-module state.
* torchax's SDPA returns NaN for query rows whose mask is all False, where PyTorch returns 0;
  `install_masked_row_safe_sdpa` matches PyTorch.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX); notebook `torchax_internals` (torchax internals) shows
every failure live.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax.tree_util as jtu
import torch

from tpupedia.compat import import_torchax

__all__ = [
    "default_env",
    "register_output_pytree",
    "register_common_outputs",
    "JitModule",
    "FunctionalModule",
    "move_tensors",
    "masked_row_safe_sdpa",
    "install_masked_row_safe_sdpa",
    "SDPA_OPS",
    "restoring_ops",
    "stock_ops",
]

_REGISTERED: set[type] = set()

# The two entry points a torchax environment dispatches scaled-dot-product attention through.
SDPA_OPS = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention)


def default_env():
    """The torchax environment (imports torchax through the compatibility shim)."""
    return import_torchax().default_env()


def register_output_pytree(cls: type) -> type:
    """Register an HF/diffusers output class as a JAX pytree, flattened by field name.

    Only the fields that are set are children; their names travel as static aux data, so
    unflattening rebuilds `cls(**{name: value})` and unset fields stay `None`.
    Registering the same class twice is a no-op. Returns `cls`.
    """
    if cls in _REGISTERED:
        return cls

    def flatten(out):
        keys = tuple(out.keys())
        return tuple(out[k] for k in keys), keys

    def unflatten(keys, values):
        return cls(**dict(zip(keys, values)))

    try:
        jtu.register_pytree_node(cls, flatten, unflatten)
    except ValueError:  # registered elsewhere already (e.g. by another library)
        pass
    _REGISTERED.add(cls)
    return cls


def register_common_outputs() -> list[type]:
    """Register the output classes the course's models return. Returns them."""
    from transformers import modeling_outputs as mo

    classes = [
        mo.BaseModelOutput,
        mo.BaseModelOutputWithPast,
        mo.BaseModelOutputWithPastAndCrossAttentions,
        mo.BaseModelOutputWithPooling,
        mo.CausalLMOutputWithPast,
        mo.CausalLMOutputWithCrossAttentions,
    ]
    try:
        from diffusers.models.autoencoders.vae import DecoderOutput
        from diffusers.models.modeling_outputs import AutoencoderKLOutput, Transformer2DModelOutput

        classes += [DecoderOutput, AutoencoderKLOutput, Transformer2DModelOutput]
    except ImportError:  # pragma: no cover - diffusers is optional for LLM-only use
        pass
    return [register_output_pytree(c) for c in classes]


def _has_tensor(value: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in torch.utils._pytree.tree_leaves(value))


class JitModule(torch.nn.Module):
    """A jitted view of `module` whose non-tensor keyword arguments are static.

    `JitModule(model)(ids, return_dict=False)` compiles once per distinct set of static
    keyword values and input shapes, and reuses the compiled program afterwards. Extra methods
    (a VAE's `decode`) are jitted the same way when listed in `methods`. Attribute access and
    `isinstance` checks fall through to the wrapped module, so pipelines accept it in place.
    """

    def __init__(self, module: torch.nn.Module, methods: tuple[str, ...] = ("forward",)):
        super().__init__()
        import_torchax()  # the compatibility shim first, then torchax's modules
        from torchax.interop import JittableModule

        self.__dict__["_jm"] = JittableModule(module)
        self.__dict__["_compiled"] = {}
        for name in methods:
            if name != "forward":
                self.__dict__[name] = lambda *a, _m=name, **kw: self._call(_m, *a, **kw)

    @property
    def compiled_variants(self) -> int:
        """How many distinct programs have been traced so far (one per static-kwarg set)."""
        return len(self.__dict__["_compiled"])

    def _call(self, method: str, *args, **kwargs):
        from torchax.interop import jax_jit

        static = {k: v for k, v in kwargs.items() if not _has_tensor(v)}
        dynamic = {k: v for k, v in kwargs.items() if k not in static}
        key = (method, repr(sorted(static.items())), tuple(sorted(dynamic)))
        compiled = self.__dict__["_compiled"]
        if key not in compiled:
            jm = self.__dict__["_jm"]

            def call(params, buffers, *a, **kw):
                return jm.functional_call(method, params, buffers, *a, **kw, **static)

            compiled[key] = jax_jit(call)
        jm = self.__dict__["_jm"]
        return compiled[key](jm.params, jm.buffers, *args, **dynamic)

    def forward(self, *args, **kwargs):
        return self._call("forward", *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_jm"]._model, name)

    @property
    def __class__(self):
        return self.__dict__["_jm"]._model.__class__


class FunctionalModule:
    """A torch module as a pure JAX function `fn(params, buffers, *args, **kwargs)`.

    This is what torchax's jit wraps internally, exposed so that you can call
    `jax.jit(f).lower(...)` yourself: read the compiled HLO (`hlo`), or compile ahead of time
    against abstract, sharded arguments (`abstract_state`). `method` is the method name to call
    or a function `f(module, *args, **kwargs)` traced in its place (a jit-friendly forward such as
    `tpupedia.models.hunyuan.static_forward`). Static keyword arguments (`return_dict=False`)
    are baked in. Arguments and results are JAX arrays (pytrees of them).

    Introduced in notebook `sharding` (distributed sharding); `tpupedia.dryrun` compiles through it.
    """

    def __init__(self, module: torch.nn.Module, method: Any = "forward", **static_kwargs: Any):
        import_torchax()  # the compatibility shim first, then torchax's modules
        from torchax.interop import JittableModule

        self.module = module
        self._jm = JittableModule(module)
        self._method = method
        self._static = static_kwargs

    def __call__(self, params: dict, buffers: dict, *args: Any, **kwargs: Any) -> Any:
        from torchax.interop import jax_view, torch_view

        env = default_env()
        with env:
            out = self._jm.functional_call(self._method, torch_view(params), torch_view(buffers), *torch_view(args),
                                           **torch_view(kwargs), **self._static)
        return jax_view(out)

    def state(self) -> tuple[dict, dict]:
        """The module's current `(params, buffers)` as dicts of (sharded) `jax.Array`s."""
        from torchax.interop import jax_view

        return jax_view(dict(self._jm.params)), jax_view(dict(self._jm.buffers))

    def abstract_state(self, the_plan: Any = None, mesh: Any = None) -> tuple[dict, dict]:
        """`(params, buffers)` as `jax.ShapeDtypeStruct`s with the shardings of `the_plan` (a
        `tpupedia.sharding.ShardingPlan`), no data. Works for a module built on `meta`. Names the
        plan does not know (all of them without a plan) are replicated over `mesh` (default: the
        plan's mesh)."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from torchax.ops.mappings import t2j_dtype

        mesh = mesh if mesh is not None else (the_plan.mesh if the_plan else None)
        specs = the_plan.specs() if the_plan else {}

        def one(name, t):
            sharding = NamedSharding(mesh, specs.get(name) or P()) if mesh is not None else None
            return jax.ShapeDtypeStruct(tuple(t.shape), t2j_dtype(t.dtype), sharding=sharding)

        return (
            {n: one(n, t) for n, t in self._jm.params.items()},
            {n: one(n, t) for n, t in self._jm.buffers.items()},
        )

    def lower(self, *args: Any, state: tuple[dict, dict] | None = None, **jit_kwargs: Any):
        """`jax.jit(self, **jit_kwargs).lower(params, buffers, *args)` (default: current state)."""
        import jax

        params, buffers = state if state is not None else self.state()
        return jax.jit(self, **jit_kwargs).lower(params, buffers, *args)

    def hlo(self, *args: Any, **jit_kwargs: Any) -> str:
        """The compiled (post-partitioning) HLO text for `args`: where the collectives are."""
        return self.lower(*args, **jit_kwargs).compile().as_text()


def move_tensors(obj: Any, device: str = "jax") -> Any:
    """Move every tensor attribute of a non-module object (a scheduler) to `device`.

    Run inside `with env:` when moving to `"jax"`. Returns `obj`.
    """
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device))
    return obj


def masked_row_safe_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False):
    """torchax's reference SDPA, with rows whose boolean mask is all False set to 0 (as PyTorch)."""
    from torchax.ops.jtorch import _sdpa_reference

    out = _sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        out = torch.where(attn_mask.any(-1, keepdim=True), out, torch.zeros_like(out))
    return out


def install_masked_row_safe_sdpa(env) -> None:
    """Override `F.scaled_dot_product_attention` in `env` with `masked_row_safe_sdpa`."""
    for op in SDPA_OPS:
        env.override_op_definition(op, masked_row_safe_sdpa)



@contextlib.contextmanager
def restoring_ops(env, ops=SDPA_OPS):
    """Undo, on exit, any `env.override_op_definition` made for `ops` inside the block.

    torchax environments are shared (`default_env()` is one per process) and have no way to
    remove an override, so code that installs one temporarily (a dry-run with splash attention)
    snapshots the op table entries and puts them back. Uses torchax 0.0.13's `env._ops`.
    """
    saved = {op: env._ops.get(op) for op in ops}
    try:
        yield env
    finally:
        for op, definition in saved.items():
            if definition is None:
                env._ops.pop(op, None)
            else:
                env._ops[op] = definition


def stock_ops(env, ops=SDPA_OPS) -> None:
    """Put torchax's own definitions of `ops` back into `env` (undoing any override).

    Use inside `restoring_ops` to run a block with the stock implementation, whatever an
    earlier cell or test installed. Uses torchax 0.0.13's op registry.
    """
    from torchax.ops import ops_registry

    for op in ops:
        stock = ops_registry.all_aten_ops.get(op) or ops_registry.all_torch_functions.get(op)
        if stock is None:
            env._ops.pop(op, None)
        else:
            env._ops[op] = stock
