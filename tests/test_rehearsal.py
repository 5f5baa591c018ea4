"""A rehearsal (`tpupedia.rehearsal`, `make rehearse`): every way in plans for the rehearsal's
slice and stops before it loads; a plan that does not fit fails it as it would on the slice; the
driver (`tpupedia.rehearse`) runs the command lines and the notebooks' cells and says which call
planned, which failed and what was not reached.

The wiring tests replace `plan.preflight` with a stand-in that records what it was asked (the
compiles themselves are tested in tests/test_plan.py); one test rehearses a tiny run for real,
compiled for a v6e-8 ahead of time, through the command line."""

from __future__ import annotations

import dataclasses

import pytest

from tpupedia import plan, presets, rehearsal
from tpupedia.pipelines import common


def _stand_in(asked: list, *, fits: bool = True):
    def preflight(family, request, options, configs, run_devices, *, tiling, resident, **kwargs):
        asked.append((family, len(run_devices), run_devices[0].platform, options.mesh, resident))
        if not fits:
            raise plan.PlanError(f"{family} on {len(run_devices)} x {run_devices[0].device_kind} will not fit: "
                                 "stage decode needs 189.00 GiB per chip")
        return dataclasses.replace(request, vae_tiling=True)

    return preflight


@pytest.fixture
def rehearsing(monkeypatch):
    monkeypatch.setenv(rehearsal.ENV, "v6e:2x4")
    monkeypatch.setattr(common, "run_stages", lambda *a, **k: pytest.fail("a rehearsal ran a stage"))
    asked = []
    monkeypatch.setattr(plan, "preflight", _stand_in(asked))
    return asked


def test_a_rehearsed_run_plans_for_the_slice_and_stops_before_it_builds_anything(tmp_path, monkeypatch, rehearsing):
    """`run` under a rehearsal plans even on the tiny preset (which otherwise never plans), for
    the slice's eight TPU devices, not this host's; then stops with what it planned."""
    from tpupedia.pipelines import cogvideox as pipeline

    monkeypatch.setattr(pipeline.CogVideoX, "__init__", lambda *a, **k: pytest.fail("a rehearsal built a pipeline"))
    tiny = presets.get("tiny")
    request = pipeline.Request(prompt="a cat", **pipeline.PIPELINE.family.default_request(tiny))
    with pytest.raises(rehearsal.Rehearsed) as done:
        pipeline.run(request, pipeline.Options(quiet=True), preset=tiny, workdir=tmp_path, log=len, plan="off")
    assert rehearsing == [("cogvideox", 8, "tpu", None, False)]
    assert done.value.caller == "run" and done.value.request.vae_tiling  # the request as planned
    assert str(done.value) == ("rehearsed run: cogvideox at 32x32, 9 frames planned for v6e:2x4, VAE tiling on; "
                               "nothing was loaded (TPUPEDIA_REHEARSE is set)")


def test_a_rehearsed_stage_method_plans_for_the_slice_not_the_pipelines_host_mesh(tmp_path, rehearsing):
    """A pipeline a notebook builds by hand on the host's devices: its first stage method plans
    the request for the slice (the pipeline's mesh shape does not carry over: the slice has other
    devices), then stops, naming the method."""
    import jax

    from tpupedia import devices
    from tpupedia.models import cogvideox as family
    from tpupedia.pipelines import cogvideox as pipeline

    tiny = presets.get("tiny")
    mesh = devices.make_mesh((1, 2), ("dp", "tp"), devices=jax.devices()[:2])
    pipe = pipeline.CogVideoX(str(family.tiny_checkpoint(tmp_path / "ckpt")), "tiny",
                              pipeline.torch_dtype(pipeline.Options(), tiny), mesh, pipeline.Options(quiet=True))
    request = pipeline.Request(prompt="a cat", **family.default_request(tiny))
    with pytest.raises(rehearsal.Rehearsed, match="rehearsed CogVideoX.decode: cogvideox at 32x32"):
        pipe.decode(request, None)
    assert rehearsing == [("cogvideox", 8, "tpu", None, False)]


def test_a_run_that_will_not_fit_fails_the_rehearsal_with_the_plans_own_error(tmp_path, monkeypatch, rehearsing):
    from tpupedia.pipelines import wan as pipeline

    monkeypatch.setattr(plan, "preflight", _stand_in(rehearsing, fits=False))
    tiny = presets.get("tiny")
    request = pipeline.Request(prompt="a cat", **pipeline.PIPELINE.family.default_request(tiny))
    with pytest.raises(plan.PlanError, match="wan on 8 x TPU v6 lite will not fit: stage decode needs 189.00 GiB"):
        pipeline.run(request, pipeline.Options(quiet=True), preset=tiny, workdir=tmp_path, log=len)


def test_a_rehearsal_reads_a_releases_configs_from_the_family_and_fetches_nothing(monkeypatch, rehearsing):
    """Under the full preset a rehearsal plans a release's checkpoint from the configs the family
    builds in: the Hub is not asked for its configs, its sizes or the disk, even offline."""
    from tpupedia.models import checkpoints
    from tpupedia.models import wan as family
    from tpupedia.pipelines import wan as pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("component_configs", ):
        monkeypatch.setattr(family, name, lambda *a, **k: pytest.fail("a rehearsal read a hub checkpoint's configs"))
    monkeypatch.setattr(checkpoints, "check_disk", lambda *a, **k: pytest.fail("a rehearsal checked the disk"))
    full = presets.get("full")
    request = pipeline.Request(prompt="a cat", **family.default_request(full) | pipeline.PIPELINE.release_request(
        family.SMALL_ID))
    with pytest.raises(rehearsal.Rehearsed, match=r"rehearsed run: wan at 832x480, 81 frames planned for v6e:2x4"):
        pipeline.run(request, pipeline.Options(quiet=True), preset=full, model=family.SMALL_ID, log=len)
    assert rehearsing == [("wan", 8, "tpu", None, False)]


def test_tpupedia_generate_rehearses_a_tiny_run_compiled_for_a_v6e_8(tmp_path, monkeypatch, capsys):
    """The command line prints the rehearsal's line and exits 0; the plan it checked compiled the
    tiny run's programs for a v6e-8 ahead of time (kept compiles are read back: tests/aot-kept)."""
    from tpupedia import cli
    from tpupedia.models import checkpoints

    monkeypatch.setattr(checkpoints, "cache_dir", lambda: tmp_path)  # no plan answered from an earlier run
    monkeypatch.setenv(rehearsal.ENV, "v6e:2x4")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(common, "run_stages", lambda *a, **k: pytest.fail("a rehearsal ran a stage"))
    assert cli.main(["generate", "cogvideox", "--prompt", "a cat", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "on 8 x TPU v6 lite (8 chips)" in out and "binding stage: decode; fits" in out
    assert out.strip().splitlines()[-1] == ("tpupedia generate: rehearsed run: cogvideox at 32x32, 9 frames planned "
                                            "for v6e:2x4, VAE tiling off; nothing was loaded (TPUPEDIA_REHEARSE is set)")


LESSON = '''# %%
# %xmode Minimal
from tpupedia import session

preset = session.start()

# %%
import math

figure = a_figure_of_the_video_that_needs_weights  # noqa: F821 - what a rehearsal cannot have

# %%
raise SystemExit("a full-size compile no call needs: left out")

# %%
from tpupedia.pipelines import cogvideox as pipeline

request = pipeline.Request(prompt="a cat" * int(math.sqrt(1)), **pipeline.PIPELINE.family.default_request(preset))
reports = pipeline.run(request, pipeline.Options(quiet=True), preset=preset, workdir="run")

# %%
print("after the last call: not executed")
'''


def test_the_driver_rehearses_a_notebooks_calls_and_the_cells_they_need(tmp_path):
    """Of a lesson, the cells that call a pipeline run under the rehearsal with the cells that bind
    the names they read (a magic line left out); the others (a full-size compile, a plot) do not.
    The call planned, a needed cell that needs what only a run makes is named as not reached, and a
    lesson none of whose calls was reached fails."""
    import jupytext

    from tpupedia import rehearse

    (tmp_path / "lessons").mkdir()
    (tmp_path / "lessons" / "90_demo.py").write_text(LESSON)
    cells = [c.source for c in jupytext.reads(LESSON, fmt="py:percent").cells if c.cell_type == "code"]
    assert rehearse.needed_cells(cells) == [0, 1, 3]
    out = rehearse.rehearse_notebook("90_demo", "v6e:2x4", tmp_path, lessons=tmp_path / "lessons", preset="tiny")
    assert out.ok, out
    assert out.rehearsed == ["cell 4: rehearsed run: cogvideox at 32x32, 9 frames planned for v6e:2x4, VAE tiling "
                             "off; nothing was loaded (TPUPEDIA_REHEARSE is set)"]
    assert out.not_reached == ["cell 2: NameError: name 'a_figure_of_the_video_that_needs_weights' is not defined"]

    (tmp_path / "lessons" / "91_broken.py").write_text(LESSON.replace("from tpupedia.pipelines", "from nowhere"))
    broken = rehearse.rehearse_notebook("91_broken", "v6e:2x4", tmp_path, lessons=tmp_path / "lessons", preset="tiny")
    assert not broken.ok and broken.failed == "notebook 91_broken: none of its calls into a pipeline was reached"


def test_a_command_lines_rehearsal_is_its_last_line_whatever_it_warned():
    """A warning on stderr after the rehearsal's line (HunyuanVideo-1.5's or CogVideoX-2b's 30 heads
    over tp=4 say how they split) does not hide it; a refusal is its one line, a crash its last."""
    from tpupedia import rehearse

    line = "tpupedia generate: rehearsed run: cogvideox at 720x480, 49 frames planned for v6e:2x4, VAE tiling off"
    warned = "AttentionLayoutWarning: 30 heads do not divide mesh axis 'tp' (4)\n  lay = _choose_layout(...)\n"
    ok = rehearse.command_outcome("2b", ["generate"], 0, f"plan: ...\n{line}\n", warned)
    assert ok.ok and ok.rehearsed == [line.removeprefix("tpupedia generate: ")]
    refused = rehearse.command_outcome("2b", ["generate"], 2, "", warned + "tpupedia generate: frames=10: 4n+1\n")
    assert not refused.ok and refused.failed == "tpupedia generate: tpupedia generate: frames=10: 4n+1"
    crashed = rehearse.command_outcome("2b", ["generate"], 1, "", "Traceback ...\nKeyError: 'vae'\n")
    assert crashed.failed.endswith(": KeyError: 'vae'")


def test_every_way_and_notebook_the_driver_lists_exists():
    """The command lines, from the family registry, parse (`tpupedia generate`'s own parser) and
    cover each family's text and image to video, its built-in releases and few-step releases; the
    notebooks are the lessons that call a pipeline."""
    from pathlib import Path

    from tpupedia import cli, families, rehearse

    inputs = {"picture": "p.png", "lora": "s.safetensors", "prompts": "p.txt", "work": "w"}
    parser = cli.build_parser()
    found = rehearse.ways()
    for way in found:
        parser.parse_args(["generate", *[a.format(**inputs) for a in way.args], "--prompt", "x"])
    names = {w.name for w in found}
    for spec in families.video():
        assert f"{spec.name} t2v" in names and all(f"{spec.name} --release {r}" in names for r in spec.few_step)
        assert sum(w.name.startswith(f"{spec.name} --model ") for w in found) == len(spec.releases) - 1 - (
            f"{spec.name} i2v" in names)
    assert len(names) == len(found) and {"--lora", "--step-cache", "--prompts"} <= {w.name.split()[1] for w in found}
    assert rehearse.notebooks() and all(rehearse._CALL.search(Path(f"lessons/{s}.py").read_text())
                                        for s in rehearse.notebooks())


def test_the_recorded_list_is_what_passing_rehearsals_kept(tmp_path):
    """`make rehearse` reruns the ways in a passing rehearsal kept compiles for (`recorded.json`
    in the kept folder); a missing or damaged file lists none, so nothing is assumed kept."""
    from tpupedia import rehearse

    assert rehearse.recorded(tmp_path) == set() == rehearse.recorded(None)
    (tmp_path / rehearse.RECORDED).write_text('{"topology": "v6e:2x4", "recorded": ["a t2v"]}')
    assert rehearse.recorded(tmp_path) == {"a t2v"}
    (tmp_path / rehearse.RECORDED).write_text("{not json")
    assert rehearse.recorded(tmp_path) == set()
