"""`tpupedia plan`: the pipeline's own programs compiled for a TPU slice, per-stage peaks, refusals."""

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
