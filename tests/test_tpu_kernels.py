"""Every Pallas kernel the notebooks run, compiled for a TPU (v6e:2x4) ahead of time on this host.

On CPU the notebooks run their kernels in Pallas interpret mode, which never meets Mosaic, the
TPU kernel compiler: a block shape or an operation Mosaic cannot lower would only fail on a TPU
VM. Here each kernel is lowered with ``interpret=False`` and compiled by libtpu for the devices
of a ``v6e:2x4`` slice (the technique of notebook `start_here`), at the shapes the notebooks use, so such
an error fails ``make test`` instead. Nothing runs: the compiled programs are only inspected.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot, attention, devices

pytestmark = pytest.mark.skipif(
    not devices.has_libtpu(),
    reason="libtpu not installed (pip install 'jax[tpu]'): TPU kernels cannot be compiled ahead of time",
)

SPLASH_LESSON = Path(__file__).resolve().parents[1] / "lessons" / "05_splash_attention.py"


@pytest.fixture(scope="module")
def mesh():
    return devices.topology_mesh("v6e:2x4", (2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def one_chip(mesh):
    return Mesh([mesh.devices.flat[0]], ("x",))


def _abstract(shape, dtype, mesh, spec=P()):
    return aot.abstract(shape, dtype, NamedSharding(mesh, spec))


def _compile_for_tpu(fn, *args, precision="highest"):
    """Compile for the TPU; the program must fit and contain the Mosaic kernel (not a fallback).

    Float32 kernels compile at ``"highest"`` matmul precision, the way notebook `splash_attention` runs them (its
    parity checks request it for the whole notebook); bf16 ones at the default, as section 7 does.
    """
    with jax.default_matmul_precision(precision):
        result = aot.compile_aot(fn, *args)
    assert result.fits, result.summary()
    assert "tpu_custom_call" in result.compiled.as_text(), "no Mosaic kernel in the compiled program"
    return result


def _splash_lesson_functions(*names):
    """Functions exactly as notebook `splash_attention` defines them (their source read from the lesson file)."""
    tree = ast.parse(SPLASH_LESSON.read_text())
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(d.name for d in defs) == sorted(names), f"notebook `splash_attention` no longer defines {names}"
    from jax.experimental import pallas as pl

    namespace = {"functools": functools, "jax": jax, "jnp": jnp, "pl": pl, "interpret": False}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(SPLASH_LESSON), "exec"), namespace)
    return namespace


def _splash_lesson_toy_flash():
    return _splash_lesson_functions("flash_kernel", "toy_flash")["toy_flash"]


def test_splash_lesson_primer_kernel_compiles_for_tpu(one_chip):
    from jax.experimental import pallas as pl

    which_program = _splash_lesson_functions("which_program")["which_program"]
    spec = pl.BlockSpec((128, 64), lambda i: (i, 0))
    call = pl.pallas_call(which_program, grid=(4,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct((512, 64), jnp.float32), interpret=False)
    _compile_for_tpu(call, _abstract((512, 64), jnp.float32, one_chip))


@pytest.mark.parametrize("exp", [jnp.exp, jnp.exp2], ids=["exp", "exp2"])
def test_splash_lesson_toy_flash_kernel_compiles_for_tpu(one_chip, exp):
    toy_flash = _splash_lesson_toy_flash()
    x = _abstract((256, 64), jnp.float32, one_chip)  # notebook `splash_attention`: S=256, D=64, float32, 128-blocks
    _compile_for_tpu(lambda q, k, v: toy_flash(q, k, v, exp=exp), x, x, x)


def test_a_block_mosaic_cannot_tile_is_caught_here(one_chip):
    """The point of this file: a shape interpret mode accepts and Mosaic refuses fails on CPU."""
    toy_flash = _splash_lesson_toy_flash()
    x = _abstract((200, 64), jnp.float32, one_chip)
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        aot.compile_aot(lambda q, k, v: toy_flash(q, k, v, block_q=100, block_kv=100), x, x, x)


@pytest.mark.parametrize(
    "mask, seq, block", [("causal", 256, 128), ("full", 512, 256)], ids=["sec3-causal", "sec4-zero-padded"]
)
def test_splash_lesson_raw_splash_kernels_compile_for_tpu(one_chip, mask, seq, block):
    base = sa.CausalMask if mask == "causal" else sa.FullMask
    kernel = sa.make_splash_mha(sa.MultiHeadMask([base((seq, seq))] * 2), head_shards=1, q_seq_shards=1,
                                block_sizes=sa.BlockSizes(block, block, block), interpret=False)
    x = _abstract((1, 2, seq, 64), jnp.float32, one_chip)
    _compile_for_tpu(jax.vmap(kernel), x, x, x)


# (name, batch, q heads, kv heads, q len, kv len, head_dim, dtype, causal, mask, sharded, layout, blocks)
SPLASH_CONFIGS = [
    # notebook `splash_attention`, section 4: exact padding through segment ids, 512 padded tokens in 256-blocks
    ("04-segment-ids", 1, 2, 2, 512, 512, 64, jnp.float32, False, "valid", False, "heads", (256, 256)),
    # notebook `splash_attention`, section 8: head-parallel causal self-attention and sequence-parallel cross-attention
    ("04-heads-causal-d32", 2, 4, 4, 200, 200, 32, jnp.float32, True, None, True, "heads", None),
    ("04-sequence-cross-d32", 2, 4, 4, 200, 40, 32, jnp.float32, False, None, True, "sequence", None),
    # notebook `splash_attention`, section 8 / notebook `torchax_internals`: tiny Llama through the SDPA override (GQA, padding mask)
    ("tiny-llama-d16", 2, 4, 2, 16, 16, 16, jnp.float32, False, "bool", True, "heads", None),
    # tiny CogVideoX transformers (notebook `splash_attention`: head_dim 8; the tiny preset: 16), joint attention
    ("tiny-cogvideox-d8", 2, 4, 4, 28, 28, 8, jnp.float32, False, None, True, "heads", None),
    ("tiny-cogvideox-d16", 2, 4, 4, 40, 40, 16, jnp.float32, False, None, True, "heads", None),
    # tiny HunyuanVideo-1.5 (2 heads of 8, fewer than the tp axis: falls back to the sequence layout)
    ("tiny-hunyuan-d8", 1, 2, 2, 48, 48, 8, jnp.float32, False, "bool", True, "heads", None),
    # full-size head dims in bf16 (CogVideoX 64, HunyuanVideo-1.5 128) at a short length
    ("bf16-d64", 2, 48, 48, 1000, 1000, 64, jnp.bfloat16, False, None, True, "heads", None),
    ("bf16-d128-mask", 2, 16, 16, 1000, 1000, 128, jnp.bfloat16, False, "bool", True, "heads", None),
]


@pytest.mark.filterwarnings("ignore::tpupedia.attention.AttentionLayoutWarning")
@pytest.mark.parametrize("config", SPLASH_CONFIGS, ids=[c[0] for c in SPLASH_CONFIGS])
def test_splash_configurations_the_notebooks_run_compile_for_tpu(mesh, one_chip, config):
    """float32 configurations compile at the highest precision the parity checks request and at
    the default the pipelines' speed paths keep; bf16 ones at the default."""
    dtype = config[7]
    for precision in ("highest", "default") if dtype == jnp.float32 else ("default",):
        _compile_splash_config(mesh, one_chip, config, precision)


def test_bf16_splash_refuses_highest_precision(mesh):
    """Why notebook `splash_attention` compiles its bf16 kernels at the default precision: asked for "highest",
    Mosaic lowers the bf16 q.k contraction with fp32 contract precision and cannot compile it
    (libtpu 0.0.42.1). If a libtpu update lifts this, notebook `splash_attention`'s section 7 note must change."""
    x = _abstract((2, 8, 1024, 64), jnp.bfloat16, mesh, P("dp", "tp"))
    fn = functools.partial(attention.splash_attention, block_sizes=(512, 512, 512), interpret=False, mesh=mesh)
    with jax.default_matmul_precision("highest"), pytest.raises(Exception, match="Bad lhs type"):
        aot.compile_aot(fn, x, x, x)
    _compile_for_tpu(fn, x, x, x, precision="default")


def _compile_splash_config(mesh, one_chip, config, precision):
    _, b, h, hkv, sq, skv, d, dtype, causal, mask, sharded, layout, blocks = config
    m = mesh if sharded else one_chip
    q = _abstract((b, h, sq, d), dtype, m)
    kv = _abstract((b, hkv, skv, d), dtype, m)
    common = dict(interpret=False, block_sizes=blocks)
    if sharded:
        common.update(mesh=mesh, layout=layout)
    if mask == "bool":  # what Hugging Face passes; checked at run time, so every splash branch compiles
        mask_arg = _abstract((b, 1, sq, skv), jnp.bool_, m)
        fn = lambda q, k, v, msk: attention.attention(q, k, v, msk, backend="splash", **common)  # noqa: E731
        _compile_for_tpu(fn, q, kv, kv, mask_arg, precision=precision)
    elif mask == "valid":
        valid = _abstract((b, sq), jnp.bool_, m)
        fn = lambda q, k, v, qv, kvv: attention.splash_attention(q, k, v, qv, kvv, **common)  # noqa: E731
        _compile_for_tpu(fn, q, kv, kv, valid, valid, precision=precision)
    else:
        fn = lambda q, k, v: attention.splash_attention(q, k, v, is_causal=causal, **common)  # noqa: E731
        _compile_for_tpu(fn, q, kv, kv, precision=precision)
