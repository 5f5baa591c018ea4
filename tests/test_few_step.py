"""Step-distilled and few-step releases (`--release NAME`, issue 41): each family's table of releases with
their defaults in its module; on the tiny preset a checkpoint of the release's layout and, for Wan 2.2
Lightning, random adapters of the Lightning files' key layout and rank built in code; the few-step run (the
adapters fused, guidance off, the release's scheduler settings) equal to stock diffusers on the same weights;
`plan` for a release with the steps it plans; bad names refused in one line before anything loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_image_to_video import _picture, frames_against_stock, stage_tensors

from tpupedia import devices, families, lora, presets
from tpupedia.cli import main
from tpupedia.models import hunyuan, wan

TINY = presets.get("tiny")


def test_each_release_has_its_defaults_in_its_family_module_with_sources():
    """Wan 2.2 Lightning: 4 steps, guidance 1 for both experts, shift 5, one rank-64 adapter per expert from
    lightx2v/Wan2.2-Lightning; HunyuanVideo-1.5's step-distilled 480p i2v release: 8 steps (4 at its
    fastest), guidance 1, shift 7. Each default is cited; the releases' checkpoints are built in (no download
    to plan them) and the step-distilled one's configs are its layout's."""
    assert families.release_names() == {"cogvideox": (), "hunyuan": ("step-distilled", "step-distilled-4"),
                                        "wan": ("lightning",)}
    lightning = families.few_step("wan", "lightning")
    assert lightning is wan.LIGHTNING and lightning.model == wan.FULL_ID_22 in wan.SPEC.releases
    assert lightning.request_fields() == {"steps": 4, "guidance": 1.0, "guidance_2": 1.0, "shift": 5.0, "solver": "euler"}
    assert [(a.repo, a.filename, a.component, a.rank) for a in lightning.adapters] == [
        ("lightx2v/Wan2.2-Lightning", "Wan2.2-T2V-A14B-4steps-lora-rank64-Seko-V1.1/high_noise_model.safetensors",
         "transformer", 64),
        ("lightx2v/Wan2.2-Lightning", "Wan2.2-T2V-A14B-4steps-lora-rank64-Seko-V1.1/low_noise_model.safetensors",
         "transformer_2", 64)]
    distilled = families.few_step("hunyuan", "step-distilled")
    assert distilled.request_fields() == {"steps": 8, "guidance": 1.0, "shift": 7.0} and distilled.image_to_video
    assert families.few_step("hunyuan", "step-distilled-4").steps == 4
    configs = hunyuan.full_configs(**hunyuan.SPEC.releases[distilled.model])
    assert configs["transformer"]["use_meanflow"] and configs["transformer"]["target_size"] == 640
    assert configs["scheduler"]["shift"] == 7.0 and configs["guider"]["guidance_scale"] == 1.0
    for release in (lightning, distilled):
        assert release.sources and all(len(s) > 40 for s in release.sources)


@pytest.mark.parametrize("argv, named", [
    (["generate", "hunyuan", "--release", "lightning"], "--release 'lightning' is a release of wan"),
    (["generate", "cogvideox", "--release", "step-distilled"], "is a release of hunyuan"),
    (["generate", "wan", "--release", "turbo"], "--release 'turbo' is not a release of wan; its releases: lightning"),
    (["plan", "wan", "--release", "turbo"], "its releases: lightning"),
    (["generate", "hunyuan", "--release", "step-distilled"], "generates from a picture: give --image PICTURE"),
], ids=["another family's", "cogvideox has none", "no such release", "plan too", "i2v without a picture"])
def test_bad_release_names_are_refused_in_one_line_before_anything_loads(argv, named, capsys, monkeypatch):
    from tpupedia.models import checkpoints

    loaded = []
    monkeypatch.setattr(checkpoints, "load_component", lambda *a, **k: loaded.append(a))
    assert main([*argv, "--prompt", "a cat"] if argv[0] == "generate" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
    assert loaded == []


def test_a_release_adapter_that_cannot_be_had_is_one_line_naming_where_to_get_it(monkeypatch):
    """On the full preset the adapters come from the Hub (its cache, else a download); offline and not cached,
    the run stops in one line naming the repository, the file and the command that fetches it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-hub-cache")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    release = families.few_step("wan", "lightning")
    with pytest.raises(families.ReleaseError) as info:
        families.release_adapters("wan", release, release.model, pretrained=True)
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert "hf download lightx2v/Wan2.2-Lightning Wan2.2-T2V-A14B-4steps-lora-rank64-Seko-V1.1/" in message
    assert "--lora PATH@transformer" in message
    assert families.release_adapters("wan", release, release.model, pretrained=True, local_only=True) == (None, None)
    only_low = families.release_adapters("wan", release, release.model, pretrained=True, local_only=True,
                                         skip=("transformer",))
    assert only_low == (None,)


def _wan_request(**changes):
    from tpupedia.pipelines import wan as pipeline

    release = families.few_step("wan", "lightning")
    fields = dict(prompt="a panda playing a guitar", negative_prompt="blurry", frames=9, height=32, width=32, seed=3,
                  fps=8) | release.request_fields()
    return pipeline.Request(**(fields | changes))


def test_lightning_on_tiny_weights_gives_stock_frames(tmp_path):
    """Wan 2.2's two experts (tiny), each with a rank-64 adapter in the Lightning files' key layout built in
    code, fused on the host: 4 steps, guidance off for both experts, the authors' Euler at shift 5 give the
    frames of stock `WanPipeline` with the same files loaded (`load_lora_weights`, `load_into_transformer_2=True`),
    fused, `guidance_scale=guidance_scale_2=1`, its scheduler the same Euler (`schedulers.uniform_euler`; fp32, 1e-4). The adapters
    are not no-ops (both experts' fused weights differ from the checkpoint's), and guidance off means no
    guidance pair."""
    from diffusers import WanPipeline

    from tpupedia.pipelines import schedulers, stages
    from tpupedia.pipelines import wan as pipeline

    release = families.few_step("wan", "lightning")
    source = families.release_checkpoint("wan", release, pretrained=False)
    adapters = families.release_adapters("wan", release, source, pretrained=False)
    assert [a.component for a in adapters] == ["transformer", "transformer_2"]
    from safetensors import safe_open

    with safe_open(adapters[0].path, "pt") as f:
        keys = list(f.keys())
        assert f.get_tensor("diffusion_model.blocks.0.self_attn.q.lora_down.weight").shape[0] == 64
    assert "diffusion_model.blocks.1.ffn.2.lora_up.weight" in keys and "diffusion_model.blocks.0.cross_attn.o.alpha" in keys
    request = _wan_request(lora=adapters)
    reports = pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=source, workdir=tmp_path,
                           log=lambda _: None)
    denoise = {r.stage: r for r in reports}["denoise"]
    assert denoise.timings["steps_per_expert"] == {"transformer": 2, "transformer_2": 2}  # boundary 875 at shift 5
    configs = wan.component_configs(source)
    frames = stages.read(tmp_path, "decode", pipeline.Wan.settings_for(
        source, configs, request, pipeline.Options(), torch.float32, "decode")).tensors["frames"].numpy()
    pipe, call = pipeline.stock(source, request)
    assert isinstance(pipe, WanPipeline) and call["guidance_scale"] == call["guidance_scale_2"] == 1.0
    assert type(pipe.scheduler) is type(schedulers.uniform_euler()) and pipe.scheduler.config.shift == 5.0
    pipe.load_lora_weights(adapters[0].path, adapter_name="high")
    pipe.load_lora_weights(adapters[1].path, adapter_name="low", load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer"], adapter_names=["high"], lora_scale=1.0)
    pipe.fuse_lora(components=["transformer_2"], adapter_names=["low"], lora_scale=1.0)
    pipe.unload_lora_weights()
    from safetensors.torch import load_file

    for component in ("transformer", "transformer_2"):  # the adapters are not no-ops: both experts' weights moved
        stock_q = load_file(Path(source) / component / "diffusion_pytorch_model.safetensors")["blocks.0.attn1.to_q.weight"]
        fused_q = getattr(pipe, component).blocks[0].attn1.to_q.weight.detach()
        assert float((fused_q - stock_q.to(fused_q.dtype)).abs().max()) > 1e-3, component
    expected = pipe(**call).frames[0]
    assert frames.shape == expected.shape == (9, 32, 32, 3)
    error = float(np.abs(frames - expected).max())
    print(f"Lightning, tiny: max abs error vs stock WanPipeline {error:.2e}")
    assert error <= 1e-4 and frames.std() > 0.01


def test_step_distilled_on_tiny_weights_gives_stock_frames(tmp_path):
    """HunyuanVideo-1.5's step-distilled layout (image-to-video, `use_meanflow`) with the release's defaults at
    its fastest (4 steps, guidance 1: no guidance pair, shift 7): stock `HunyuanVideo15ImageToVideoPipeline`'s
    frames within 1e-4 (fp32) from the same weights, picture and seed."""
    from tpupedia.pipelines import hunyuan as pipeline

    release = families.few_step("hunyuan", "step-distilled-4")
    source = families.release_checkpoint("hunyuan", release, pretrained=False)
    assert hunyuan.component_configs(source)["transformer"]["use_meanflow"]
    request = pipeline.Request(prompt="a cat on a skateboard", negative_prompt="blurry", frames=9, seed=7, fps=8,
                               image=_picture(tmp_path / "in.png", 48, 48), **release.request_fields())
    frames_against_stock(pipeline, source, request, tmp_path / "w", (64, 64), "step-distilled-4")
    denoise = stage_tensors(pipeline, tmp_path / "w", source, request, "denoise")
    assert denoise["latents"].shape[0] == 1


def test_generate_prints_what_a_release_applied_and_flags_win(capsys, monkeypatch):
    """`generate --release` runs the release's defaults on the tiny preset's checkpoint of its layout, the
    adapters built in code, and says so in one line; a flag the user gives replaces the release's value and
    the line says whose it was. (The run itself is stubbed: the parity tests above run it.)"""
    from tpupedia.pipelines import wan as pipeline

    seen = []
    monkeypatch.setattr(pipeline, "run", lambda request, options, **kw: seen.append((request, kw)) or [])
    assert main(["generate", "wan", "--preset", "tiny", "--release", "lightning", "--prompt", "a fox", "--steps", "6",
                 "--frames", "5", "--width", "32", "--height", "32"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("release lightning"))
    assert "steps 6 (--steps given; the release's is 4)" in line and "guidance 1.0" in line and "shift 5.0" in line
    assert "@transformer_2" in line and "Euler" in line
    (request, kw), = seen
    assert (request.steps, request.guidance, request.guidance_2, request.shift, request.solver) == (6, 1.0, 1.0, 5.0, "euler")
    assert [a.component for a in request.lora] == ["transformer", "transformer_2"]
    assert kw["model"] == str(wan.tiny_checkpoint(experts=2))


@pytest.mark.skipif(not devices.has_libtpu(), reason="AOT compiles for a TPU need libtpu")
@pytest.mark.parametrize("family, release", [("wan", "lightning"), ("hunyuan", "step-distilled")])
def test_plan_runs_for_a_release_on_its_tiny_checkpoint_and_prints_its_steps(family, release, tmp_path, capsys):
    """`tpupedia plan FAMILY --release NAME --model TINY`: the release's defaults, the denoising step compiled
    for a v6e slice and called the release's number of times (Lightning: both experts, 4 steps in all,
    no guidance pair), and the step count in the release's line."""
    chosen = families.few_step(family, release)
    source = families.release_checkpoint(family, chosen, pretrained=False)
    argv = ["plan", family, "--release", release, "--model", source, "--topology", "v6e:2x2", "--stages", "denoise",
            "--frames", "5", "--json", str(tmp_path / "plan.json")]
    argv += ["--image", _picture(tmp_path / "in.png", 32, 32)] if chosen.image_to_video else ["--resolution", "32x32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"release {release} (" in out and f"planned with {chosen.steps} steps" in out
    import json

    record = json.loads((tmp_path / "plan.json").read_text())
    (stage,) = [s for s in record["stages"] if s["stage"] == "denoise"]
    assert sum(p["calls"] for p in stage["programs"]) == chosen.steps
    assert all("guidance pair" not in p["name"] for p in stage["programs"])


def test_the_tiny_lightning_adapters_fit_the_checkpoint_and_its_lora_checks():
    """The adapters built in code pass `tpupedia.lora.check` against the tiny Wan 2.2 checkpoint, each into its
    own expert; swapped, they are still the right shapes (both experts have one shape): the component decides."""
    release = families.few_step("wan", "lightning")
    source = families.release_checkpoint("wan", release, pretrained=False)
    adapters = families.release_adapters("wan", release, source, pretrained=False)
    lora.check(adapters, wan, wan.component_configs(source))
    one = wan.component_configs(str(wan.tiny_checkpoint()))
    with pytest.raises(lora.LoraError, match="no 'transformer_2'"):
        lora.check(adapters, wan, one)


def test_the_diff_keys_diffusers_leaves_out_of_a_lightx2v_adapter_are_named(tmp_path):
    """lightx2v's adapters carry full differences for norms (`blocks.N.norm3.diff`) and the
    modulation (`.diff_m`) beside their LoRA pairs; diffusers' Wan conversion keeps the pairs and
    the `.diff_b` biases and drops those with a debug line. The fuse is stock's, and a warning
    says how many tensors were left out and names them."""
    import torch
    from safetensors.torch import load_file, save_file

    source = str(wan.tiny_checkpoint())
    config = wan.component_configs(source)["transformer"]
    path = wan.lightning_layout_adapter(config, tmp_path / "lightx2v.safetensors", rank=4)
    state = load_file(str(path))
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    state |= {"diffusion_model.blocks.0.norm3.diff": torch.zeros(dim),
              "diffusion_model.blocks.0.modulation.diff_m": torch.zeros(1, 6, dim),
              "diffusion_model.blocks.0.self_attn.q.diff_b": torch.zeros(dim)}
    save_file(state, str(path))
    with pytest.warns(lora.DroppedKeysWarning, match=r"2 of its \d+ tensors are left out by diffusers' conversion "
                                                     r"\(such as diffusion_model.blocks.0.modulation.diff_m, "
                                                     r"diffusion_model.blocks.0.norm3.diff\)"):
        lora.check([lora.Adapter(str(path))], wan, wan.component_configs(source))


def test_a_style_adapter_stacks_on_the_release_adapters_unless_replacing_them_is_asked(tmp_path, capsys, monkeypatch):
    """`--release lightning --lora STYLE@transformer`: the release's high-noise adapter and the style
    adapter both go into the high-noise expert, the release's first, as diffusers stacks named adapters
    (the fused expert equals stock `WanPipeline`'s with both loaded, `set_adapters` at their scales and
    `fuse_lora`); `--replace-release-lora` leaves the release's adapter for that expert out, and the
    release's line says so. (A style adapter used to replace the release's silently.)"""
    from diffusers import WanPipeline
    from test_lora import _transformer, _wan_community_adapter

    from tpupedia.pipelines import common
    from tpupedia.pipelines import wan as pipeline

    source = str(wan.tiny_checkpoint(experts=2))
    style = _wan_community_adapter(source, tmp_path / "style.safetensors", "transformer", seed=9)
    seen = []
    monkeypatch.setattr(pipeline, "run", lambda request, options, **kw: seen.append(request) or [])
    argv = ["generate", "wan", "--preset", "tiny", "--release", "lightning", "--prompt", "a fox", "--frames", "5",
            "--width", "32", "--height", "32", "--lora", f"{style}:0.7@transformer"]

    def release_line():
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("release lightning"))

    assert main(argv) == 0
    assert "replaced" not in release_line()
    high, low, mine = seen[0].lora
    assert [(a.component, a.scale) for a in (high, low, mine)] == [("transformer", 1.0), ("transformer_2", 1.0),
                                                                   ("transformer", 0.7)]
    assert mine.path == str(style) and str(style) not in (high.path, low.path)
    assert main(argv + ["--replace-release-lora"]) == 0
    assert "the release's adapter for transformer replaced by --lora (--replace-release-lora)" in release_line()
    assert [(a.component, a.path == str(style)) for a in seen[1].lora] == [("transformer_2", False), ("transformer", True)]

    fused = lora.fuse(_transformer(wan, source, "transformer"), [high, mine], wan).state_dict()
    pipe = common.load_stock(WanPipeline, source)
    pipe.load_lora_weights(high.path, adapter_name="high")
    pipe.load_lora_weights(mine.path, adapter_name="style")
    pipe.set_adapters(["high", "style"], [1.0, 0.7])
    pipe.fuse_lora(components=["transformer"])
    pipe.unload_lora_weights()
    stock = pipe.transformer.state_dict()
    plain = _transformer(wan, source, "transformer").state_dict()
    assert list(fused) == list(stock)
    error = max(float((fused[k] - stock[k]).abs().max()) for k in fused)
    assert error <= 1e-6, error  # float32, the two deltas summed in another order
    only_high = lora.fuse(_transformer(wan, source, "transformer"), [high], wan).state_dict()
    key = "blocks.0.attn1.to_q.weight"  # both adapters moved it: neither replaced the other
    assert not torch.equal(fused[key], only_high[key]) and not torch.equal(only_high[key], plain[key])
