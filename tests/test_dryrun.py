import re

import jax
import jax.numpy as jnp
import pytest
import torch
from test_devices import requires_libtpu

from tpupedia import cli, devices, dryrun, families, hardware, torchax_utils
from tpupedia.compat import import_torchax
from tpupedia.models import cogvideox, hunyuan, llama


def test_cogvideox_flops_by_hand():
    # 1280x720, 81 frames: 21 latent frames -> 11 temporal patches x 45 x 80 = 39,600 video tokens + 226 text
    f = cogvideox.step_flops(1280, 720, 81)
    s, d = 39_600 + 226, 3072
    assert f["tokens"] == s
    assert f["linear"] == 2 * 42 * 2 * s * 12 * d * d
    assert f["attention"] == 2 * 42 * 4 * s * s * d
    assert f["total"] == pytest.approx(2.395e15, rel=1e-3)


def test_hunyuan_and_llama_flops_by_hand():
    h = hunyuan.step_flops(1280, 720, 121)
    # 113,585: the video and all three conditioning slots (Qwen2.5-VL, ByT5 and the 729 image
    # slots diffusers keeps), the joint sequence the compiled step runs; upstream's notes count
    # 112,856, without the image slots (hunyuan.UPSTREAM_TEXT_TOKENS)
    assert h["tokens"] == hunyuan.sequence_tokens(1280, 720, 121) == 31 * 45 * 80 + 1000 + 256 + 729 == 113_585
    upstream = hunyuan.step_flops(1280, 720, 121, text_tokens=hunyuan.UPSTREAM_TEXT_TOKENS)
    assert upstream["tokens"] == 112_856 and upstream["total"] < h["total"]
    ll = llama.forward_flops(seq=12, layers=1, hidden=8, mlp=16, vocab=10)
    assert ll["linear"] == 2 * 12 * (4 * 64 + 3 * 8 * 16 + 8 * 10)
    assert ll["attention"] == 4 * 12 * 12 * 8


def test_flop_counter_agrees_with_xla_cost_analysis():
    """The analytic count is matmuls only: XLA's count of the real program is a little higher."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    heads, hd, layers, frames, size, text = 4, 64, 2, 9, 128, 16
    cfg = cogvideox.full_transformer_config(layers)
    cfg.update(num_attention_heads=heads, attention_head_dim=hd, text_embed_dim=256,
               max_text_seq_length=text, sample_height=size // 8, sample_width=size // 8)
    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(**cfg).eval()
    grid = (size // 16, size // 16)
    rope = get_3d_rotary_pos_embed(embed_dim=hd, crops_coords=None, grid_size=grid, temporal_size=2,
                                   grid_type="slice", max_size=grid)
    with torchax_utils.default_env():
        weights, forward = import_torchax().extract_jax(model)
    x = jnp.zeros((2, 4, 16, size // 8, size // 8))
    c = jnp.zeros((2, text, 256))
    t = jnp.ones((2,), jnp.int32)
    r = tuple(jnp.asarray(v.numpy()) for v in rope)

    def step(w, x, c, t, r):
        return forward(w, (), dict(hidden_states=x, encoder_hidden_states=c, timestep=t, image_rotary_emb=r,
                                   return_dict=False))[0]

    cost = jax.jit(step).lower(weights, x, c, t, r).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    analytic = cogvideox.step_flops(size, size, frames, layers=layers, heads=heads, head_dim=hd, text_tokens=text)
    assert 1.0 <= cost["flops"] / analytic["total"] <= 1.10


def test_step_floors_by_hand():
    """v6e: 918 TFLOP/s, 1638 GB/s HBM, 200 GB/s ICI for a one-axis ring (2 ports x 100 GB/s)."""
    v6e = hardware.chip("v6e")
    f = dryrun.step_floors(flops=8 * 918e12, num_chips=8, chip=v6e, weight_bytes=3 * 1638e9, sent_bytes=8e11)
    assert f["compute"] == pytest.approx(1.0)
    assert f["memory"] == pytest.approx(3.0)
    assert f["communication"] == pytest.approx(4.0)  # 800 GB / 200 GB/s; the bidirectional 800 GB/s would say 1.0
    assert f["communication"] == pytest.approx(8e11 / (2 * 100e9))


def test_recorded_floors_agree_with_the_formula_and_their_stored_bytes():
    """Every recorded dry-run with floors: its ICI floor is its stored bytes sent at the one-axis
    ring's bandwidth, its HBM floor its stored weights at 1638 GB/s, its roofline the largest."""
    from pathlib import Path

    from tpupedia import results

    records = [r for r in results.load(Path(__file__).resolve().parents[1] / dryrun.DEFAULT_RECORDS) if r.get("floors")]
    assert len(records) >= 5
    for r in records:
        chip = hardware.chip(r["chip"])
        assert r["floor_basis"] == {"hbm": chip.hbm_bytes_per_s, "ici": chip.ring_bytes_per_s}
        f = r["floors"]
        assert f["communication"] == pytest.approx(sum(r["collective_bytes"].values()) / 200e9, rel=1e-12)
        assert f["compute"] == pytest.approx(r["flops"]["total"] / (r["num_chips"] * 918e12), rel=1e-12)
        if r["arguments_bytes"] is not None:
            assert f["memory"] == pytest.approx(r["arguments_bytes"] / 1638e9, rel=1e-12)
        assert r["roofline_seconds"] == max(f.values()) and r["bound"] == max(f, key=f.get)


def test_summary_states_the_ici_bandwidth_it_assumed():
    v6e = hardware.chip("v6e")
    floors = dryrun.step_floors(2.4e15, 8, v6e, 4e9, 3e10)
    report = dryrun.DryRunReport(
        model="cogvideox", topology="v6e:2x4", chip="v6e", num_chips=8, mesh={"dp": 2, "tp": 4}, sharding="tp",
        attention="splash", width=1280, height=720, frames=81, tokens=39826, layers_full=42, layers_compiled=1,
        hbm_bytes=31.25 * 2**30, fits=True, arguments_bytes=4e9, temporaries_bytes=1e9, outputs_bytes=1e8,
        oom_required_bytes=None, oom_available_bytes=None, collectives={"all-reduce": 2},
        flops={"tokens": 39826, "linear": 1e15, "attention": 1.4e15, "total": 2.4e15},
        roofline_seconds=max(floors.values()), collective_bytes={"all-reduce": 3e10}, floors=floors,
        bound=max(floors, key=floors.get), floor_basis={"hbm": v6e.hbm_bytes_per_s, "ici": v6e.ring_bytes_per_s})
    line = next(x for x in report.summary().splitlines() if "floors:" in x)
    assert "ICI 0.150 s" in line and "at 200 GB/s, a one-axis ring" in line and line.endswith("compute-bound")


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="sora"), "model 'sora' is not one of"),
    (dict(frames=80), "4n+1 frames"),
    (dict(sharding="zigzag"), "sharding 'zigzag'"),
    (dict(attention="flash"), "attention 'flash'"),
    (dict(resolution="1000x700"), "multiples of 16"),
    (dict(resolution="4k"), "not one of 720p, 480p or WIDTHxHEIGHT"),
    (dict(layers=0), "layers=0"),
    (dict(mesh_shape=(3, 3)), "mesh (3, 3) needs 9 devices; v6e:2x4 has 8"),
    (dict(mask="matrix"), "mask='matrix' is not one of vector for cogvideox"),
    (dict(model="cogvideox-vae", frames=80), "cogvideox-vae needs 4n+1 frames"),
])
def test_bad_requests_fail_before_building(kwargs, message):
    with pytest.raises(dryrun.DryRunError, match=re.escape(message)):
        dryrun.run(**({"model": "cogvideox"} | kwargs))


@pytest.mark.parametrize("name", [s.name for s in families.all_specs() if s.kind != "llm"])
def test_every_video_target_checks_its_frame_rule_before_building(name):
    """Each registered video or VAE target reads its frame rule from its family's facts (a
    family added to the registry cannot reach the dry-run without one)."""
    with pytest.raises(dryrun.DryRunError, match=re.escape(f"frames=80: {name} needs 4n+1 frames")):
        dryrun.run(name, frames=80)


@requires_libtpu
def test_out_of_memory_is_reported_with_the_compilers_figures():
    from tpupedia import attention, torchax_utils

    env = torchax_utils.default_env()
    before = {op: env._ops.get(op) for op in torchax_utils.SDPA_OPS}
    with torchax_utils.restoring_ops(env):
        attention.install_attention(env)  # an override left behind by earlier code must not matter
        r = dryrun.run("cogvideox", resolution="720p", frames=81, attention="reference", layers=1,
                       measured_step_seconds=2.13)
        assert all(env._ops.get(op) is not before[op] for op in torchax_utils.SDPA_OPS)  # still installed
    assert not r.fits and r.arguments_bytes is None
    assert r.oom_required_bytes > r.oom_available_bytes == pytest.approx(31.25 * 2**30)
    assert r.mfu == pytest.approx(r.flops["total"] / (2.13 * 8 * 918e12))
    assert "does not fit" in r.summary()


@requires_libtpu
def test_shallow_compiles_scale_to_the_same_full_depth_arguments():
    """1 and 2 layers compiled, both scaled to the model's depth, give the same arguments. (Llama-2-7B
    at 128 tokens: the scaling is the dry-run's, not a family's, and this model compiles fastest.)"""
    small = dict(model="llama", seq=128)
    one, two = dryrun.run(**small, layers=1), dryrun.run(**small, layers=2)
    assert one.fits and two.fits
    # both extrapolated to 32 layers: equal up to the layout padding of small tensors
    assert one.arguments_bytes == pytest.approx(two.arguments_bytes, rel=1e-5)
    assert one.temporaries_bytes == two.temporaries_bytes  # reused layer after layer
    assert one.collectives.get("all-reduce", 0) >= 1  # row-parallel projections
    assert "compiled 1 of 32 layers" in one.notes[0] and "full depth may need more" in one.notes[0]


@requires_libtpu
def test_cli_dryrun_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["dryrun", "llama", "--layers", "1", "--seq", "128", "--json", str(out)]) == 0
    assert "llama 128 tokens on v6e:2x4" in capsys.readouterr().out
    import json

    data = json.loads(out.read_text())
    assert data["fits"] and data["layers_compiled"] == 1 and data["layers_full"] == 32


@requires_libtpu
def test_a_splash_dry_run_records_the_block_sizes_it_compiled_with(tmp_path, capsys):
    """The recorded command reproduces the record: it names the block sizes, default or asked."""
    from tpupedia import results
    from tpupedia.models import llama

    records = tmp_path / "dryruns.json"
    base = ["dryrun", "llama", "--layers", "1", "--seq", "256", "--attention", "splash", "--record", str(records)]
    assert cli.main(base) == 0
    assert cli.main([*base, "--block-sizes", "256,256,128"]) == 0
    assert "attention splash (blocks 256/256/128)" in capsys.readouterr().out
    got = {tuple(r["block_sizes"]): r["command"] for r in results.load(records)}
    assert set(got) == {tuple(llama.SPLASH_BLOCK_SIZES), (256, 256, 128)}
    assert all(f"--block-sizes {','.join(map(str, bs))}" in cmd for bs, cmd in got.items())


def test_cli_dryrun_rejects_bad_input_in_one_line(capsys, monkeypatch):
    assert cli.main(["dryrun", "cogvideox", "--frames", "80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpupedia dryrun: frames=80") and "4n+1 frames" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["dryrun", "hunyuan", "--attention", "splash", "--block-sizes", "3072,2048,1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpupedia dryrun: block_kv_compute=1000") and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(devices, "has_libtpu", lambda: False)  # a host without libtpu: one line, no traceback
    assert cli.main(["dryrun", "llama", "--layers", "1", "--seq", "128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpupedia dryrun: ") and "pip install 'jax[tpu]" in err and "Traceback" not in err


def test_vae_dry_run_rejects_bad_sizes_before_building():
    with pytest.raises(dryrun.DryRunError, match="multiples of 16"):
        dryrun.run("cogvideox-vae", resolution="1000x700")
    with pytest.raises(dryrun.DryRunError, match="4n\\+1 frames"):
        dryrun.run("cogvideox-vae", frames=10)
