"""`tpupedia plan`: the pipeline's own programs compiled for a TPU slice, per-stage peaks, refusals."""

import re

import pytest

from tpupedia import devices, plan
from tpupedia.cli import main

pytestmark = pytest.mark.skipif(not devices.has_libtpu(), reason="AOT compiles for a TPU need libtpu")


@pytest.fixture(scope="module")
def cogvideox_plan(tmp_path_factory):
    from tpupedia import presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    checkpoint = cogvideox.tiny_checkpoint(tmp_path_factory.mktemp("cogvideox"))
    configs = cogvideox.component_configs(str(checkpoint))
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 3}))
    return configs, plan.make("cogvideox", request, pipeline.Options(), configs=configs, topology="v6e:2x2",
                              dtype="float32")


def test_a_plan_compiles_every_stage_of_the_pipeline_for_the_slice(cogvideox_plan):
    configs, p = cogvideox_plan
    assert p.chips == 4 and p.mesh == {"dp": 2, "tp": 2}  # the guidance pair on dp, the rest tp
    assert [s.stage for s in p.stages] == ["text", "denoise", "decode"]
    (text,) = p.stage("text").programs
    assert f"{configs['transformer']['max_text_seq_length']} tokens" in text.name and text.calls == 2
    (step,) = p.stage("denoise").programs
    assert step.calls == 3 and step.fits and step.weights > 0
    assert step.arguments >= step.weights  # the weight shards are arguments of the step
    assert all(q.fits for s in p.stages for q in s.programs)
    assert p.fits and p.binding in plan.STAGES and p.advice() == ""
    assert all(s.resident == 0 for s in p.stages)  # a one-shot run frees each stage's models


def test_a_plan_that_does_not_fit_names_the_stage_and_the_fix(cogvideox_plan):
    import dataclasses

    _, p = cogvideox_plan
    decode = p.stage("decode")
    big = dataclasses.replace(decode.programs[0], temporaries=p.hbm)  # one decoder call over the chip
    over = dataclasses.replace(p, stages=[p.stage("text"), p.stage("denoise"),
                                          plan.StageCost("decode", [big], 0.0)])
    assert not over.fits and over.binding == "decode"
    with pytest.raises(plan.PlanError, match=r"stage decode needs .* GiB per chip .*--vae-tiling on"):
        over.check()
    batch = dataclasses.replace(over, resident=True)
    assert "one video at a time" in batch.advice()


def test_weights_over_one_chip_ask_for_more_chips_not_a_smaller_frame(cogvideox_plan):
    """No frame size, tiling or kernel shrinks weights: a stage whose weights alone are over the
    chip is told to split them (HunyuanVideo-1.5 and Wan 14B on one v5e chip); a step over the chip
    with weights that fit is told to shrink the frame, without options it already has or cannot use."""
    import dataclasses

    _, p = cogvideox_plan
    step = p.stage("denoise").programs[0]
    heavy = dataclasses.replace(step, weights=2 * p.hbm, arguments=2 * p.hbm)
    one_chip = dataclasses.replace(p, chips=1, mesh={"dp": 1, "tp": 1}, attention="splash 512/512/512",
                                   stages=[plan.StageCost("denoise", [heavy], 0.0)])
    assert re.search(r"its weights alone are .* GiB: try more chips: one chip cannot hold them", one_chip.advice())
    assert "--resolution" not in one_chip.advice()
    activations = dataclasses.replace(step, temporaries=p.hbm)
    busy = dataclasses.replace(one_chip, stages=[plan.StageCost("denoise", [activations], 0.0)])
    advice = busy.advice()
    assert "GiB of it weights, which leave" in advice and "--resolution" in advice
    assert "--attention splash" not in advice and "--sharding fsdp" not in advice  # splash already; one chip


def test_the_decode_runs_on_the_hosts_chips_and_its_programs_share_the_vaes_weights(cogvideox_plan):
    """Each decode program runs on the host's chips (all 4 of v6e:2x2's) and takes the VAE's
    weights; programs of one component count their weights once (a decode with tiles and frame
    batches compiles several), programs of different components each count theirs."""
    import dataclasses

    _, p = cogvideox_plan
    decode = p.stage("decode")
    assert {q.component for q in decode.programs} == {"vae"}
    assert all("over 4 chips" in q.name or "one per chip" in q.name for q in decode.programs), [q.name for q in decode.programs]
    first = decode.programs[0]
    later = dataclasses.replace(first, name="VAE decode, later frame batches")
    assert plan.StageCost("decode", [first, later], 0.0).weights == first.weights > 0
    other = dataclasses.replace(first, name="a second text encoder", component="text_encoder_2")
    assert plan.StageCost("text", [first, other], 0.0).weights == 2 * first.weights
    # one program runs while the other component's weights stay loaded (Wan 2.2's two experts)
    assert plan.StageCost("decode", [first, later], 0.0).peak == first.peak
    assert plan.StageCost("text", [first, other], 0.0).peak == first.peak + other.weights


def test_a_batch_plan_counts_the_other_stages_models_as_resident(cogvideox_plan):
    """`resident=True`: each stage also holds the others' weights (what `tpupedia batch` keeps)."""
    _, p = cogvideox_plan
    weights = {s.stage: s.weights for s in p.stages}
    stages = [plan.StageCost(s.stage, s.programs, sum(w for o, w in weights.items() if o != s.stage))
              for s in p.stages]
    for s, one_shot in zip(stages, p.stages):
        assert s.peak == pytest.approx(one_shot.peak + sum(weights.values()) - weights[s.stage])


@pytest.mark.parametrize("argv, message", [
    (["plan", "cogvideox", "--layers", "0"], "layers=0 must be a positive integer"),
    (["plan", "hunyuan", "--topology", "v6e:3x3"], "v6e:3x3"),
    (["plan", "cogvideox", "--frames", "10"], "frames"),
    (["plan", "cogvideox", "--mesh", "dp=4,tp=1", "--topology", "v6e:2x2"], "dp must divide"),
])
def test_bad_plan_requests_are_refused_in_one_line_before_anything_compiles(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tpupedia plan:") and len(err.splitlines()) == 1
    assert message in err


def test_preflight_plans_the_runs_own_chips_once_and_caches_the_answer(cogvideox_plan, tmp_path, monkeypatch):
    """`generate --preset full` on a TPU: the plan's checks before any weights load, cached per shape."""
    import dataclasses

    from tpupedia import presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs, topology_plan = cogvideox_plan
    chips = devices.tpu_topology("v6e:2x2")  # TPU devices, as `jax.devices()` on a v6e-4 host lists them
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 3}))
    lines = []
    resolved = plan.preflight("cogvideox", request, pipeline.Options(), configs, chips, cache_dir=tmp_path,
                              dtype="float32", log=lines.append)
    assert resolved.vae_tiling is topology_plan.vae_tiling is False  # the tiny decode fits untiled
    assert dataclasses.replace(resolved, vae_tiling=request.vae_tiling) == request
    assert "4 x TPU v6 lite" in lines[-1] and "binding stage" in lines[-1]
    (cached,) = tmp_path.iterdir()

    def no_compile(*args, **kwargs):
        raise AssertionError("a cached preflight compiles nothing")

    monkeypatch.setattr(plan, "make", no_compile)
    other_words = dataclasses.replace(request, prompt="a dog", seed=7)  # same shapes: the same answer
    assert plan.preflight("cogvideox", other_words, pipeline.Options(), configs, chips, cache_dir=tmp_path,
                          dtype="float32", log=lines.append) == dataclasses.replace(other_words, vae_tiling=False)
    with pytest.raises(AssertionError, match="compiles nothing"):  # another shape is planned anew
        plan.preflight("cogvideox", dataclasses.replace(request, steps=4), pipeline.Options(), configs, chips,
                       cache_dir=tmp_path, dtype="float32")
    cached.write_text("{not json")  # a damaged cache file is planned again, not trusted
    with pytest.raises(AssertionError, match="compiles nothing"):
        plan.preflight("cogvideox", request, pipeline.Options(), configs, chips, cache_dir=tmp_path, dtype="float32")


def test_preflight_refuses_before_loading_and_remembers(cogvideox_plan, tmp_path, monkeypatch):
    import dataclasses

    from tpupedia import presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs, p = cogvideox_plan
    decode = p.stage("decode")
    over = dataclasses.replace(p, stages=[p.stage("text"), p.stage("denoise"), plan.StageCost(
        "decode", [dataclasses.replace(decode.programs[0], temporaries=p.hbm)], 0.0)])
    calls = []
    monkeypatch.setattr(plan, "make", lambda *a, **k: calls.append(k) or over)
    chips = devices.tpu_topology("v6e:2x2")
    request = pipeline.Request(prompt="a cat", **cogvideox.default_request(presets.get("tiny")))
    for _ in range(2):
        with pytest.raises(plan.PlanError, match=r"cogvideox on 4 x TPU v6 lite will not fit: stage decode needs "
                                                 r".*--vae-tiling on.*nothing was loaded.*--no-plan"):
            plan.preflight("cogvideox", request, pipeline.Options(), configs, chips, cache_dir=tmp_path, log=len)
    assert len(calls) == 1 and calls[0]["run_devices"] == chips and calls[0]["layers"] == plan.PREFLIGHT_LAYERS


def test_preflight_on_cpu_devices_holds_the_run_against_the_hosts_memory(cogvideox_plan, tmp_path, monkeypatch):
    """On CPU devices (a host without accelerators) the run's programs are compiled by the CPU
    compiler and held against the host's memory, which the simulated devices share: each device
    gets an equal share of what is available, after the host's copy of the largest model. Enough
    memory: the request comes back, tiling resolved. Too little: refused naming the stage, the
    share and the fix (fewer simulated devices among them). A cached answer that fit is planned
    again when the host has less memory than it needs."""
    import jax

    from tpupedia import hardware, presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs, _ = cogvideox_plan
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 3}))
    lines, made = [], []
    make = plan.make
    monkeypatch.setattr(plan, "make", lambda *a, **k: made.append(k) or make(*a, **k))
    got = plan.preflight("cogvideox", request, pipeline.Options(), configs, jax.devices(), cache_dir=tmp_path,
                         dtype="float32", log=lines.append)
    assert got.vae_tiling is False and len(made) == 1 and made[0]["run_devices"] == jax.devices()
    summary = lines[-1]
    assert "8 x cpu" in summary and "host memory per CPU device" in summary and "shared by 8 devices" in summary
    assert "host's copy of the transformer while it is placed" in summary and "decode   peak" in summary
    found = make("cogvideox", request, pipeline.Options(), configs=configs, layers=1, dtype="float32",
                 run_devices=jax.devices())
    need = max(s.peak for s in found.stages)
    assert 0 < need < found.hbm and found.host_copy > 0
    # the host holds only half of what the run needs on its 8 devices: refused, and planned again
    monkeypatch.setattr(hardware, "host_memory_available", lambda: int(found.host_copy + 4 * need))
    with pytest.raises(plan.PlanError, match=r"cogvideox on 8 x cpu will not fit: stage \w+ needs .* GiB per device "
                                             r"of .* GiB \(host memory per CPU device: .*--devices 1.*nothing was loaded"):
        plan.preflight("cogvideox", request, pipeline.Options(), configs, jax.devices(), cache_dir=tmp_path,
                       dtype="float32", log=lines.append)
    assert len(made) == 2  # the cached answer said it fits: with less memory it was not trusted
    with pytest.raises(plan.PlanError, match="will not fit"):  # the refusal is cached: no third compile
        plan.preflight("cogvideox", request, pipeline.Options(), configs, jax.devices(), cache_dir=tmp_path,
                       dtype="float32", log=lines.append)
    assert len(made) == 2
    with pytest.raises(plan.PlanError, match="vae_tiling='sometimes' is not one of auto, on, off"):
        plan.preflight("cogvideox", request, pipeline.Options(), configs, jax.devices(), cache_dir=tmp_path,
                       tiling="sometimes")


def test_a_named_checkpoint_runs_on_the_machines_devices_and_is_planned_against_host_memory(tmp_path, monkeypatch,
                                                                                              capsys):
    """`generate --model` under the tiny preset: the machine's devices, not the preset's simulated
    ones (which would share the host's memory, each with a copy of the replicated weights), and the
    CPU plan before any weight loads: a host without the memory refuses in one line."""
    from tpupedia import devices as devices_module
    from tpupedia import hardware
    from tpupedia.models import cogvideox

    checkpoint = cogvideox.tiny_checkpoint(tmp_path / "ckpt")
    capsys.readouterr()
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(devices_module, "simulate_cpu_devices", lambda n: pytest.fail("simulated devices"))
    monkeypatch.setattr(hardware, "host_memory_available", lambda: 2**20)  # 1 MiB
    monkeypatch.setattr("tpupedia.pipelines.common.run_stages", lambda *a, **k: pytest.fail("weights loaded"))
    argv = ["generate", "cogvideox", "--model", str(checkpoint), "--prompt", "a cat", "--frames", "9",
            "--compilation-cache", "off", "--workdir", str(tmp_path / "run")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "devices: 8 x cpu, this machine's: a named checkpoint is not run on the tiny preset's" in out
    assert re.match(r"tpupedia generate: cogvideox on 8 x cpu will not fit: stage \w+ needs .* GiB per device .*"
                    r"host memory per CPU device: 0\.00 GiB available.*--devices 1", err)
    assert len(err.strip().splitlines()) == 1
    calls = []
    monkeypatch.setattr(devices_module, "simulate_cpu_devices", lambda n: calls.append(n) or __import__("jax").devices())
    assert main(argv + ["--devices", "8"]) == 2 and calls == [8]  # asked for: simulated


def test_generate_full_runs_the_preflight_before_loading(tmp_path, monkeypatch, capsys):
    """The CLI wiring: with the full preset, `generate` runs `pipeline.run`, which asks
    `plan.preflight` after validating the request and before any model loads; its refusal is one
    line and exit 2. `--no-plan` skips it."""
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import common

    checkpoint = cogvideox.tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("TPUPEDIA_PRESET", "full")
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    seen = []

    def refuse(family, request, options, configs, run_devices, **kwargs):
        seen.append((family, request.frames, kwargs["tiling"], kwargs["resident"], sorted(configs)))
        raise plan.PlanError("cogvideox on 8 x TPU v6 lite will not fit: stage decode needs 40.00 GiB")

    def no_load(*args, **kwargs):
        raise AssertionError("weights loaded before the preflight")

    monkeypatch.setattr(plan, "preflight", refuse)
    monkeypatch.setattr(common, "run_stages", no_load)
    argv = ["generate", "cogvideox", "--model", str(checkpoint), "--prompt", "a cat", "--frames", "9",
            "--compilation-cache", "off", "--workdir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "tpupedia generate: cogvideox on 8 x TPU v6 lite will not fit" in capsys.readouterr().err
    assert seen == [("cogvideox", 9, "auto", False, sorted(cogvideox.component_configs(str(checkpoint))))]
    monkeypatch.setattr(plan, "preflight", lambda *a, **k: pytest.fail("--no-plan still planned"))
    with pytest.raises(AssertionError, match="weights loaded"):
        main(argv + ["--no-plan", "--vae-tiling"])


def test_a_full_size_batch_plans_each_request_before_loading(tmp_path, monkeypatch, capsys):
    """A batch whose lines ask different shapes: each request is planned (for one process's own
    chips, models resident) and takes its own resolved VAE tiling; the run uses the planned
    requests; a line that cannot fit refuses the batch, naming the line, before anything loads."""
    import dataclasses
    import json

    import jax

    from tpupedia.models import cogvideox
    from tpupedia.pipelines import common

    checkpoint = cogvideox.tiny_checkpoint(tmp_path / "ckpt")
    monkeypatch.setenv("TPUPEDIA_PRESET", "full")
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in (
        {"prompt": "a cat", "frames": 9}, {"prompt": "a dog", "frames": 13}, {"prompt": "a fox", "frames": 9})))
    seen, ran = [], []

    def tile_long_videos(family, request, options, configs, run_devices, **kwargs):
        seen.append((request.frames, kwargs["resident"], len(run_devices)))
        if request.frames > 20:
            raise plan.PlanError(f"{family} will not fit: stage decode needs 40.00 GiB")
        return dataclasses.replace(request, vae_tiling=request.frames > 9)

    def stop(pipe, request, **kwargs):
        ran.append((request.frames, request.vae_tiling))
        raise plan.PlanError("stopped before loading")

    monkeypatch.setattr(plan, "preflight", tile_long_videos)
    monkeypatch.setattr(common, "run_stages", stop)
    argv = ["generate", "cogvideox", "--model", str(checkpoint), "--prompts", str(prompts),
            "--outdir", str(tmp_path / "out"), "--compilation-cache", "off"]
    assert main(argv) == 2
    assert seen == [(9, True, len(jax.local_devices())), (13, True, len(jax.local_devices())),
                    (9, True, len(jax.local_devices()))]
    assert ran == [(9, False)]  # the first prompt reached the run with its planned request
    capsys.readouterr()
    prompts.write_text(prompts.read_text() + "\n" + json.dumps({"prompt": "a long owl", "frames": 49}))
    seen.clear(), ran.clear()
    assert main(argv) == 2
    assert "tpupedia generate: prompt 3 ('a long owl'): cogvideox will not fit" in capsys.readouterr().err
    # refused before the first prompt ran, the long line planned resident and then as a single run
    assert len(seen) == 5 and seen[-2:] == [(49, True, len(jax.local_devices())), (49, False, len(jax.local_devices()))]
    assert ran == []


def test_every_release_a_family_builds_in_is_its_kind_and_needs_no_download(monkeypatch):
    """`plan --model ID` for a release in `FamilySpec.releases` plans its configs from code (no
    download, so it works offline): each is the kind its id says (a picture needed or refused;
    Wan 2.2's two experts, its image-to-video release without CLIP); another hub id that is not
    cached is refused in one line, not downloaded."""
    import importlib

    from tpupedia import families
    from tpupedia.errors import TpupediaError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in families.video():
        module = importlib.import_module(spec.pipeline)
        assert spec.full_id in spec.releases
        for model, kwargs in spec.releases.items():
            picture = "start.png" if kwargs.get("image_to_video") else None
            request = module.Request(prompt="a video", image=picture)
            configs = module.PIPELINE.plan_configs(request, model)
            module.PIPELINE.check_kind(request, configs)  # raises for the wrong kind
            if spec.name == "wan":
                assert len(module.PIPELINE.family.experts(configs)) == kwargs.get("experts", 1), model
                assert ("image_encoder" in configs) == (kwargs == {"image_to_video": True}), model
    wan = importlib.import_module("tpupedia.pipelines.wan")
    with pytest.raises(TpupediaError, match="someone/not-a-release: no such folder here, and with HF_HUB_OFFLINE=1"):
        wan.PIPELINE.plan_configs(wan.Request(prompt="a video"), "someone/not-a-release")


@pytest.mark.parametrize("family, topology, chips", [("hunyuan", "v6e:2x4", 8), ("cogvideox", "v6e:2x2", 4)],
                         ids=["v6e-8-hunyuan", "4-chip host-cogvideox"])
def test_the_release_configs_text_and_denoise_fit_at_reduced_depth(family, topology, chips):
    """The release's own configs (built in, no download), every model one layer deep with the
    other layers' weight shards counted: text encoders at their real token lengths and the
    denoising step at the family's default video fit each chip: HunyuanVideo-1.5 on a v6e-8,
    CogVideoX on a 4-chip host (mesh dp=2, tp=2). Each compiles for a minute here, so the other
    pairs, and the full-size decode (many minutes on a CPU host), are the plans recorded in
    `docs/results/plans.json`."""
    import importlib

    from tpupedia import presets

    module = importlib.import_module(f"tpupedia.pipelines.{family}")
    defaults = module.PIPELINE.family.default_request(presets.get("full"))
    prompt = 'a neon sign that says "OPEN"'  # text to draw: HunyuanVideo-1.5's ByT5 glyph encoder runs too
    p = plan.make(family, module.Request(prompt=prompt, **defaults), module.Options(), topology=topology,
                  layers=1, stages=("text", "denoise"))
    assert (p.chips, p.mesh) == (chips, {"dp": 2, "tp": chips // 2})
    assert p.checkpoint == module.PIPELINE.family.FULL_ID and f"{family} ({p.checkpoint})" in p.summary()
    assert [s.stage for s in p.stages] == ["text", "denoise"] and p.fits, p.summary()
    text, *glyphs = p.stage("text").programs
    assert ("226 tokens" if family == "cogvideox" else "1108 tokens") in text.name  # T5-XXL; Qwen with template
    if family == "hunyuan":  # the released glyph vocabulary, 1510 rows, divides no tp: replicated, and said so
        assert [g.name for g in glyphs] == ["ByT5 glyph encoder, 256 bytes"]
        assert any("text_encoder_2 shared.weight (1510, 1472)" in n for n in p.notes), p.notes
    (step,) = p.stage("denoise").programs
    assert step.calls == defaults["steps"] and step.weights > 2 * 2**30  # the whole transformer's shard
    assert any("missing layers' weight shards" in n for n in p.notes)
    assert "stages planned: text, denoise" in p.summary()
    blocks = "/".join(map(str, module.PIPELINE.family.SPLASH_BLOCK_SIZES))  # upstream's tuned sizes
    assert p.attention == f"splash {blocks}" and f"attention splash {blocks}" in p.summary()


@pytest.mark.parametrize("family", ["cogvideox", "hunyuan"])
def test_the_denoise_step_runs_splash_at_the_block_sizes_asked(family, tmp_path, monkeypatch):
    """`Options.block_sizes` (`--block-sizes`) reaches the kernel of the step the pipeline
    compiles (CogVideoX through the SDPA override, HunyuanVideo-1.5 through its padded attention);
    each call caps them to its own sequence."""
    import importlib

    from tpupedia import attention, predict, presets

    assert predict.SPLASH_REPORT  # imported before the cap is watched: its profile's blocks are not the run's
    module = importlib.import_module(f"tpupedia.pipelines.{family}")
    fam = module.PIPELINE.family
    configs = fam.component_configs(str(fam.tiny_checkpoint(tmp_path / family)))
    asked = []
    cap = attention._cap_block_sizes
    monkeypatch.setattr(attention, "_cap_block_sizes", lambda bs, q, kv: asked.append((bs.block_q, bs.block_kv, bs.block_kv_compute)) or cap(bs, q, kv))
    request = module.Request(prompt="a video", **(fam.default_request(presets.get("tiny")) | {"steps": 2}))
    p = plan.make(family, request, module.Options(attention="splash", block_sizes=(256, 256, 128)), configs=configs,
                  topology="v6e:2x2", stages=("denoise",), dtype="float32")
    assert p.fits and p.attention == "splash 256/256/128", p.summary()
    assert asked and set(asked) == {(256, 256, 128)}, asked



def test_a_plan_predicts_each_stage_and_scales_a_shallow_compile_to_full_depth(tmp_path):
    """With a topology, every program gets a predicted time per call (`tpupedia.predict.Work`:
    the compiler's per-chip counts, the splash calls recorded as the step is traced, the
    collectives). A transformer three layers deep planned at `layers=1` (compiled at 1 and 2
    layers, each missing layer adding the difference) predicts the work of the three-layer
    compile, and the step's splash FLOPs are 4 per query, key and head dimension over the padded
    blocks of every layer's call."""
    from tpupedia import attention, predict, presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs = cogvideox.component_configs(str(cogvideox.tiny_checkpoint(tmp_path / "c")))
    configs["transformer"] = configs["transformer"] | {"num_layers": 3}
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 3}))

    def planned(layers):
        return plan.make("cogvideox", request, pipeline.Options(attention="splash"), configs=configs,
                         topology="v6e:2x2", layers=layers, stages=("denoise",), dtype="float32")

    shallow, whole = planned(1), planned(None)
    (step,), (full,) = shallow.stage("denoise").programs, whole.stage("denoise").programs
    for k, v in full.work.items():
        assert step.work[k] == pytest.approx(v, rel=0.02), (k, step.work, full.work)
    t = configs["transformer"]
    tokens = cogvideox.video_tokens(request.width, request.height, request.frames,
                                    cogvideox.shape_facts(configs)) + t["max_text_seq_length"]
    call = [2, t["num_attention_heads"], tokens, tokens, t["attention_head_dim"]]
    blocks = attention.capped_block_sizes(attention.default_block_sizes(tokens, tokens), tokens, tokens)
    chip = plan.hardware.parse_topology("v6e:2x2").chip
    assert full.work["attention_flops"] == 3 * predict.splash_flops(call, blocks, chip) > 4 * 2 * tokens**2
    assert step.predicted_s == pytest.approx(full.predicted_s, rel=0.02) and step.predicted_s > 0
    assert full.predicted_s == pytest.approx(predict.Work(**full.work).seconds(chip, 4))
    stage = whole.stage("denoise")
    assert stage.predicted_s == pytest.approx(3 * full.predicted_s) and whole.predicted_s == stage.predicted_s
    assert step.predicted_compile_s >= step.compile_seconds > 0
    assert "predicted, not measured" in whole.summary() and "per call" in whole.summary()
