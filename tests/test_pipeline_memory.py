"""Memory that comes back (issue: the full path at real shapes): weights built on their devices
shard by shard, every stage's models freed when it ends, text encoders sharded, and a batch that
loads its models once and keeps live memory flat from one prompt to the next."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from tpupedia import batch, devices, presets, sharding, torchax_utils
from tpupedia.models import cogvideox as cog_family
from tpupedia.models import hunyuan as hy_family
from tpupedia.pipelines import cogvideox, hunyuan

TINY = presets.get("tiny")
REQUEST = cogvideox.Request(prompt="a panda playing a guitar", negative_prompt="blurry", frames=9, height=32,
                            width=32, steps=3, guidance=6.0, seed=3, fps=8)


def _total() -> int:
    return sum(devices.live_bytes().values())


@pytest.fixture(scope="module")
def cog_checkpoint(tmp_path_factory) -> Path:
    return cog_family.tiny_checkpoint(tmp_path_factory.mktemp("cog"))


def _pipe(cls, checkpoint: Path, options=cogvideox.Options(quiet=True)):
    import torch

    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    return cls(str(checkpoint), "tiny", torch.float32, mesh, options)


def test_each_stage_frees_its_models_when_it_ends(cog_checkpoint):
    """After every stage, the devices hold what they held before it: the T5 encoder is gone before
    the transformer loads, the transformer before the VAE. Measured with `jax.live_arrays()`."""
    pipe = _pipe(cogvideox.CogVideoX, cog_checkpoint)
    before = _total()
    seen = {}
    real = sharding.place

    def watched(module, rules, mesh, env=None):  # what the devices hold once a model is placed
        out = real(module, rules, mesh, env)
        seen[type(module).__name__] = _total() - before
        return out

    sharding.place = watched
    try:
        embeds, _ = pipe.encode_text(REQUEST)
        after_text = _total()
        latents, _ = pipe.denoise(REQUEST, embeds)
        after_denoise = _total()
        pipe.decode(REQUEST, latents["latents"])
    finally:
        sharding.place = real
    t5, transformer = seen["T5EncoderModel"], pipe.plans["transformer"].bytes_per_device * len(jax.devices())
    # The transformer was placed on devices that no longer held T5: besides the transformer, only
    # the step's small inputs (scheduler tables) are live, far less than T5.
    assert t5 > 0 and 0 <= seen["CogVideoXTransformer3DModel"] - transformer < t5 / 4, (seen, transformer)
    assert after_text == before and after_denoise == before and _total() == before, (before, after_text, after_denoise)
    assert pipe.plans["text_encoder"].bytes_per_device < pipe.plans["text_encoder"].bytes_total  # T5 is sharded


def test_a_failing_stage_frees_its_models_too(cog_checkpoint):
    pipe = _pipe(cogvideox.CogVideoX, cog_checkpoint)
    before = _total()
    with pytest.raises(KeyError):
        pipe.denoise(REQUEST, {})  # no embeddings: fails after the transformer is placed
    assert _total() == before


def test_text_encoders_are_sharded_over_tp(tmp_path):
    """Qwen2.5-VL's text model (Llama table) and ByT5 (T5 table) are split over `tp` instead of
    replicated on every chip: 15.2 GB and 9.5 GB per chip at full size."""
    checkpoint = hy_family.tiny_checkpoint(tmp_path / "hy")
    pipe = _pipe(hunyuan.Hunyuan, checkpoint, hunyuan.Options(quiet=True))
    request = hunyuan.Request(prompt='a sign that says "hello"', frames=5, height=32, width=32, steps=2, seed=1)
    pipe.encode_text(request)
    for name, weight in (("text_encoder", "layers.0.self_attn.q_proj.weight"),
                         ("text_encoder_2", "encoder.block.0.layer.0.SelfAttention.q.weight")):
        placement = pipe.plans[name][weight]
        assert placement.sharded and placement.shard_shape[0] * 4 == placement.shape[0], (name, placement)
    replicated = _pipe(hunyuan.Hunyuan, checkpoint, hunyuan.Options(quiet=True, sharding="replicated"))
    replicated.encode_text(request)
    assert not any(p.sharded for p in replicated.plans["text_encoder"].placements)


def test_a_batch_loads_once_reuses_the_step_and_stays_flat(cog_checkpoint, tmp_path, monkeypatch):
    """Three prompts in one process: one pipeline, each model loaded once, the denoise step traced
    once, and the devices' live bytes the same after every prompt (nothing piles up)."""
    from diffusers import CogVideoXTransformer3DModel
    from transformers import T5EncoderModel

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\na blue whale\na green parrot\n")
    built, loads, live = [], {"t5": 0, "transformer": 0}, []
    init = cogvideox.CogVideoX.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    def counting(cls, key):
        real = cls.from_pretrained.__func__

        def load(klass, *args, **kwargs):
            loads[key] += 1
            return real(klass, *args, **kwargs)
        return classmethod(load)

    monkeypatch.setattr(cogvideox.CogVideoX, "__init__", counting_init)
    monkeypatch.setattr(T5EncoderModel, "from_pretrained", counting(T5EncoderModel, "t5"))
    monkeypatch.setattr(CogVideoXTransformer3DModel, "from_pretrained", counting(CogVideoXTransformer3DModel,
                                                                                 "transformer"))
    record = batch.record

    def recording(*args, **kwargs):
        live.append(_total())
        return record(*args, **kwargs)

    monkeypatch.setattr(batch, "record", recording)
    torchax_utils.default_env()  # the process's torchax environment (and its PRNG key) outlives any batch
    before = _total()
    lines = []
    base = cogvideox.Request(prompt="-", negative_prompt="blurry", frames=9, height=32, width=32, steps=3, seed=3)
    made = cogvideox.run_batch(prompts, base, cogvideox.Options(quiet=True), preset=TINY, model=str(cog_checkpoint),
                               outdir=tmp_path / "out", log=lines.append)
    assert len(made) == 3 and len(built) == 1
    assert loads == {"t5": 1, "transformer": 1}
    assert built[0].traces == {"text": 1, "image": 0, "denoise": 1}  # one trace each, reused by prompts 2 and 3
    assert live[0] > before and live[0] == live[1] == live[2], live  # resident, and flat across prompts
    assert _total() == before  # the batch's end frees everything
    assert lines[-1].startswith("prompt 1: ") and "prompts 2..3: mean" in lines[-1]


def test_release_keeps_a_resident_pipeline_unless_forced(cog_checkpoint):
    pipe = _pipe(cogvideox.CogVideoX, cog_checkpoint)
    pipe.resident = True
    before = _total()
    pipe.encode_text(REQUEST)
    kept = _total() - before
    assert kept > 0 and pipe.release("text") == 0 and _total() - before == kept
    assert pipe.release("text", force=True) == kept and _total() == before
