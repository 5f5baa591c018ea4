"""Every way in checks its plan before it loads (`tpupedia.pipelines.common.check_plan`): the
library's `run`, `run_batch` (tests/test_batch.py), the stage methods of a pipeline built by hand,
as notebooks `cogvideox_pipeline`, `hunyuan_video` and `hunyuan_tuning_and_i2v` build them, and
the command line (tests/test_plan.py), under a full-size preset; the tiny preset keeps its speed.

`plan.preflight` itself (the compiles, the cache, the refusal's wording) is tested in
tests/test_plan.py; here it is replaced by a stand-in that records what it was asked and answers
as the recorded plan does (`docs/results/plans.json`: HunyuanVideo-1.5's untiled 720p x 121-frame
decode needs about 189 GiB of a v6e chip's 31.25 GiB, the tiled one fits), so these tests prove the
wiring: who asks, for which chips, before what, and that the stages run what the plan resolved."""

from __future__ import annotations

import dataclasses

import pytest

from tpupedia import plan, presets
from tpupedia.models import checkpoints
from tpupedia.pipelines import common


def _tiling_plan(asked: list, *, fits: bool = True):
    """A stand-in for `plan.preflight` that records `(family, chips, platform, tiling, resident)`
    and resolves the tiling on, as the plan does when the untiled decode does not fit."""

    def preflight(family, request, options, configs, run_devices, *, tiling, resident, **kwargs):
        asked.append((family, len(run_devices), run_devices[0].platform, tiling, resident))
        if not fits:
            raise plan.PlanError(f"{family} on {len(run_devices)} x {run_devices[0].device_kind} will not fit: "
                                 "stage decode needs 189.00 GiB per chip")
        return dataclasses.replace(request, vae_tiling=tiling != "off")

    return preflight


def test_the_library_run_of_notebook_hunyuan_video_plans_and_decodes_tiled(tmp_path, monkeypatch):
    """Notebook `hunyuan_video` on a v6e-8 with `TPUPEDIA_PRESET=full` calls `pipeline.run` with
    the full preset's request (720p, 121 frames, no tiling asked). The run plans for its own eight
    chips before it builds anything, and the stages get the request the plan resolved: tiled.
    Refused, it stops before anything is built; with `plan="off"` it runs as asked."""
    import jax

    from tpupedia import devices
    from tpupedia.models import hunyuan as family
    from tpupedia.pipelines import hunyuan as pipeline

    full = presets.get("full")
    configs = family.full_configs()  # the 720p release's configs, no download
    chips = devices.tpu_topology("v6e:2x4")  # what jax.devices() lists on a v6e-8
    monkeypatch.setattr(jax, "devices", lambda *a: chips)
    monkeypatch.setattr(family, "component_configs", lambda source: configs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a hub id is checked by its spelling only; nothing is fetched
    monkeypatch.setattr(checkpoints, "download_bytes", lambda source: None)  # the Hub is not asked for its sizes
    asked, ran = [], []
    monkeypatch.setattr(plan, "preflight", _tiling_plan(asked))
    monkeypatch.setattr(common, "run_stages", lambda pipe, request, **kwargs: ran.append((pipe, request)) or [])

    request = pipeline.Request(prompt='A neon sign that says "OPEN" flickers on a rainy street at night.',
                               negative_prompt="blurry, low quality", **family.default_request(full))
    assert (request.width, request.height, request.frames, request.vae_tiling) == (1280, 720, 121, False)
    pipeline.run(request, pipeline.Options(quiet=True), preset=full, workdir=tmp_path / "run",
                 log=lambda _: None)  # the notebook's call, less its mp4
    assert asked == [("hunyuan", 8, "tpu", "auto", False)]
    ((pipe, planned),) = ran
    assert planned.vae_tiling and planned == dataclasses.replace(request, vae_tiling=True)
    assert pipe.plan == "off" and pipe.mesh.devices.size == 8  # its stage methods do not plan again

    asked.clear(), ran.clear()
    monkeypatch.setattr(plan, "preflight", _tiling_plan(asked, fits=False))
    with pytest.raises(plan.PlanError, match="will not fit: stage decode needs 189.00 GiB"):
        pipeline.run(request, pipeline.Options(quiet=True), preset=full, workdir=tmp_path / "run", log=lambda _: None)
    assert len(asked) == 1 and ran == []
    pipeline.run(request, pipeline.Options(quiet=True), preset=full, workdir=tmp_path / "run", log=lambda _: None,
                 plan="off")
    assert len(asked) == 1 and ran[0][1] == request  # not planned, run as asked
    with pytest.raises(common.PipelineError, match="plan='maybe' is not one of auto, on, off"):
        pipeline.run(request, pipeline.Options(quiet=True), preset=full, workdir=tmp_path / "run", plan="maybe")


def test_the_tiny_preset_runs_without_planning(tmp_path, monkeypatch):
    """`auto` plans under a full-size preset only: the tiny preset's run keeps its seconds."""
    from tpupedia.pipelines import cogvideox as pipeline

    monkeypatch.setattr(plan, "preflight", lambda *a, **k: pytest.fail("the tiny preset planned"))
    ran = []
    monkeypatch.setattr(common, "run_stages", lambda pipe, request, **kwargs: ran.append(request) or [])
    request = pipeline.Request(prompt="a cat", **pipeline.PIPELINE.family.default_request(presets.get("tiny")))
    pipeline.run(request, pipeline.Options(quiet=True), preset=presets.get("tiny"), workdir=tmp_path, log=len)
    assert ran == [request]


def test_a_pipeline_built_by_hand_plans_before_its_first_stage_loads(tmp_path, monkeypatch):
    """Notebooks `cogvideox_pipeline` and `hunyuan_tuning_and_i2v` build a pipeline by hand and
    call its stage methods. Under the full preset the first stage method plans the request for
    the pipeline's own mesh before it loads anything; every stage then runs the request as planned
    (the decode tiled), planned once; a request that will not fit is refused before its stage
    loads. Under the tiny preset nothing is planned."""
    import jax

    from tpupedia import devices
    from tpupedia.models import cogvideox as family
    from tpupedia.pipelines import cogvideox as pipeline

    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt")
    mesh = devices.make_mesh((2, 4), ("dp", "tp"), devices=jax.devices()[:8])
    pipe = pipeline.CogVideoX(str(checkpoint), "tiny", pipeline.torch_dtype(pipeline.Options(), presets.get("tiny")),
                              mesh, pipeline.Options(quiet=True))
    stages_ran = []
    for stage in ("_encode_text", "_denoise", "_decode"):
        monkeypatch.setattr(pipe, stage, lambda request, *a, stage=stage: stages_ran.append((stage, request)) or ({}, {}))
    request = pipeline.Request(prompt="a cat", **family.default_request(presets.get("tiny")))
    asked = []
    monkeypatch.setattr(plan, "preflight", _tiling_plan(asked))

    pipe.encode_text(request), pipe.denoise(request, {}), pipe.decode(request, None)  # the tiny preset
    assert asked == [] and [r for _, r in stages_ran] == [request] * 3

    monkeypatch.setenv("TPUPEDIA_PRESET", "full")
    stages_ran.clear()
    pipe.encode_text(request), pipe.denoise(request, {}), pipe.decode(request, None)
    assert asked == [("cogvideox", 8, "cpu", "auto", False)]  # once, for the pipeline's own devices
    tiled = dataclasses.replace(request, vae_tiling=True)
    assert stages_ran == [("_encode_text", tiled), ("_denoise", tiled), ("_decode", tiled)]

    monkeypatch.setattr(plan, "preflight", _tiling_plan(asked, fits=False))
    longer = dataclasses.replace(request, steps=request.steps + 1)
    with pytest.raises(plan.PlanError, match="will not fit"):
        pipe.decode(longer, None)
    assert len(stages_ran) == 3  # refused before the decode ran


class _GPU:
    """What `jax.devices()` lists on a GPU host, as far as the plan reads it."""

    platform = "gpu"

    def __init__(self, limit, kind="NVIDIA H200"):
        self.limit, self.device_kind = limit, kind

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else None


H100, H200 = 79.1 * 2**30, 139.0 * 2**30  # what each reports as `bytes_limit`, about


@pytest.mark.parametrize("family_name, gib, device, limit", [("wan", 212.9, "NVIDIA H200", H200),
                                                             ("cogvideox", 91.0, "NVIDIA H100", H100)])
def test_a_full_size_gpu_run_whose_attention_cannot_fit_is_refused_in_one_line(tmp_path, monkeypatch, family_name, gib,
                                                                               device, limit):
    """On a GPU the attention is the reference, which builds every call's scores: Wan 2.1 14B at
    720p and 81 frames, 2 x 40 x 75,600^2 float32 scores, 213 GiB per device over eight; CogVideoX1.5
    at 1360x768 and 81 frames, 91 GiB. The full preset's library run is refused in one line before
    anything is built, Wan's on an H200 (139 GiB), CogVideoX's on an H100 (79 GiB); CogVideoX's
    scores fit an H200 and a 480p Wan run's fit too, and the log says only the attention was
    checked; a device that reports no memory is not refused, and the log says it was not checked."""
    import importlib

    from tpupedia import families

    spec = families.get(family_name, "video")
    pipeline = importlib.import_module(spec.pipeline)
    family = pipeline.PIPELINE.family
    full = presets.get("full")
    configs = family.full_configs()
    monkeypatch.setattr(family, "component_configs", lambda source: configs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a hub id is checked by its spelling only; nothing is fetched
    monkeypatch.setattr(checkpoints, "download_bytes", lambda source: None)  # the Hub is not asked for its sizes
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    ran = []
    monkeypatch.setattr(common, "run_stages", lambda pipe, request, **kwargs: ran.append(request) or [])
    request = pipeline.Request(prompt="a fox in the snow", **family.default_request(full))

    gpus = [_GPU(limit, device)] * 8
    monkeypatch.setattr("jax.devices", lambda *a: gpus)
    with pytest.raises(plan.PlanError) as refused:  # the notebook's or a script's call, on a GPU host
        pipeline.run(request, pipeline.Options(quiet=True), preset=full, workdir=tmp_path / "run", log=lambda _: None)
    assert ran == []
    message = str(refused.value)
    assert f"{family_name} on 8 x {device} will not fit: the reference attention" in message
    assert f"{gib:.1f} GiB per device against its {limit / 2**30:.1f} GiB" in message and "\n" not in message
    assert round(plan.gpu_attention(family_name, request, pipeline.Options(), configs, [_GPU(2**40)] * 8) / 2**30, 1) == gib
    fitting = dataclasses.replace(request, width=832, height=480) if family_name == "wan" else request
    log = []
    assert plan.preflight(family_name, fitting, pipeline.Options(), configs, [_GPU(H200)] * 8, cache_dir=tmp_path,
                          log=log.append).vae_tiling is False
    assert log and "fit" in log[0] and "only the attention is checked" in log[0]
    log = []
    plan.preflight(family_name, request, pipeline.Options(), configs, [_GPU(None)] * 8, cache_dir=tmp_path, log=log.append)
    assert log and "were not checked" in log[0]


def test_the_command_line_offers_only_the_vae_a_plan_covers():
    """`--vae torchax` (diffusers' CogVideoX VAE under torchax) had no plan, so every full-size run
    with it was refused at its plan: the command line no longer offers a choice it cannot plan. The
    library keeps it (`Options(vae="torchax")`, notebook `port_in_plain_jax`, the tiny preset)."""
    from tpupedia import cli

    parser = cli.build_parser()
    for family in ("cogvideox", "hunyuan", "wan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", family, "--prompt", "x", "--vae", "torchax"])
        assert parser.parse_args(["generate", family, "--prompt", "x"]).__dict__.get("vae") is None
