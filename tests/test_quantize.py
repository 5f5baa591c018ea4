"""`tpupedia.quantize`: weight-only int8 and fp8 linears, checked against qwix's `quantize` and
`dot_general` numerics, and the compiled program's memory on a v6e."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import qwix  # pinned in requirements/ci.txt: a missing qwix fails the tests, never skips them
import torch

from tpupedia import devices, quantize
from tpupedia.compat import import_torchax

needs_libtpu = pytest.mark.skipif(not devices.has_libtpu(), reason="AOT compiles for a TPU need libtpu")


def _weight(out=24, inp=40, seed=0):
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    w[3] *= 20  # rows of very different ranges: one scale per row is the point
    w[5] = 0.0  # a row of zeros gets scale 1, not a division by zero
    return w


@pytest.mark.parametrize("fmt, qtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_values_and_scales_are_qwixs_per_channel_absmax(fmt, qtype):
    """The same per-output-channel scales as `qwix.quantize(w, qtype, channelwise_axes=(0,))`
    (absmax over 127.5 for int8, 448 for fp8 e4m3fn) to float32's last bit, and the same 8-bit
    values but where a weight over its scale sits on a rounding edge, which that last bit decides
    (XLA divides by a constant as a multiply by its reciprocal; torch divides); the zero row, which
    qwix scales by 0 and this module by 1, stores zeros in both."""
    w = _weight()
    values, scale = quantize.quantize_weight(w, fmt)
    theirs = qwix.quantize(jnp.asarray(w.numpy()), qtype, channelwise_axes=(0,))
    assert values.dtype == quantize.FORMATS[fmt].dtype and scale.dtype == torch.float32 and scale.shape == (24,)
    nonzero = np.arange(24) != 5
    np.testing.assert_allclose(scale.numpy()[nonzero], np.asarray(theirs.scale).ravel()[nonzero], rtol=2**-23)
    ours, qv = values.to(torch.float32).numpy(), np.asarray(theirs.qvalue.astype(jnp.float32))
    differ = ours != qv
    scaled = (w / scale[:, None]).numpy()
    edge = np.abs(np.abs(scaled - np.trunc(scaled)) - 0.5) < 1e-4 if fmt == "int8" else np.ones_like(differ)
    assert bool(edge[differ].all()), (ours[differ], qv[differ], scaled[differ])
    if fmt == "int8":
        assert bool((np.abs(ours - qv) <= 1).all())
    assert scale[5] == 1.0 and not ours[5].any()


def test_each_value_is_within_half_a_step_of_the_weight():
    """int8 rounds each weight over its row's scale: the reconstruction misses by at most half a
    step (`scale / 2`) per element, and the row's largest magnitude lands on the edge of the range."""
    w = _weight()
    values, scale = quantize.quantize_weight(w, "int8")
    error = (values.to(torch.float32) * scale[:, None] - w).abs()
    assert bool((error <= scale[:, None] / 2 + 2**-21 * w.abs()).all())  # float32's last bits of the weight
    assert int(values.abs().amax()) in (127, 128)


@pytest.fixture(scope="module")
def env():
    return import_torchax().default_env()


@pytest.mark.parametrize("fmt, qtype", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_a_quantized_linear_under_torchax_is_qwixs_dot_general(env, fmt, qtype):
    """`QuantizedLinear` run through torchax on JAX (the scale applied after the matmul) equals
    `qwix.dot_general` of the activations with the same values and scales as a qwix `QArray`
    (float32: to 1e-5); int8 misses the float linear by no more than the rounding bound, the sum
    over k of |x_k| x scale / 2."""
    from torchax.interop import jax_jit

    linear = torch.nn.Linear(40, 24)
    with torch.no_grad():
        linear.weight.copy_(_weight())
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(1))
    q = quantize.QuantizedLinear.from_linear(linear, fmt)
    values = jnp.asarray(q.weight.to(torch.float32).numpy()).astype(qtype)
    same = qwix.QArray(values, jnp.asarray(q.weight_scale.numpy())[:, None], None, qtype)
    theirs = qwix.dot_general(jnp.asarray(x.numpy()), same, (((1,), (1,)), ((), ()))) + jnp.asarray(linear.bias.detach().numpy())
    exact = linear(x).detach()
    bound = x.abs().sum(dim=1, keepdim=True) * q.weight_scale[None, :] / 2
    with env:
        q.to("jax")  # in place: the module's buffers become JAX arrays
        ours = jax_jit(lambda t: q(t))(x.to("jax")).cpu()
    np.testing.assert_allclose(ours.numpy(), np.asarray(theirs), rtol=1e-5, atol=1e-5)
    if fmt == "int8":
        assert bool(((ours - exact).abs() <= bound * (1 + 1e-5) + 1e-5).all())


def test_quantize_linears_keeps_what_the_rules_name_and_refuses_an_empty_swap():
    """Every `Linear` but those a `keep` regex fully matches becomes a `QuantizedLinear` in place,
    its values under the weight's own name (so a sharding table still finds it); keeping every
    linear, or an unknown format, is refused."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    names = quantize.quantize_linears(model, "int8", keep=[r"2"])
    assert names == ["0"] and isinstance(model[0], quantize.QuantizedLinear) and isinstance(model[2], torch.nn.Linear)
    assert dict(model.named_buffers())["0.weight"].dtype == torch.int8 and "0.weight_scale" in dict(model.named_buffers())
    assert model(torch.randn(3, 8)).shape == (3, 4)
    with pytest.raises(quantize.QuantizeError, match="no Linear left to quantize"):
        quantize.quantize_linears(torch.nn.Sequential(torch.nn.Linear(2, 2)), "int8", keep=[r".*"])
    with pytest.raises(quantize.QuantizeError, match="'int4': one of int8, fp8"):
        quantize.quantize_weight(torch.ones(2, 2), "int4")


@needs_libtpu
def test_int8_halves_the_weights_bytes_and_scaling_after_the_matmul_leaves_no_copy():
    """Compiled for one v6e chip: a 4096 x 8192 bf16 activation against an 8192 x 8192 weight. The
    int8 weight takes half the bf16 weight's argument bytes; applying the scale after the matmul
    leaves no temporaries, while dequantizing the weight first leaves part of a bf16 copy."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpupedia import aot, hardware

    mesh = devices.topology_mesh(hardware.parse_topology("v6e:1x1"), (1, 1), ("dp", "tp"))
    rep = NamedSharding(mesh, P())
    x = aot.abstract((4096, 8192), jnp.bfloat16, rep)
    q = aot.abstract((8192, 8192), jnp.int8, rep)
    s = aot.abstract((8192,), jnp.float32, rep)

    def after(x, q, s):  # what QuantizedLinear.forward lowers to
        return ((x @ q.astype(x.dtype).T).astype(jnp.float32) * s).astype(x.dtype)

    def first(x, q, s):
        return x @ (q.astype(jnp.float32) * s[:, None]).astype(x.dtype).T

    mib = 2**20
    scaled, dequantized = (aot.compile_aot(f, x, q, s).memory for f in (after, first))
    plain = aot.compile_aot(lambda x, w: x @ w.T, x, aot.abstract((8192, 8192), jnp.bfloat16, rep)).memory
    assert plain.arguments - scaled.arguments == 8192 * 8192 - 8192 * 4  # a byte a weight instead of two, plus the scales
    assert scaled.temporaries == 0 and dequantized.temporaries >= 32 * mib


@pytest.mark.parametrize("family, fmt", [("cogvideox", "int8"), ("wan", "int8"), ("hunyuan", "int8"), ("wan", "fp8")])
def test_a_quantized_tiny_run_stays_within_its_bound_of_the_same_run_in_float(family, fmt, tmp_path):
    """`Request.quantize` (`--quantize int8`, and fp8 for one family: its weights reach the devices
    as float8 through `sharding.place`) through each family's whole tiny pipeline: the denoise
    stage's settings record the format, and the frames move, but stay within the format's
    `quantize.TINY_BOUNDS` of the same run unquantized (measured here for int8: 3.5e-3 / 68 dB,
    2.5e-3 / 71 dB, 3.9e-3 / 70 dB for CogVideoX, Wan, HunyuanVideo-1.5, on random tiny weights:
    quality on real weights needs the real weights)."""
    import dataclasses
    import importlib

    from tpupedia import metrics, presets
    from tpupedia.pipelines import stages

    module = importlib.import_module(f"tpupedia.pipelines.{family}")
    fam = module.PIPELINE.family
    plain = module.Request(prompt="a cat", **fam.default_request(presets.get("tiny")))
    frames = {}
    for weights in (None, fmt):
        request = dataclasses.replace(plain, quantize=weights)
        workdir = tmp_path / str(weights)
        module.run(request, module.Options(quiet=True), preset=presets.get("tiny"), workdir=workdir, log=lambda _: None)
        source, label = fam.model_source(presets.get("tiny"))
        configs = fam.component_configs(source)
        denoise = stages.read(workdir, "denoise", module.PIPELINE.settings_for(
            label, configs, request, module.Options(), torch.float32, "denoise"))
        assert denoise.meta["settings"].get("quantize") == weights  # read against settings that name it: it is recorded
        frames[weights] = stages.read(workdir, "decode", module.PIPELINE.settings_for(
            label, configs, request, module.Options(), torch.float32, "decode")).tensors["frames"].numpy()
    found, bound = metrics.compare(frames[fmt], frames[None]), quantize.TINY_BOUNDS[fmt]
    assert 1e-5 < found["max_abs"] <= bound["max_abs"] and found["psnr_db"] >= bound["psnr_db"], found
    assert found["ssim"] >= bound["ssim"], found


def test_the_recorded_quality_of_each_quantized_tiny_run_is_within_the_bound_the_tests_assert():
    """`tpupedia bench quantize` records (docs/results/pipelines.json, rendered on the results
    page): every family in both formats, each on the tiny preset with the bound of
    `quantize.TINY_BOUNDS` it was measured against, and within it; a bound changed here is a
    record to make again."""
    from tpupedia import bench, results

    records = [r for r in results.load(bench.DEFAULT_PIPELINE_RESULTS) if r["bench"] == "quantize"]
    assert {(r["config"]["family"], r["quantize"]) for r in records} >= {
        (f, q) for f in ("cogvideox", "wan", "hunyuan") for q in quantize.FORMATS}
    for r in records:
        x, bound = r["result"], quantize.TINY_BOUNDS[r["quantize"]]
        assert r["config"]["source"] == "preset:tiny" and x["bound"] == bound, r["command"]
        assert x["max_abs"] <= bound["max_abs"] and x["psnr_db"] >= bound["psnr_db"] and x["ssim"] >= bound["ssim"], r


def test_a_quantized_plan_compiles_the_int8_transformer_and_counts_its_bytes(tmp_path):
    """`plan.make` with `quantize="int8"` builds the transformer on `meta` quantized as a run holds
    it: at one layer (the rest added from a full-depth copy, quantized too) the denoise stage's
    weights per chip fall by a third or more (the quantized linears at a byte a weight, what
    `QUANTIZE_KEEP` keeps at two) and the plan records the format."""
    import dataclasses

    import diffusers

    from tpupedia import plan, presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs = cogvideox.component_configs(str(cogvideox.tiny_checkpoint(tmp_path / "c")))
    configs["transformer"] = configs["transformer"] | {"num_layers": 3}
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 2}))
    plans = {fmt: plan.make("cogvideox", dataclasses.replace(request, quantize=fmt), pipeline.Options(attention="splash"),
                            configs=configs, topology="v6e:2x2", layers=1, stages=("denoise",), dtype="bfloat16")
             for fmt in (None, "int8")}
    bf16, int8 = (p.stage("denoise").weights for p in (plans[None], plans["int8"]))
    with torch.device("meta"):
        model = diffusers.CogVideoXTransformer3DModel.from_config(configs["transformer"]).to(torch.bfloat16)
    kept = [k for k, _ in cogvideox.QUANTIZE_KEEP]
    names = quantize.quantize_linears(model, "int8", keep=kept)
    quantized = sum(m.weight.numel() for n, m in model.named_modules() if n in names)
    total = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if t.dtype == torch.bfloat16) + quantized
    assert plans["int8"].fits and plans["int8"].request["quantize"] == "int8"
    # per chip: the quantized linears hold most of the weights, so the stage's bytes fall by a third or more
    assert quantized > 0.6 * total and 0.5 * bf16 < int8 < 0.7 * bf16, (bf16, int8, quantized, total)


def test_a_checkpoint_already_quantized_is_refused_in_one_line_before_it_loads(tmp_path):
    """A checkpoint whose transformer config carries a `quantization_config` (bitsandbytes, torchao,
    GGUF) is refused when its configs are read, naming the method and what to give instead: this
    module quantizes the bf16 weights itself, after any LoRA fuse."""
    import json
    import shutil

    from tpupedia.models import wan
    from tpupedia.models.checkpoints import CheckpointError

    source = wan.tiny_checkpoint(tmp_path / "w")
    quantized = tmp_path / "prequantized"
    shutil.copytree(source, quantized)
    path = quantized / "transformer" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert wan.component_configs(str(source))["transformer"]  # the copy's source reads
    with pytest.raises(CheckpointError, match=r"transformer is already quantized \(bitsandbytes.*--quantize int8"):
        wan.component_configs(str(quantized))


def test_a_quantized_weights_scales_are_replicated_whatever_the_table_says():
    """`sharding.QUANTIZED_SCALES`: the scales beside an 8-bit weight are replicated even where a
    table's rule would match their name; the 8-bit values keep the weight's name and its rule."""
    from jax.sharding import PartitionSpec as P

    from tpupedia import sharding

    table = [(r".*", ("tp", None))]
    assert sharding.spec_for("blocks.0.attn1.to_q.weight_scale", table) == (P(), sharding.QUANTIZED_SCALES)
    assert sharding.spec_for("blocks.0.attn1.to_q.weight", table) == (P("tp", None), r".*")
