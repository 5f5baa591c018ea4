"""Splash blocks chosen per chip from its scoped VMEM (`tpupedia.attention.chip_block_sizes`).

The families' blocks come from v6e profiles. The TPU compiler's default scoped-VMEM limit is
32 MiB on a v6e and a TPU7x but 16 MiB on a v5e and a v5p (`hardware.Chip.scoped_vmem_bytes`,
measured with libtpu here), so a v5e run with the v6e blocks fails to compile. The pipeline and
the dry-run step each family's blocks down until the compiler fits them; the flag
`--xla_tpu_scoped_vmem_limit_kib` is the other way out. Every kernel here is compiled for a TPU
ahead of time; nothing runs."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot, attention, devices, families, hardware

pytestmark = pytest.mark.skipif(not devices.has_libtpu(), reason="needs libtpu (pip install 'jax[tpu]')")


def _one(topology: str):
    return devices.tpu_topology(topology)[0]


WAN_480P = (2, 12, 32760)  # Wan 1.3B's guidance pair at 480p on one device: batch, heads, tokens
ONE_HEAD = (1, 1, 8192)


def _splash(device, blocks, options=None, shape=WAN_480P):
    mesh = Mesh([device], ("x",))
    arg = aot.abstract((*shape, attention.PROBE_HEAD_DIM), jnp.bfloat16, NamedSharding(mesh, P()))
    fn = lambda q, k, v: attention.splash_attention(q, k, v, block_sizes=blocks, interpret=False)  # noqa: E731
    if options is None:
        return aot.compile_aot(fn, arg, arg, arg)
    import jax

    return jax.jit(fn).lower(arg, arg, arg).compile(compiler_options=options)


def test_the_ladder_steps_down_from_the_asked_blocks_and_keeps_kv_compute_dividing():
    assert attention.block_candidates((3072, 2048, 1024)) == [
        (3072, 2048, 1024), (2048, 2048, 1024), (2048, 1024, 1024), (1024, 1024, 1024), (1024, 512, 512),
        (512, 512, 512)]
    assert attention.block_candidates((2048, 2048, 512))[:3] == [(2048, 2048, 512), (2048, 1024, 512), (1024, 1024, 512)]
    for q, kv, kvc in attention.block_candidates((3328, 2816, 256)):
        assert kv % kvc == 0 and kvc % attention.LANE == 0 and q <= 3328 and kv <= 2816


def test_the_scoped_vmem_limit_the_compiler_states_is_the_chip_tables():
    """A kernel too large for any chip's scoped VMEM (4096/4096/2048 blocks, one head): each
    compiler's error names its limit, which is the table's."""
    for topology, chip in (("v5e:1x1", "v5e"), ("v6e:1x1", "v6e"), ("tpu7x:1x1x1", "tpu7x"), ("v5p:2x2x1", "v5p")):
        result = _splash(_one(topology), (4096, 4096, 2048), shape=ONE_HEAD)
        assert not result.fits and result.vmem_limit_bytes == hardware.chip(chip).scoped_vmem_bytes, topology


@pytest.mark.parametrize("family", [f.name for f in families.video()])
def test_each_family_runs_its_own_blocks_on_a_v6e_and_smaller_ones_that_compile_on_a_v5e(family):
    blocks = families.get(family).facts.SPLASH_BLOCK_SIZES
    assert attention.chip_block_sizes(_one("v6e:2x4"), blocks) == blocks  # what they were tuned on
    assert attention.chip_block_sizes(_one("tpu7x:2x2x1"), blocks) == blocks
    assert not _splash(_one("v5e:1x1"), blocks).fits  # the v6e blocks do not compile on a v5e
    chosen = attention.chip_block_sizes(_one("v5e:1x1"), blocks)
    assert chosen != blocks and chosen in attention.block_candidates(blocks)
    assert _splash(_one("v5e:1x1"), chosen).fits


def test_raising_the_scoped_vmem_limit_is_the_other_way_out():
    """HunyuanVideo-1.5's v6e blocks need 23.35 MiB for one head on a v5e: with the limit at 32 MiB
    they compile."""
    blocks = families.get("hunyuan").facts.SPLASH_BLOCK_SIZES
    assert not _splash(_one("v5e:1x1"), blocks, shape=ONE_HEAD).fits
    compiled = _splash(_one("v5e:1x1"), blocks, options={"xla_tpu_scoped_vmem_limit_kib": "32768"}, shape=ONE_HEAD)
    assert "tpu_custom_call" in compiled.as_text()
