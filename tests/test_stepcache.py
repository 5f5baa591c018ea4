"""Step caches for every family (`tpupedia.pipelines.stepcache`): the schedules, refused in one
line before any model loads; and parity with diffusers 0.42's own hooks where it registers the
family's block (First-Block-Cache and MagCache: CogVideoX and Wan). Stock decides at run time
which steps to skip; replaying exactly those skips in the static two-program scheme gives
stock's latents after the last step (float32, within 1e-4 of latents of magnitude ~1-6)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch

from tpupedia import presets
from tpupedia.errors import TpupediaError
from tpupedia.models import cogvideox as cogvideox_family
from tpupedia.models import wan as wan_family
from tpupedia.pipelines import cogvideox, stepcache, wan

TINY = presets.get("tiny")
STEPS = 6
LEADER = {"fbcache": "fbc_leader_block_hook", "magcache": "mag_cache_leader_block_hook"}
MAG_RATIOS = [1.0, 1.0, 1.01, 0.99, 1.02, 1.0]


# --- the schedules --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("fbcache:0.05", stepcache.StepCache("fbcache", threshold=0.05)),
    ("magcache:0.06", stepcache.StepCache("magcache", threshold=0.06)),
    ("fbcache:full=0,1,3", stepcache.StepCache("fbcache", full=(0, 1, 3))),
    ("deepcache:11:45:4", stepcache.StepCache("deepcache", deepcache=stepcache.Schedule(11, 45, 4))),
    ("magcache:0.06@runs/cal.json", stepcache.StepCache("magcache", threshold=0.06, calibration_file="runs/cal.json")),
])
def test_step_caches_parse_and_print_back(text, expected):
    cache = stepcache.parse_step_cache(text)
    assert cache == expected and str(cache) == text


@pytest.mark.parametrize("text, names", [
    ("teacache:0.1", ["'teacache' is not one of deepcache, fbcache, magcache", "fbcache:THRESHOLD"]),
    ("fbcache:fast", ["fbcache takes a threshold", "full=STEPS"]),
    ("fbcache:-1", ["the threshold must be a finite number >= 0"]),
    ("magcache:full=0,x", ["full= takes step numbers"]),
    ("deepcache:11:45", ["deepcache takes START:END:INTERVAL"]),
    ("fbcache:full=0,1@cal.json", ["@FILE names a threshold's saved calibration"]),
    ("deepcache:1:4:2@cal.json", ["@FILE names a threshold's saved calibration", "fbcache:0.05@cal.json"]),
    ("magcache:0.06@", ["@FILE names"]),
])
def test_a_bad_step_cache_is_one_line_naming_it(text, names):
    with pytest.raises(stepcache.StepCacheError) as err:
        stepcache.parse_step_cache(text)
    message = str(err.value)
    assert isinstance(err.value, TpupediaError) and "\n" not in message and repr(text) in message
    assert all(n in message for n in names), message


@pytest.mark.parametrize("text, match", [("fbcache:full=1,2", "start at 0"), ("fbcache:full=0,9", r"\[9\] are not steps"),
                                         ("magcache:full=0,3,2", "increasing"), ("deepcache:0:9:2", "end <= steps=6")])
def test_a_schedule_that_does_not_fit_the_steps_is_refused_before_any_model_loads(text, match, capsys, tmp_path,
                                                                                  monkeypatch):
    with pytest.raises(stepcache.StepCacheError, match=match):
        stepcache.parse_step_cache(text).check(STEPS)
    if text.startswith("fbcache:full=0,9"):  # the command line: one line, before anything loads
        from tpupedia import cli

        monkeypatch.chdir(tmp_path)
        assert cli.main(["generate", "wan", "--prompt", "x", "--steps", "6", "--step-cache", text]) != 0
        err = capsys.readouterr().err.strip()
        assert "[9] are not steps of this run" in err and len(err.splitlines()) == 1 and "Traceback" not in err
        assert list(tmp_path.iterdir()) == []  # no stage file, no cache: nothing was loaded or run


def test_magcache_schedule_is_diffusers_rule_from_the_ratios():
    """Full steps from calibrated ratios, diffusers' defaults: the first fifth kept, then cached
    while the accumulated error stays within the threshold, at most 3 in a row."""
    assert stepcache.magcache_full_steps([1.0] * 10, 0.06, 10) == [0, 1, 5, 9]  # 2 kept, then 3 cached, 1 full...
    assert stepcache.magcache_full_steps([1.0, 1.3, 1.3, 1.3], 0.06, 4) == [0, 1, 2, 3]  # too far from 1
    assert stepcache.magcache_full_steps(MAG_RATIOS, 0.0, STEPS) == [0, 2, 3, 4]  # only a ratio of exactly 1 caches
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS, nearest_interp  # 28 ratios, to 50 steps as diffusers does

    assert stepcache.magcache_full_steps(FLUX_MAG_RATIOS.tolist(), 0.06, 50) == stepcache.magcache_full_steps(
        nearest_interp(FLUX_MAG_RATIOS, 50).tolist(), 0.06, 50) != list(range(50))


def test_fbcache_schedule_accumulates_the_change_since_the_last_full_step():
    assert stepcache.fbcache_full_steps([math.inf, 0.02, 0.02, 0.02, 0.5, 0.01], 0.05) == [0, 3, 4]


def test_the_speedup_bound_is_the_flops_ratio():
    assert stepcache.speedup_bound(10.0, 1.0, 50, 25) == pytest.approx(500 / 275)
    assert stepcache.speedup_bound(10.0, 10.0, 50, 10) == 1.0


# --- parity with diffusers' hooks ----------------------------------------------------------------

def _stock(pipeline, family, checkpoint, request, config):
    """Stock diffusers with `config` enabled on its transformer: its latents after the last step,
    and per transformer call whether the hook ran every block (its runtime decision)."""
    from diffusers.hooks import HookRegistry

    pipe, call = pipeline.stock(str(checkpoint), request)
    pipe.transformer.enable_cache(config)
    head = getattr(pipe.transformer, family.CACHE_BLOCKS)[0]
    leader = LEADER["fbcache" if type(config).__name__.startswith("FirstBlock") else "magcache"]
    manager = HookRegistry.check_if_exists_or_initialize(head).get_hook(leader).state_manager
    decisions = []
    head.register_forward_hook(lambda *_: decisions.append(bool(manager.get_state().should_compute)))
    with torch.no_grad():
        latents = pipe(**(call | {"output_type": "latent"})).frames
    return np.asarray(latents, np.float32), decisions


def _ours(pipeline, checkpoint, request, workdir):
    from safetensors.numpy import load_file

    for stage in ("text", "denoise"):
        reports = pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint),
                               workdir=workdir, stage=stage, log=lambda _: None)
    return load_file(workdir / "denoise.safetensors")["latents"], reports[-1].timings


CASES = {  # family, pipeline, request, stock's cache config (CogVideoX's First-Block-Cache: notebook `fewer_steps`)
    "cogvideox-magcache": (cogvideox_family, cogvideox, cogvideox.Request(
        prompt="a panda", negative_prompt="blurry", frames=9, height=32, width=32, steps=STEPS, guidance=6.0, seed=3),
        "magcache", 0.06),
    "wan-fbcache": (wan_family, wan, wan.Request(  # guidance off: one transformer call a step
        prompt="a fox", negative_prompt="blurry", frames=5, height=32, width=32, steps=STEPS, guidance=1.0, seed=3),
        "fbcache", 0.15),
    "wan-fbcache-guided": (wan_family, wan, wan.Request(  # the guidance pair: stock decides each branch apart
        prompt="a fox", negative_prompt="blurry", frames=5, height=32, width=32, steps=STEPS, guidance=5.0, seed=3),
        "fbcache", 0.15),
    "wan-magcache": (wan_family, wan, wan.Request(  # the guidance pair: stock's two branches decide alike
        prompt="a fox", negative_prompt="blurry", frames=5, height=32, width=32, steps=STEPS, guidance=5.0, seed=3),
        "magcache", 0.06),
}


@pytest.fixture(scope="module")
def checkpoints():
    """The tiny checkpoints the other tests share (cached by their configs)."""
    return {"cogvideox": cogvideox_family.tiny_checkpoint(),
            "wan": wan_family.tiny_checkpoint()}


@pytest.mark.parametrize("case", list(CASES))
def test_replaying_stock_hooks_skips_gives_stock_latents(case, checkpoints, tmp_path):
    """diffusers' FirstBlockCache / MagCache on the tiny checkpoint skip some steps at run time;
    the same steps cached in the static two-program scheme give stock's latents. For MagCache the
    decisions are also what `magcache_full_steps` computes from the same ratios."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig

    family, pipeline, request, method, threshold = CASES[case]
    config = (FirstBlockCacheConfig(threshold=threshold) if method == "fbcache" else
              MagCacheConfig(threshold=threshold, num_inference_steps=STEPS, mag_ratios=MAG_RATIOS))
    expected, decisions = _stock(pipeline, family, checkpoints[family.FAMILY], request, config)
    calls = len(decisions) // STEPS  # Wan's guidance pair: two calls a step, each its own cache context
    per_step = [decisions[i * calls:(i + 1) * calls] for i in range(STEPS)]
    # Wan's pair is two calls in stock, each in its own cache context, so each branch decides apart; here the
    # pair is one batch with one schedule, which replays stock where the branches agree, as they do here
    # (for First-Block-Cache at every threshold from 0.05 to 0.3 on this checkpoint and seed)
    assert all(len(set(d)) == 1 for d in per_step), per_step
    full = [i for i, d in enumerate(per_step) if d[0]]
    print(f"{case}: stock ran steps {full} in full, cached the others")
    assert 0 < len(full) < STEPS, full  # the hook cached some steps, not all
    if method == "magcache":
        assert full == stepcache.magcache_full_steps(MAG_RATIOS, threshold, STEPS)
    replay = dataclasses.replace(request, step_cache=stepcache.StepCache(method, full=tuple(full)))
    latents, timings = _ours(pipeline, checkpoints[family.FAMILY], replay, tmp_path)
    assert timings["full_steps"] == full
    error = float(np.abs(latents - expected).max())
    print(f"{case}: max abs error vs stock with its hook: {error:.2e} (latents up to {np.abs(expected).max():.2f})")
    assert latents.shape == expected.shape and error <= 1e-4, error


# --- a saved calibration: calibrate once, reuse ----------------------------------------------------

def test_a_saved_calibration_is_written_once_then_read_instead_of_a_calibration_pass(checkpoints, tmp_path):
    """`magcache:THRESHOLD@FILE`, Wan (tiny): the first run calibrates and saves the record there
    (atomically, validated when read); the next run reads it, runs no calibration pass, and picks the
    same full steps, so the same latents; another threshold reads the same file; at another step count
    MagCache's ratios interpolate as diffusers' do, where First-Block-Cache's per-step changes are
    refused before anything loads; a file made on another model is refused before it loads."""
    path = tmp_path / "cal.json"
    request = wan.Request(prompt="a fox", negative_prompt="blurry", frames=5, height=32, width=32, steps=STEPS,
                          guidance=5.0, seed=3, step_cache=stepcache.parse_step_cache(f"magcache:0.06@{path}"))
    source = checkpoints["wan"]
    first, timings = _ours(wan, source, request, tmp_path / "first")
    assert timings["calibration_written"] == str(path) and "calibration_s" in timings
    saved = stepcache.read_calibration(path)
    assert saved.ratio == timings["calibration"]["ratio"] and len(saved.change) == STEPS
    assert saved.identity == wan.Wan.cache_identity(wan_family.component_configs(str(source)))
    assert "step_cache_calibration" not in stepcache.settings(request.step_cache)  # the run began without it
    pinned = stepcache.settings(request.step_cache.pinned())["step_cache_calibration"]  # the next begins with it
    assert pinned == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    again, replay = _ours(wan, source, request, tmp_path / "again")
    assert replay["calibration_read"] == str(path) and "calibration_s" not in replay
    assert replay["full_steps"] == timings["full_steps"] and np.array_equal(again, first)
    strict = dataclasses.replace(request, step_cache=stepcache.parse_step_cache(f"magcache:0@{path}"))
    _, stricter = _ours(wan, source, strict, tmp_path / "strict")
    assert "calibration_s" not in stricter and len(stricter["full_steps"]) > len(timings["full_steps"])
    assert stepcache.StepCache("magcache", threshold=0.06).full_steps(9, saved) == \
        stepcache.magcache_full_steps(saved.ratio, 0.06, 9)  # interpolated to 9 steps
    with pytest.raises(stepcache.StepCacheError, match=f"calibrated at {STEPS} steps and this run has 9"):
        wan.validate(dataclasses.replace(request, steps=9, step_cache=stepcache.parse_step_cache(f"fbcache:0.1@{path}")),
                     wan.Options())
    other = cogvideox_family.component_configs(str(checkpoints["cogvideox"]))
    with pytest.raises(stepcache.StepCacheError, match="calibrated on another model .*family 'wan', not 'cogvideox'"):
        cogvideox.validate(cogvideox.Request(prompt="x", frames=9, height=32, width=32, steps=STEPS,
                                             step_cache=request.step_cache), cogvideox.Options(), configs=other)


@pytest.mark.parametrize("text, match", [
    ("{", "not readable JSON"), ('{"format": "other"}', "not a step-cache calibration"),
    ('{"format": "tpupedia-step-cache-calibration", "version": 1, "steps": 2, "change": [null, -1], "ratio": [1, 1]}',
     "numbers >= 0"),
])
def test_a_bad_calibration_file_is_one_line_before_any_model_loads(text, match, tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(text)
    with pytest.raises(stepcache.StepCacheError, match=match) as err:
        wan.validate(wan.Request(prompt="x", steps=STEPS, step_cache=stepcache.parse_step_cache(f"fbcache:0.1@{path}")),
                     wan.Options())
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(stepcache.StepCacheError, match="whose folder does not exist"):
        stepcache.parse_step_cache(f"fbcache:0.1@{tmp_path}/nowhere/cal.json").check(STEPS)


def test_bench_stepcache_records_a_calibrated_cache_against_the_plain_run(checkpoints, capsys):
    """`tpupedia bench stepcache wan --step-cache fbcache:0.15`: the plain and the cached video from one
    seed; the record has the steps the calibration kept, its pass timed apart, the FLOPs' bound of
    exactly those steps, and PSNR/SSIM against the plain video. Without --step-cache: one line."""
    from tpupedia import bench, cli

    request = wan.Request(prompt="a fox", negative_prompt="blurry", frames=5, height=32, width=32, steps=STEPS,
                          guidance=1.0, seed=3, step_cache=stepcache.parse_step_cache("fbcache:0.15"))
    record = bench.bench_stepcache("wan", TINY, request, wan.Options(quiet=True), model=str(checkpoints["wan"]))
    result = record["result"]
    assert record["bench"] == "stepcache" and record["config"]["step_cache"] == "fbcache:0.15"
    assert record["config"]["family"] == "wan" and "--step-cache fbcache:0.15 --steps 6" in record["command"]
    assert 0 < result["full_steps"] < STEPS and result["calibration_s"] > 0
    assert 1 < result["bound"] <= STEPS / result["full_steps"]  # a cached step costs more than nothing
    assert 0 < result["ssim"] <= 1 and math.isfinite(result["psnr_db"]) and result["plain_s"] > 0 < result["cached_s"]
    assert cli.main(["bench", "stepcache", "wan", "--preset", "tiny", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().endswith("give --step-cache SPEC (e.g. fbcache:0.05, magcache:0.06@cal.json, "
                                                   "deepcache:11:45:4)")


# --- every family: the two programs, their FLOPs, and HunyuanVideo-1.5 -------------------------------

@pytest.mark.parametrize("name", ["cogvideox", "wan", "hunyuan"])
def test_the_speedup_bound_comes_from_the_compiled_programs_flops(name):
    """Each method's cached step counts fewer FLOPs than its full step in XLA's cost analysis
    (the tiny configs, planned on `meta`); the bound for a schedule follows from them."""
    import importlib

    import jax

    from tpupedia import bench, devices

    family = importlib.import_module(f"tpupedia.models.{name}")
    pipeline = importlib.import_module(f"tpupedia.pipelines.{name}")
    configs = family.component_configs(str(family.tiny_checkpoint()))
    mesh = devices.make_mesh(pipeline.common.default_mesh_shape(jax.device_count()), ("dp", "tp"))
    bounds = {}
    for text in ("fbcache:full=0,2,4", "magcache:full=0,2,4", "deepcache:full=0,2,4"):
        request = pipeline.Request(prompt="a fox", **(family.default_request(TINY) | {
            "steps": STEPS, "step_cache": stepcache.parse_step_cache(text)}))
        record = bench.step_cache_bound(name, request, pipeline.Options(quiet=True), configs, mesh)
        assert 0 < record["cached_flops"] < record["full_flops"], record
        assert record["full_steps"] == 3 and 1 < record["bound"] <= 2, record
        bounds[text.split(":")[0]] = round(record["bound"], 3)
    print(f"{name}: speed-up bound for 3 full steps of 6, from the FLOPs: {bounds}")


def test_hunyuan_takes_a_step_cache(tmp_path):
    """HunyuanVideo-1.5 (no diffusers hook to compare with; the block caching is the same code
    whose replay equals stock's hooks for CogVideoX and Wan): a cached schedule runs its two
    programs and changes the latents; `--deepcache` and `--step-cache` are one at a time."""
    from safetensors.numpy import load_file

    from tpupedia.models import hunyuan as family
    from tpupedia.pipelines import hunyuan

    checkpoint = family.tiny_checkpoint()
    request = hunyuan.Request(prompt="a fox", **(family.default_request(TINY) | {"steps": 4}))

    def latents(step_cache, stages=("denoise",)):  # one workdir: the text stage once, the denoise stage each time
        req = dataclasses.replace(request, step_cache=step_cache and stepcache.parse_step_cache(step_cache))
        for stage in stages:
            reports = hunyuan.run(req, hunyuan.Options(quiet=True), preset=TINY, model=str(checkpoint),
                                  workdir=tmp_path, stage=stage, log=lambda _: None)
        return load_file(tmp_path / "denoise.safetensors")["latents"], reports[-1].timings

    plain, _ = latents(None, ("text", "denoise"))
    cached, timings = latents("fbcache:full=0,2")
    assert timings["full_steps"] == [0, 2] and np.abs(cached - plain).max() > 1e-3
    with pytest.raises(TpupediaError, match="one step cache at a time"):
        hunyuan.validate(dataclasses.replace(request, deepcache=stepcache.Schedule(1, 4, 2),
                                             step_cache=stepcache.StepCache("fbcache", threshold=0.1)),
                         hunyuan.Options())
