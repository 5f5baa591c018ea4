"""`tpupedia.tune`: the settings a user controls ranked by predicted time, and the cheapest slice."""

import pytest

from tpupedia import devices, hardware, plan, tune
from tpupedia.cli import main

pytestmark = pytest.mark.skipif(not devices.has_libtpu(), reason="AOT compiles for a TPU need libtpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tpupedia import presets
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    configs = cogvideox.component_configs(str(cogvideox.tiny_checkpoint(tmp_path_factory.mktemp("cogvideox"))))
    request = pipeline.Request(prompt="a cat", **(cogvideox.default_request(presets.get("tiny")) | {"steps": 3}))
    return configs, request, pipeline.Options(attention="splash")


def test_the_grid_is_every_mesh_the_batch_allows_times_tables_and_blocks():
    grid = tune.settings_grid((3328, 2816, 256), 8, 2, splash=True)
    assert {g["mesh"] for g in grid} == {(1, 8), (2, 4)} and len(grid) == 2 * 2 * 2
    assert {g["sharding"] for g in grid} == {"tp", "fsdp"}
    assert {g["block_sizes"] for g in grid} == {(3328, 2816, 256), (1024, 1024, 512)}
    assert {g["mesh"] for g in tune.settings_grid((1024, 1024, 512), 8, 1, splash=False)} == {(1, 8)}  # no guidance
    assert {g["block_sizes"] for g in tune.settings_grid((1024, 1024, 512), 1, 2, splash=True)} == {(1024, 1024, 512)}


def test_a_search_ranks_the_settings_that_fit_by_their_plans_predicted_time(tiny):
    configs, request, options = tiny
    grid = [{"mesh": (2, 2), "sharding": "tp", "block_sizes": None},
            {"mesh": (1, 4), "sharding": "fsdp", "block_sizes": (128, 128, 128)},
            {"mesh": (4, 1), "sharding": "tp", "block_sizes": None}]  # dp=4 for a batch of 2: refused, kept as said
    ranked = tune.search("cogvideox", request, options, topology="v6e:2x2", grid=grid, configs=configs,
                         stages=("denoise",), dtype="float32")
    fit = [c for c in ranked if c.fits]
    assert len(fit) == 2 and [c.predicted_s for c in fit] == sorted(c.predicted_s for c in fit)
    assert ranked[-1].settings["mesh"] == (4, 1) and ranked[-1].plan is None and "dp" in ranked[-1].error
    best = fit[0]
    again = plan.make("cogvideox", request, tune._options(options, best.settings), configs=configs,
                      topology="v6e:2x2", stages=("denoise",), dtype="float32")
    assert again.predicted_s == pytest.approx(best.predicted_s)  # the rank is the plan's own prediction
    line = tune.command_line("cogvideox", best.settings)
    dp, tp = best.settings["mesh"]
    assert line.startswith(f"tpupedia generate cogvideox --preset full --mesh dp={dp},tp={tp} --sharding ")


def test_the_cheapest_slice_is_priced_from_the_prediction_and_the_listed_price(tiny):
    configs, request, options = tiny
    slices = ("v5e:2x2", "v6e:2x2")
    priced = tune.cheapest("cogvideox", request, options, slices=slices, videos=10, configs=configs,
                           stages=("denoise",), dtype="float32")
    assert sorted(c.topology for c in priced) == sorted(slices) and all(c.fits for c in priced)
    for c in priced:
        chip = hardware.parse_topology(c.topology).chip.name
        assert c.price_per_chip_hour == hardware.PRICES[chip]["on_demand"]
        assert c.dollars_per_video == pytest.approx(4 * c.price_per_chip_hour * (c.video_s + c.compile_s / 10) / 3600)
    assert priced[0].dollars_per_video <= priced[1].dollars_per_video
    fastest = min(priced, key=lambda c: c.video_s)
    tight = tune.cheapest("cogvideox", request, options, slices=slices, deadline=fastest.video_s * 1.0001,
                          configs=configs, stages=("denoise",), dtype="float32", prices={"v5e": 0.0, "v6e": 0.0})
    assert tight[0].topology == fastest.topology  # free, so only the deadline decides
    with pytest.raises(plan.PlanError, match="videos=0"):
        tune.cheapest("cogvideox", request, options, videos=0)


def test_tpu7x_has_no_list_price_and_is_priced_only_at_the_users(tiny):
    """TPU7x is in no price list (`hardware.PRICES`), so `cheapest` leaves its single-host slice out
    unless the user gives a price (`--price tpu7x=DOLLARS`), and then prices its 4 chips at it; a
    bad `--price` is refused naming the item and the chips allowed."""
    configs, request, options = tiny
    assert "tpu7x" not in hardware.PRICES and tune.priced_slices() == tune.SLICES
    assert tune.priced_slices({"tpu7x": 9.0}) == (*tune.SLICES, "tpu7x:2x2x1")
    assert tune.parse_prices(["tpu7x=9", "V6E=2.5"]) == {"tpu7x": 9.0, "v6e": 2.5}
    for bad in ("tpu7x", "tpu7x=0", "tpu7x=free", "v7x=9", "h100=3"):
        with pytest.raises(plan.PlanError, match=f"--price '{bad}'.*tpu7x, v5e, v6e"):
            tune.parse_prices([bad])
    (seven,) = tune.cheapest("cogvideox", request, options, slices=("tpu7x:2x2x1",), prices={"tpu7x": 9.0},
                             configs=configs, stages=("denoise",), dtype="float32")
    assert seven.fits and seven.chips == 4 and seven.price_per_chip_hour == 9.0
    assert seven.dollars_per_video == pytest.approx(4 * 9.0 * (seven.video_s + seven.compile_s) / 3600)


def test_a_missing_price_is_refused_naming_the_chips_that_have_one():
    with pytest.raises(hardware.HardwareError, match="no on_demand price for 'v5p'.*v5e, v6e"):
        hardware.price("v5p")


def test_plan_cheapest_refuses_a_deadline_no_slice_meets(capsys, monkeypatch):
    slow = tune.SliceCost("v6e:2x4", 8, 2.7, 100.0, 60.0, 1, True)
    monkeypatch.setattr(tune, "cheapest", lambda *a, **k: [slow])
    assert main(["plan", "cogvideox", "--cheapest", "--deadline", "10"]) == 2
    err = capsys.readouterr().err
    assert "no slice meets --deadline 10 s: the fastest, v6e:2x4, is predicted at 100.0 s a video" in err


def test_a_diagnosis_names_the_largest_part_of_the_denoising_and_what_moves_it(tiny):
    configs, request, options = tiny
    found = plan.make("cogvideox", request, options, configs=configs, topology="v6e:2x2", stages=("denoise",),
                      dtype="float32")
    parts = tune.stage_parts(found)
    assert sum(parts.values()) == pytest.approx(found.stage("denoise").predicted_s)
    first, *rest = tune.diagnose(found)
    largest = max(parts, key=parts.get)
    assert first.name == {"xla": "compute", "attention": "attention", "ici": "communication"}[largest]
    assert first.settings == tune.SYMPTOMS[first.name][1] and f"{largest} " in first.evidence
    assert all(s.name in ("memory", "compile") for s in rest)
    compile_said = any(s.name == "compile" for s in rest)
    assert compile_said == (found.predicted_compile_s > found.predicted_s)


def test_a_decode_adds_tiling_to_the_grid_and_a_step_cache_is_predicted_beside_the_ranking(tiny):
    configs, request, options = tiny
    grid = tune.settings_grid((1024, 1024, 512), 4, 2, splash=True, tiling=True)
    assert {g["vae_tiling"] for g in grid} == {"off", "on"} and len(grid) == 2 * 2 * 1 * 2  # the blocks given are 1024/1024/512
    settings = {"mesh": (2, 2), "sharding": "tp", "block_sizes": None}
    plain = plan.make("cogvideox", request, options, configs=configs, topology="v6e:2x2", stages=("denoise",),
                      dtype="float32")
    cached = tune.with_step_cache("cogvideox", request, options, settings, topology="v6e:2x2",
                                  cache="deepcache:1:3:3", configs=configs, stages=("denoise",), dtype="float32")
    full, skip = cached.plan.stage("denoise").programs  # a full step (which also keeps the cache) and a cached one
    assert cached.settings["step_cache"] == "deepcache:1:3:3" and full.calls + skip.calls == request.steps
    assert cached.plan.request["step_cache"] == "deepcache:1:3:3" and "step_cache" not in plain.request  # its own run
    assert skip.calls >= 1 and skip.predicted_s < full.predicted_s  # a cached step runs only the last block
    (step,) = plain.stage("denoise").programs
    assert full.predicted_s >= step.predicted_s  # the full step does all the work, and keeps the cache too
    # its splash calls recorded though its shapes were read first (`common.fresh_trace`): the plain step's attention
    assert full.work["attention_flops"] == step.work["attention_flops"] > 0
    assert "--step-cache deepcache:1:3:3" in tune.command_line("cogvideox", cached.settings)
    shallow = tune.with_step_cache("cogvideox", request, options, settings, topology="v6e:2x2", cache="deepcache:1:3:3",
                                   configs=configs, layers=1, stages=("denoise",), dtype="float32")
    assert shallow.fits and shallow.plan.layers == 2  # one block past the cached tail, or nothing to skip


def test_the_cheapest_slice_with_a_search_prices_each_slice_at_its_fastest_setting(tiny):
    configs, request, options = tiny
    grid = [{"mesh": (2, 2), "sharding": "fsdp", "block_sizes": None},
            {"mesh": (2, 2), "sharding": "tp", "block_sizes": None}]
    (priced,) = tune.cheapest("cogvideox", request, options, slices=("v6e:2x2",), searched=True, grid=grid,
                              configs=configs, stages=("denoise",), dtype="float32")
    ranked = tune.search("cogvideox", request, options, topology="v6e:2x2", grid=grid, configs=configs,
                         stages=("denoise",), dtype="float32")
    assert priced.settings == ranked[0].settings and priced.video_s == pytest.approx(ranked[0].predicted_s)
    assert "--topology v6e:2x2" in tune.command_line("cogvideox", priced.settings, "--topology v6e:2x2")


def test_cheapest_quantizes_only_a_slice_the_checkpoints_weights_do_not_fit(tiny, monkeypatch):
    """`cheapest(..., quantize="int8")` (what `plan --cheapest` passes) plans a slice again with
    int8 weights only where the request does not fit in its own dtype: the frames change when
    quantized, so it fixes a slice too small and never wins on one that fits. The slice is made
    too small by a compile budget set between the two plans' peaks, on a tiny transformer widened to
    1024 (16 heads of 64) so that its weights, not its activations, are most of a chip's bytes, as at
    full size (at the tiny preset's width the int8 plan's peak is the larger: the float32 product
    of each scaled matmul outweighs the bytes saved)."""
    configs, request, options = tiny
    configs = configs | {"transformer": configs["transformer"] | {"num_attention_heads": 16, "attention_head_dim": 64}}
    make = dict(configs=configs, stages=("denoise",), dtype="bfloat16")
    bf16 = plan.make("cogvideox", request, options, topology="v6e:2x2", **make)
    int8 = tune.with_quantized("cogvideox", request, options, {}, topology="v6e:2x2", **make)
    assert int8.fits and int8.plan.request["quantize"] == "int8"
    assert int8.plan.stage("denoise").peak < bf16.stage("denoise").peak
    (roomy,) = tune.cheapest("cogvideox", request, options, slices=("v6e:2x2",), quantize="int8", **make)
    assert roomy.fits and "quantize" not in roomy.settings  # bf16 fits: never quantized
    budget = (int8.plan.stage("denoise").peak + bf16.stage("denoise").peak) / 2
    real = plan.memory_budget
    monkeypatch.setattr(plan, "memory_budget", lambda *a: (budget, real(*a)[1]))
    (refused,) = tune.cheapest("cogvideox", request, options, slices=("v6e:2x2",), **make)
    assert not refused.fits and "--quantize int8" in refused.note  # the advice names the fix
    (tight,) = tune.cheapest("cogvideox", request, options, slices=("v6e:2x2",), quantize="int8", **make)
    assert tight.fits and tight.settings == {"quantize": "int8"} and tight.video_s == pytest.approx(int8.predicted_s)
    assert tune.command_line("cogvideox", tight.settings) == "tpupedia generate cogvideox --preset full --quantize int8"


def test_plan_search_sets_int8_weights_beside_its_ranking_and_cheapest_says_where_it_quantized(tiny, capsys,
                                                                                                monkeypatch):
    """`plan --search` ranks settings that keep the frames, then plans the fastest again with
    `--quantize int8` and prints it beside the ranking, as it prints a step cache; `plan --cheapest`
    says on a slice's line when its price is for int8 weights. The searches are replaced by tiny
    plans (a full-size search compiles for hours here); what is checked is what the command prints."""
    configs, request, options = tiny
    make = dict(configs=configs, stages=("denoise",), dtype="bfloat16")
    settings = {"mesh": (2, 2), "sharding": "tp", "block_sizes": None}
    ranked = [tune._planned("cogvideox", request, options, settings, "v6e:2x2", **make)]
    smaller = tune.with_quantized("cogvideox", request, options, settings, topology="v6e:2x2", **make)
    monkeypatch.setattr(tune, "search", lambda *a, **k: ranked)
    monkeypatch.setattr(tune, "with_quantized", lambda *a, **k: smaller)
    monkeypatch.setattr(tune, "with_step_cache", lambda *a, **k: ranked[0])
    assert main(["plan", "cogvideox", "--search", "--topology", "v6e:2x2"]) == 0
    out = capsys.readouterr().out
    peak = max(s.peak for s in smaller.plan.stages) / 2**30
    assert (f"with --quantize int8 (weight-only; it changes the frames: notebook fewer_steps): predicted "
            f"{smaller.predicted_s:.1f} s a video, its largest stage {peak:.2f} GiB per chip") in out
    priced = tune.SliceCost("v5e:1x1", 1, 1.2, 100.0, 60.0, 1, True, settings={"quantize": "int8"})
    monkeypatch.setattr(tune, "cheapest", lambda *a, **k: [priced] if k["quantize"] == "int8" else [])
    assert main(["plan", "cogvideox", "--cheapest"]) == 0
    out = capsys.readouterr().out
    assert "v5e:1x1  1 chips: 100.0 s a video" in out and "int8 weights (--quantize int8: only where bf16" in out
    assert "tpupedia generate cogvideox --preset full --quantize int8 --topology v5e:1x1" in out
