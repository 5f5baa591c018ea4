import jax
import jax.numpy as jnp
import pytest
from jax._src import config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_devices import requires_libtpu

from tpupedia import aot, devices


def test_format_bytes():
    assert aot.format_bytes(3 * 2**30) == "3.00 GiB"
    assert aot.format_bytes(1536) == "1.50 KiB"
    assert aot.format_bytes(12) == "12 B"


def test_collective_counts_reads_hlo_instructions():
    hlo = """
      %all-reduce.1 = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups={{0,1}}, to_apply=%add
      %ag = bf16[16]{0} all-gather-start(bf16[8]{0} %q), dimensions={0}
      %ag.done = bf16[16]{0} all-gather-done(%ag)
      %rs = f32[4]{0} reduce-scatter(f32[8]{0} %r), dimensions={0}
      %add = f32[] add(f32[] %a, f32[] %b)
    """
    assert aot.collective_counts(hlo) == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1}


def test_collectives_on_simulated_devices_match_the_sharding():
    mesh = devices.make_mesh((2, 4), ("data", "model"))
    x = jnp.ones((16, 32))
    w = jnp.ones((32, 16))
    f = lambda a, b: a @ b  # noqa: E731
    column = aot.compile_aot(
        f,
        jax.device_put(x, NamedSharding(mesh, P("data", None))),
        jax.device_put(w, NamedSharding(mesh, P(None, "model"))),
    )
    row = aot.compile_aot(
        f,
        jax.device_put(x, NamedSharding(mesh, P(None, "model"))),
        jax.device_put(w, NamedSharding(mesh, P("model", None))),
    )
    assert column.fits and column.collectives == {}
    assert row.collectives.get("all-reduce", 0) >= 1


@requires_libtpu
def test_per_chip_argument_bytes_on_v6e_match_the_shardings():
    mesh = devices.topology_mesh("v6e:2x4", (2, 4), ("data", "model"))
    t, d, f = 4096, 1024, 4096
    x = aot.abstract((t, d), jnp.bfloat16, NamedSharding(mesh, P("data", None)))
    w = aot.abstract((d, f), jnp.bfloat16, NamedSharding(mesh, P(None, "model")))
    result = aot.compile_aot(lambda a, b: a @ b, x, w)
    assert result.fits
    assert result.memory.arguments == (t // 2 * d + d * f // 4) * 2
    assert result.memory.outputs == (t // 2) * (f // 4) * 2
    assert "fits" in result.summary()


@requires_libtpu
def test_out_of_memory_is_a_result_with_the_compilers_figures():
    mesh = devices.topology_mesh("v6e:2x4", None, ("x", "y"))
    q = aot.abstract((131_072, 128), jnp.bfloat16, NamedSharding(mesh, P()))
    result = aot.compile_aot(lambda a, b: (a @ b.T).astype(jnp.float32), q, q)
    assert not result.fits and result.memory is None
    assert result.oom_message.startswith("RESOURCE_EXHAUSTED")
    # 131072^2 float32 scores = 64 GiB; the v6e budget is 31.25 GiB
    assert result.oom_required_bytes >= 64 * 2**30
    assert result.oom_available_bytes == pytest.approx(31.25 * 2**30)
    assert "does not fit" in result.summary()


def test_other_compile_errors_propagate(monkeypatch):
    class Lowered:
        def compile(self):
            raise RuntimeError("INVALID_ARGUMENT: something else")

    class Jitted:
        def lower(self, *args):
            return Lowered()

    monkeypatch.setattr(jax, "jit", lambda fn, **kw: Jitted())
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        aot.compile_aot(lambda a: a, jnp.ones(2))


def test_collective_traffic_reads_shapes_and_group_sizes():
    hlo = "\n".join([
        "%all-reduce = bf16[1,1024,2048]{2,1,0:T(8,128)(2,1)S(1)} all-reduce(%f), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
        "%ag = (f32[8,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%a, %b), replica_groups=[4,2]<=[8], dimensions={0}",
        "%ag.done = (f32[8,4]{1,0}, f32[8,4]{1,0}) all-gather-done(%ag)",
        "%cp = s32[16]{0} collective-permute(%c), source_target_pairs={{0,1},{1,0}}",
        "%x = bf16[4,4]{1,0} add(%y, %z)",
    ])
    traffic = aot.collective_traffic(hlo, devices=8)
    assert traffic["all-reduce"] == 2 * 3 / 4 * (1024 * 2048 * 2)  # ring all-reduce over groups of 4
    assert traffic["all-gather"] == 1 / 2 * (2 * 8 * 4 * 4)  # the -start counted, the -done not; groups of 2
    assert traffic["collective-permute"] == 16 * 4
    assert set(traffic) == {"all-reduce", "all-gather", "collective-permute"}


def test_collective_ops_read_mesh_axis_replica_groups():
    hlo = "\n".join([
        "%all-reduce = f32[4,16,64]{2,1,0} all-reduce(%f), channel_id=4, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, to_apply=%add",
        "%all-gather = f32[64,64]{1,0} all-gather(%p), channel_id=6, "
        "replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}",
        "%all-reduce.2 = (f32[4,16]{1,0}, f32[4,16,8]{2,1,0}) all-reduce(%a, %b), replica_groups=[2,4]<=[8]",
    ])
    ops = aot.collective_ops(hlo, devices=8)
    assert [(op.kind, op.group_size) for op in ops] == [("all-reduce", 4), ("all-gather", 8), ("all-reduce", 4)]
    assert ops[0].shapes == ((4, 16, 64),) and ops[2].shapes == ((4, 16), (4, 16, 8))
    assert ops[0].bytes_sent == 2 * 3 / 4 * (4 * 16 * 64 * 4)
    assert ops[1].bytes_sent == 7 / 8 * (64 * 64 * 4)
    assert aot.collective_traffic(hlo, devices=8)["all-gather"] == ops[1].bytes_sent


def _compile_failing_with(text, monkeypatch):
    """`compile_aot` of a program whose compile raises `text`, as libtpu's errors read."""

    class Lowered:
        def compile(self):
            raise RuntimeError(text)

    monkeypatch.setattr(jax, "jit", lambda fn, **kw: type("J", (), {"lower": lambda self, *a: Lowered()})())
    return aot.compile_aot(lambda a: a, jnp.ones(2))


def test_a_vmem_overflow_is_a_result_with_the_compilers_figures(monkeypatch):
    text = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem\n"
            "}}, metadata={}. Scoped allocation with size 60.66M and limit 32.00M exceeded scoped vmem limit")

    result = _compile_failing_with(text, monkeypatch)
    assert not result.fits and result.vmem_required_bytes == 60.66 * 2**20 and result.vmem_limit_bytes == 32 * 2**20
    assert "scoped VMEM" in result.summary() and "32.00 MiB" in result.summary()


@requires_libtpu
def test_a_compile_for_a_topology_is_kept_and_read_back_by_its_program(tmp_path, monkeypatch):
    """`compile_aot` keeps what it read of a TPU compile under a key of the program, the devices
    and the compiler (`$TPUPEDIA_AOT_CACHE`): the same program comes back from the folder without
    compiling, with the same memory, collectives, HLO text and cost; another program or another
    slice compiles; a damaged entry compiles again; `off` keeps nothing."""
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path / "aot"))
    mesh = devices.topology_mesh("v6e:2x2", (4,), ("x",))
    x = aot.abstract((512, 256), jnp.bfloat16, NamedSharding(mesh, P("x", None)))
    w = aot.abstract((256, 512), jnp.bfloat16, NamedSharding(mesh, P()))
    matmul = lambda a, b: jnp.tanh(a @ b) @ b.T  # noqa: E731
    first = aot.compile_aot(matmul, x, w)
    (entry,) = (tmp_path / "aot").rglob("*.json.gz")
    compiles = []
    real_compile = aot._compile_uncached
    monkeypatch.setattr(aot, "_compile_uncached", lambda lowered: compiles.append(1) or real_compile(lowered))
    again = aot.compile_aot(matmul, x, w)
    assert compiles == [] and isinstance(again.compiled, aot.CachedCompile)
    assert (again.fits, again.memory, again.collectives) == (first.fits, first.memory, first.collectives)
    assert again.compiled.as_text() == first.compiled.as_text()
    assert again.compiled.cost_analysis()["flops"] == first.compiled.cost_analysis()["flops"] > 0

    aot.compile_aot(lambda a, b: jnp.sin(a @ b) @ b.T, x, w)  # another program
    other = devices.topology_mesh("v6e:2x4", (8,), ("x",))  # the same program for another slice
    aot.compile_aot(matmul, aot.abstract((512, 256), jnp.bfloat16, NamedSharding(other, P("x", None))),
                    aot.abstract((256, 512), jnp.bfloat16, NamedSharding(other, P())))
    assert len(compiles) == 2
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2 --xla_cpu_multi_thread_eigen=false")
    aot.compile_aot(matmul, x, w)  # flags of XLA's CPU backend (another float order): the same TPU compile
    assert len(compiles) == 2
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")
    aot.compile_aot(matmul, x, w)  # a TPU compiler flag: another compile
    assert len(compiles) == 3
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    entry.write_bytes(b"not gzip")  # damaged: compiled again, and kept anew
    assert aot.compile_aot(matmul, x, w).memory == first.memory and len(compiles) == 4
    monkeypatch.setenv(aot.CACHE_ENV, "off")
    aot.compile_aot(matmul, x, w)
    assert len(compiles) == 5 and len(list((tmp_path / "aot").rglob("*.json.gz"))) == 4


@requires_libtpu
def test_a_kernels_key_does_not_name_the_folder_it_was_traced_from(monkeypatch):
    """A Pallas kernel reaches the compiler as Mosaic bytecode, which names the source file it was
    traced from (inside the virtual environment) unless the program is lowered without locations:
    then the key of a kept compile is the same in every checkout, and `make test` in a fresh clone
    reads the compiles the repository keeps (`tests/aot-kept`)."""
    import base64
    import re

    from tpupedia import attention

    lowered_texts = []
    real_key = aot._cache_key
    monkeypatch.setattr(aot, "_cache_key", lambda lowered: lowered_texts.append(lowered.as_text()) or real_key(lowered))
    monkeypatch.setenv(aot.CACHE_ENV, "off")

    class Lowered(Exception):
        pass

    def stop(lowered):  # the key is what this test reads: no compile needed
        raise Lowered

    monkeypatch.setattr(aot, "_compile_uncached", stop)
    mesh = devices.topology_mesh("v6e:2x2", (1, 4), ("dp", "tp"))
    q = aot.abstract((1, 8, 1024, 128), jnp.bfloat16, NamedSharding(mesh, P(None, "tp", None, None)))
    with pytest.raises(Lowered):
        aot.compile_aot(lambda q, k, v: attention.splash_attention(q, k, v, mesh=mesh, interpret=False), q, q, q)
    (text,) = lowered_texts
    bodies = [base64.b64decode(b) for b in re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', text)]
    assert bodies and all(b"splash" in b for b in bodies)  # the kernel is there, by name
    assert not any(b".py" in b or b"site-packages" in b for b in bodies)
    with config.traceback_in_locations_limit(10):  # what a plain lowering carries, for contrast
        plain = jax.jit(lambda q, k, v: attention.splash_attention(q, k, v, mesh=mesh, interpret=False)).lower(q, q, q)
    assert b"splash_attention_kernel.py" in b"".join(
        base64.b64decode(b) for b in re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', plain.as_text()))


@requires_libtpu
def test_a_key_does_not_depend_on_the_last_bits_of_a_table_the_host_computed(tmp_path, monkeypatch):
    """A scheduler's tables are computed on the host while tracing, and their last bits follow the
    host's vector kernels: a Wan step traced here and again with PyTorch's and NumPy's portable
    kernels differed in a few ulp of its UniPC coefficients, and so did every such key between two
    hosts of one kind (a fresh clone there recompiled what `tests/aot-kept` holds). The key leaves
    out the values of floating-point array constants; their shape and every scalar constant still
    change it, and an integer table stays in it whole."""
    import numpy as np

    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))
    mesh = devices.topology_mesh("v6e:2x2", (4,), ("x",))
    x = aot.abstract((4, 16), jnp.float32, NamedSharding(mesh, P("x", None)))
    table = np.exp(-np.linspace(0.0, 3.0, 16, dtype=np.float32))
    nudged = table.copy()
    nudged[5] = np.nextafter(nudged[5], np.float32(1))  # one ulp: another host's exp

    def key(fn):
        return aot._cache_key(jax.jit(fn).lower(x))

    here = key(lambda a: a * table + 0.5)
    assert key(lambda a: a * nudged + 0.5) == here
    assert key(lambda a: a * table + 0.25) != here  # a scalar constant
    assert key(lambda a: a[:, :8] * table[:8] + 0.5) != here  # another shape
    steps = np.arange(16, dtype=np.int32)
    assert key(lambda a: a * steps + 0.5) != key(lambda a: a * steps[::-1] + 0.5)  # integers are kept
    text = aot.program_text(jax.jit(lambda a: a * table + 0.5).lower(x).as_text())
    assert "dense<ARRAY> : tensor<16xf32>" in text and "5.000000e-01" in text


def test_prune_keeps_what_a_run_used_however_cheap(tmp_path):
    """`make test` keeps every compile its run used (`tests/conftest.py` prunes with no
    `min_seconds`): a compile that took 0.5 s here takes more on a slower host, and hundreds of
    them dropped as cheap cost a fresh clone's `make check` minutes there."""
    import gzip
    import json
    import os
    import time

    def entry(name, seconds, age):
        path = tmp_path / name[:2] / f"{name}.json.gz"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(gzip.compress(json.dumps({"seconds": seconds}).encode()))
        os.utime(path, (time.time() - age, time.time() - age))
        return path

    used_slow, used_fast, unused = entry("aa1", 30.0, 0), entry("aa2", 0.5, 0), entry("bb1", 30.0, 3600)
    damaged = tmp_path / "cc" / "cc1.json.gz"
    damaged.parent.mkdir()
    damaged.write_bytes(b"not gzip")
    assert aot.prune(tmp_path, since=time.time() - 60) == 2
    assert used_slow.exists() and used_fast.exists() and not unused.exists() and not damaged.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aa"]  # emptied folders go too
    assert aot.prune(tmp_path, since=time.time() - 60, min_seconds=2.0) == 1 and not used_fast.exists()


@requires_libtpu
def test_an_out_of_memory_compile_is_kept_with_its_figures(tmp_path, monkeypatch):
    monkeypatch.setenv(aot.CACHE_ENV, str(tmp_path))
    one = devices.tpu_topology("v6e:2x2")[:1]
    from jax.sharding import Mesh

    q = aot.abstract((131_072, 128), jnp.bfloat16, NamedSharding(Mesh(one, ("x",)), P()))
    scores = lambda a, b: jax.nn.softmax((a @ b.T).astype(jnp.float32), axis=-1)  # noqa: E731
    first = aot.compile_aot(scores, q, q)
    monkeypatch.setattr(aot, "_compile_uncached", lambda lowered: pytest.fail("read back, not compiled"))
    again = aot.compile_aot(scores, q, q)
    assert not again.fits and again.memory is None and again.compiled is None
    assert (again.oom_required_bytes, again.oom_available_bytes) == (first.oom_required_bytes, first.oom_available_bytes)
    assert again.summary() == first.summary()


@pytest.mark.parametrize("text", [
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 50.35G of "
    "31.25G hbm. Exceeded hbm capacity by 19.10G.\n\nTotal hbm usage >= 51.35G:",
    "RESOURCE_EXHAUSTED: Program hbm requirement 50.35G:\n    HLO temp          50.35G\n"
    "Largest program allocations in hbm: ... 50.35G required for HLO temporaries (50.35G) exceeds available HBM (31.25G)",
], ids=["used-of-hbm", "required-for-temporaries"])
def test_both_of_libtpus_hbm_messages_give_the_figures(monkeypatch, text):
    """libtpu words an HBM overflow two ways; both give the same required and available bytes,
    so `hbm_budget` (and every plan built on it) reads either."""
    result = _compile_failing_with(text, monkeypatch)
    assert not result.fits and result.oom_required_bytes == 50.35 * 2**30 and result.oom_available_bytes == 31.25 * 2**30
    assert "31.25 GiB of HBM available" in result.summary()
    monkeypatch.setattr(aot, "_BUDGETS", {})
    assert aot.hbm_budget(jax.devices()[:1]) == 31.25 * 2**30
