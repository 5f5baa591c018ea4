"""The free-TPU track (issue 39): one v5e or v6e chip and v5e's small hosts as plan targets, and
the releases that fit them (CogVideoX-2b, Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B) built in, so planning
them needs no download."""

import pytest

from tpupedia import devices, hardware, plan
from tpupedia.cli import main

requires_libtpu = pytest.mark.skipif(not devices.has_libtpu(), reason="TPU topologies need libtpu")


@pytest.mark.parametrize("name, chips, hosts, bounds", [("v5e:1x1", 1, 1, (1, 1, 1)), ("v6e:1x1", 1, 1, (1, 1, 1)),
                                                        ("v5e:1x2", 2, 1, (1, 2, 1)), ("v5e:2x2", 4, 1, None),
                                                        ("v5e:2x4", 8, 1, (2, 4, 1)), ("v6e:4x4", 16, 4, None)])
def test_one_chip_and_small_v5e_slices_parse_with_their_host_bounds(name, chips, hosts, bounds):
    """A slice on one VM (up to a v5e-8 or v6e-8) is a host of its own shape; a 2x2 is libtpu's
    default host, and a multi-host slice keeps that default (`None`): 4 chips per VM."""
    topo = hardware.parse_topology(name)
    assert (topo.num_chips, topo.hosts, devices.host_bounds(topo)) == (chips, hosts, bounds)


@requires_libtpu
@pytest.mark.parametrize("name, chips, kind", [("v5e:1x1", 1, "TPU v5 lite"), ("v6e:1x1", 1, "TPU v6 lite"),
                                               ("v5e:2x2", 4, "TPU v5 lite"), ("v5e:2x4", 8, "TPU v5 lite")])
def test_libtpu_describes_single_chips_and_v5e_hosts(name, chips, kind):
    found = devices.tpu_topology(name)
    assert len(found) == chips and {d.device_kind for d in found} == {kind}


@requires_libtpu
def test_a_shape_libtpu_refuses_is_one_line_naming_it_and_what_is_allowed(capsys):
    with pytest.raises(hardware.HardwareError) as err:
        devices.tpu_topology("v5e:3x3")
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "'v5e:3x3'" in message and "v5e:1x1" in message and "v5e:2x4" in message
    assert main(["plan", "cogvideox", "--topology", "v5e:3x3"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("tpupedia plan: topology 'v5e:3x3': libtpu refuses it") and len(line.splitlines()) == 1


@requires_libtpu
def test_one_chip_gets_a_one_by_one_mesh_guidance_pair_or_not():
    """The dp=2 guidance split needs two chips: one chip is dp=1, tp=1, with guidance or without."""
    from tpupedia.pipelines import common

    for guidance_batch in (1, 2):
        assert common.mesh_shape(common.Options(), 1, guidance_batch) == (1, 1)
    mesh = devices.topology_mesh("v5e:1x1", (1, 1), ("dp", "tp"))
    assert dict(mesh.shape) == {"dp": 1, "tp": 1} and mesh.devices.flat[0].device_kind == "TPU v5 lite"


def _parameters(cls, config: dict) -> int:
    import torch

    with torch.device("meta"):
        model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family, model, low, high", [
    ("cogvideox", "zai-org/CogVideoX-2b", 1.68e9, 1.70e9),  # CogVideoX-2b: 1.69 B
    ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 1.41e9, 1.43e9),  # "1.3B": 1.42 B
    ("wan", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", 4.95e9, 5.05e9),  # "5B": 5.00 B
])
def test_the_built_in_small_releases_have_their_released_transformer_sizes(family, model, low, high, monkeypatch):
    """Counted on `meta` from the configs `plan --model ID` uses offline (no weights, no download)."""
    import importlib

    import diffusers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = importlib.import_module(f"tpupedia.pipelines.{family}")
    configs = module.PIPELINE.plan_configs(module.Request(prompt="a video"), model)
    transformer = configs["transformer"]
    cls = getattr(diffusers, "CogVideoXTransformer3DModel" if family == "cogvideox" else "WanTransformer3DModel")
    assert low < _parameters(cls, transformer) < high


def test_the_small_releases_carry_their_own_schedulers_vaes_and_videos():
    """What differs from the 5B/14B releases beyond the transformer: CogVideoX-2b's DDIM scheduler
    (snr shift 3), VAE scale 1.15258426 and no RoPE; Wan 2.2 TI2V's 48-channel 16x VAE, flow
    shift 5 and per-token timesteps; each release's own default video."""
    from tpupedia.models import cogvideox, wan
    from tpupedia.pipelines import cogvideox as cog_pipeline
    from tpupedia.pipelines import wan as wan_pipeline

    cog = cogvideox.full_configs(size="2b")
    assert cog["scheduler"]["_class_name"] == "CogVideoXDDIMScheduler" and cog["scheduler"]["snr_shift_scale"] == 3.0
    assert cog["vae"]["scaling_factor"] == 1.15258426
    assert cog["transformer"]["use_rotary_positional_embeddings"] is False and cog["transformer"]["patch_size_t"] is None
    ti2v = wan.full_configs(size="5B")
    assert wan.shape_facts(ti2v) == wan.ShapeFacts(spatial=16, temporal=4, patch=2, patch_t=1, latent_channels=48)
    assert ti2v["scheduler"]["flow_shift"] == 5.0 and ti2v["pipeline"]["expand_timesteps"] is True
    assert len(ti2v["vae"]["latents_mean"]) == len(ti2v["vae"]["latents_std"]) == 48
    small = wan.full_configs(size="1.3B")
    assert small["vae"] == wan.full_configs()["vae"] and small["scheduler"]["flow_shift"] == 3.0
    assert cog_pipeline.PIPELINE.release_request(cogvideox.SMALL_ID) == dict(frames=49, height=480, width=720, fps=8,
                                                                              steps=50, guidance=6.0)
    assert wan_pipeline.PIPELINE.release_request(wan.SMALL_ID) == dict(frames=81, height=480, width=832, fps=16)
    assert (wan_pipeline.PIPELINE.release_request(wan.TI2V_ID)["width"],
            wan_pipeline.PIPELINE.release_request(wan.TI2V_ID)["frames"]) == (1280, 121)
    # the full preset's own releases at their authors' settings (Wan-Video/Wan2.1 generate.py, Wan2.2's configs)
    assert wan_pipeline.PIPELINE.release_request(wan.FULL_ID) == wan_pipeline.PIPELINE.release_request(None) == {
        "shift": 5.0}
    assert wan_pipeline.PIPELINE.release_request(None, image="p.png") == dict(steps=40, shift=5.0)
    assert wan_pipeline.PIPELINE.release_request(wan.FULL_ID_22) == dict(steps=40, shift=12.0, guidance=4.0,
                                                                          guidance_2=3.0)
    assert cog_pipeline.PIPELINE.release_request(None) == {}  # stock's defaults are CogVideoX1.5's


@requires_libtpu
def test_a_release_text_stage_plans_on_one_v5e_chip_with_its_16_gib():
    """CogVideoX-2b's T5-XXL (one layer compiled, the other 23 layers' weights added) on one v5e
    chip: mesh 1x1, the chip's own HBM as the budget (v5e: 16 GiB, less what the compiler keeps)."""
    from tpupedia.models import cogvideox
    from tpupedia.pipelines import cogvideox as pipeline

    request = pipeline.Request(prompt="a fox", **pipeline.PIPELINE.release_request(cogvideox.SMALL_ID))
    p = plan.make("cogvideox", request, pipeline.Options(), model=cogvideox.SMALL_ID, topology="v5e:1x1", layers=1,
                  stages=("text",))
    assert (p.chips, p.mesh, p.checkpoint) == (1, {"dp": 1, "tp": 1}, cogvideox.SMALL_ID)
    assert 15 * 2**30 < p.hbm <= 16 * 2**30, p.hbm  # 16 GiB of HBM, less what the compiler reserves
    (text,) = p.stage("text").programs
    assert "226 tokens" in text.name and text.weights > 8 * 2**30  # T5-XXL's 4.8 B parameters in bf16, whole
    assert p.fits, p.summary()


def test_splash_blocks_too_large_for_a_v5e_chip_are_named_as_such_and_the_chips_own_fit():
    """Wan2.1-T2V-1.3B's denoising step at 832x480 and 81 frames on one v5e chip, one layer
    compiled. At the blocks tuned for v6e (`models.wan.SPLASH_BLOCK_SIZES`, 2048/2048/512, asked
    with `block_sizes`) the compiler refuses the splash kernel: its tiles need more scoped VMEM
    than v5e's compiler allows (measured here: 23.94 MiB of 16 MiB, libtpu 0.0.42.1). The plan
    says that, not "does not fit in HBM", and its advice names the ways out. Left to itself the
    plan steps the family's blocks down to ones the chip fits (`attention.chip_block_sizes`), and
    the same step fits."""
    from tpupedia import plan
    from tpupedia.models import wan
    from tpupedia.pipelines import wan as pipeline

    request = pipeline.Request(prompt="a fox", width=832, height=480, frames=81)

    def planned(block_sizes=None):
        return plan.make("wan", request, pipeline.Options(block_sizes=block_sizes), model=wan.SMALL_ID,
                         topology="v5e:1x1", layers=1, stages=("denoise",))

    tuned = planned(wan.SPLASH_BLOCK_SIZES)
    (step,) = tuned.stage("denoise").programs
    assert not tuned.fits and step.vmem_required > step.vmem_limit > 0
    assert "scoped VMEM" in tuned.advice() and "such as 1024,1024,512" in tuned.advice()
    assert "--xla_tpu_scoped_vmem_limit_kib=24576" in tuned.advice()
    assert "of scoped VMEM, the limit is" in tuned.summary()
    chosen = planned()
    assert chosen.fits and chosen.attention == "splash 2048/1024/512", chosen.summary()


def _release_requests():
    import importlib

    from tpupedia import families

    for spec in families.video():
        facts = importlib.import_module(spec.pipeline).PIPELINE.family
        for model, fields in getattr(facts, "RELEASE_REQUESTS", {}).items():
            yield spec.name, model, fields


@pytest.mark.parametrize("family_name, model, fields", list(_release_requests()), ids=lambda v: str(v).split("/")[-1])
def test_generate_runs_a_built_in_release_at_its_own_request_as_plan_plans_it(family_name, model, fields, tmp_path,
                                                                              monkeypatch):
    """`generate --model ID` for a built-in release starts from that release's own request
    (`RELEASE_REQUESTS`, with its source), the one `plan --model ID` plans: Wan2.2-TI2V-5B at
    1280x704 (its 16x VAE refuses the full preset's 1280x720), Wan2.1-1.3B and CogVideoX-2b at
    480p, not the big models' sizes; a hub id is a released checkpoint, so the tiny preset's
    request and float32 give way to the full preset's, and the run is told so. A flag the user
    gives still wins. Nothing is downloaded: the release's configs are the built-in ones, and the
    run is stopped where it would begin."""
    import importlib

    from tpupedia import families

    pipeline = importlib.import_module(families.get(family_name, "video").pipeline)
    facts = pipeline.PIPELINE.family
    configs = pipeline.PIPELINE.plan_configs(pipeline.Request(prompt="-"), model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a hub id is checked by its spelling only; nothing is fetched
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(facts, "component_configs", lambda source: configs)
    asked = []
    asked_preset = []
    monkeypatch.setattr(pipeline, "run", lambda request, *a, **k: asked.append(request) or asked_preset.append(k["preset"]))
    argv = ["generate", family_name, "--model", model, "--prompt", "a fox", "--compilation-cache",
            "off", "--quiet", "--workdir", str(tmp_path / "run")]  # a hub id: the full preset's run, from the tiny one
    if facts.image_to_video(configs):  # an image-to-video release generates from a picture
        from PIL import Image

        Image.new("RGB", (64, 48), (200, 120, 40)).save(tmp_path / "picture.png")
        argv += ["--image", str(tmp_path / "picture.png")]
    assert main(argv) == 0
    assert {k: getattr(asked[0], k) for k in fields} == fields
    assert asked_preset[0].pretrained
    planned = facts.default_request(__import__("tpupedia.presets").presets.get("full")) | pipeline.PIPELINE.release_request(model)
    assert {k: getattr(asked[0], k) for k in planned if hasattr(asked[0], k)} == planned  # what `plan --model` starts from
    assert main(argv + ["--frames", "17"]) == 0 and asked[1].frames == 17


def test_a_compilation_cache_the_user_set_is_the_one_a_full_size_run_keeps(tmp_path, monkeypatch):
    """`JAX_COMPILATION_CACHE_DIR` set by the user is where a full-size `generate` keeps its
    compiles (the package's own folder only when it is not set; `--compilation-cache` still wins)."""
    import jax

    from tpupedia.models import checkpoints
    from tpupedia.pipelines import wan as pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path / "cache"))
    configs = pipeline.PIPELINE.plan_configs(pipeline.Request(prompt="-"), pipeline.PIPELINE.family.SMALL_ID)
    monkeypatch.setattr(pipeline.PIPELINE.family, "component_configs", lambda source: configs)
    monkeypatch.setattr(pipeline, "run", lambda request, *a, **k: None)
    set_to = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: set_to.append(value)
                        if name == "jax_compilation_cache_dir" else None)
    argv = ["generate", "wan", "--model", pipeline.PIPELINE.family.SMALL_ID, "--prompt", "a fox", "--quiet"]
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert main(argv) == 0 and set_to == [str(tmp_path / "mine")]
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert main(argv) == 0 and set_to[-1] == str(checkpoints.cache_dir() / "jax-compilation-cache")
    assert main(argv + ["--compilation-cache", str(tmp_path / "given")]) == 0 and set_to[-1] == str(tmp_path / "given")
