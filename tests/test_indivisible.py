"""Tensors that do not divide their mesh axis (notebook `sharding`'s rules): an embedding is replicated and
the plan says so, a matmul weight is refused naming the sizes that would work; HunyuanVideo-1.5
checkpoints with the released ByT5 vocabulary (1510) and a Qwen embedding resized to its tokenizer
(259) give stock frames on a tp of 4; a run keeps exactly the hidden state stock diffusers keeps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tpupedia import devices, presets, sharding
from tpupedia.errors import TpupediaError
from tpupedia.models import hunyuan as family
from tpupedia.pipelines import hunyuan as pipeline
from tpupedia.pipelines import stages

TINY = presets.get("tiny")
REQUEST = pipeline.Request(prompt='a sign that says "HELLO"', negative_prompt="blurry", frames=5, height=64, width=64,
                           steps=2, seed=3, fps=8)
INDIVISIBLE = {"text_encoder_2": {"vocab_size": family.BYT5_VOCAB}, "text_encoder": {"vocab_size": 259}}


def P_(*entries):
    from jax.sharding import PartitionSpec as P

    return P(*entries)


@pytest.fixture(scope="module")
def mesh():
    import jax

    return jax.make_mesh((2, 4), ("dp", "tp"))


def _t5(vocab: int):
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        return T5EncoderModel(T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))


def test_an_embedding_that_does_not_divide_is_replicated_and_recorded(mesh):
    from jax.sharding import PartitionSpec as P

    p = sharding.plan(_t5(family.BYT5_VOCAB), sharding.rules("t5", "tp"), mesh)
    shared = p["shared.weight"]
    assert shared.spec == P(None, None) and shared.asked == P("tp", None) and not shared.sharded
    assert p.indivisible == ["shared.weight"]
    assert p.replicated_bytes == (1510 - 378) * 32 * 4  # whole on each chip, not ceil(1510 / 4) rows
    assert p["encoder.block.0.layer.0.SelfAttention.q.weight"].sharded  # the rest still splits
    note = p.indivisible_note("text_encoder_2")
    assert "text_encoder_2 shared.weight (1510, 32)" in note and "GiB more per chip" in note
    assert "replicated as indivisible" in repr(p)
    assert sharding.plan(_t5(384), sharding.rules("t5", "tp"), mesh).indivisible == []  # 384 divides: split
    assert sharding.indivisible_note({}) == ""


def test_a_matmul_weight_that_does_not_divide_is_refused_naming_the_sizes_that_would(mesh):
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(16, 6, bias=False)

    module = torch.nn.Sequential(Layer())
    with pytest.raises(sharding.ShardingError) as err:
        sharding.plan(module, sharding.rules("llama", "tp"), mesh)
    message = str(err.value)
    assert message.startswith("0.q_proj.weight: dimension 0 has size 6, which mesh axis 'tp' (size 4) does not divide")
    assert "tp=1, 2, 3 or 6 divide 6" in message
    assert isinstance(err.value, TpupediaError)
    with pytest.raises(sharding.ShardingError, match=r"dp x tp = 1, 2, 3 or 6 divide 6"):
        sharding.plan(module, [(r".*q_proj\.weight", P_(("dp", "tp"), None))], mesh)
    # the same weight under a rule that allows it: replicated
    allowed = sharding.plan(module, [sharding.Rule(r".*q_proj\.weight", P_("tp", None), "replicate")], mesh)
    assert allowed.indivisible == ["0.q_proj.weight"]
    with pytest.raises(sharding.ShardingError, match="indivisible='pad'"):
        sharding.Rule("x", P_("tp"), "pad")


def test_rule_tables_keep_what_each_rule_does_and_still_unpack_as_pairs():
    table = sharding.rules("qwen2", "tp", axis="model")
    embed = next(r for r in table if "embed_tokens" in r[0])
    assert embed.indivisible == "replicate" and embed[1] == P_("model", None)
    assert next(r for r in table if "lm_head" in r[0]).indivisible == "refuse"  # a matmul: refused
    assert len(dict(table)) == len(table)  # pairs, as before
    assert sharding.rules({"tp": [(r"a", ("tp",), "replicate")]}, "tp")[0].indivisible == "replicate"


def test_the_release_configs_carry_the_released_byt5_vocabulary():
    assert family.full_text_encoder_configs()["text_encoder_2"]["vocab_size"] == 1510


@pytest.fixture(scope="module")
def indivisible_checkpoint(tmp_path_factory):
    return family.tiny_checkpoint(tmp_path_factory.mktemp("hunyuan-indivisible"), text_encoders=INDIVISIBLE)


def _settings(checkpoint, request, stage):
    return pipeline.Hunyuan.settings_for(str(checkpoint), family.component_configs(str(checkpoint)), request,
                                         pipeline.Options(), torch.float32, stage)


def test_a_checkpoint_with_indivisible_vocabularies_gives_stock_frames(indivisible_checkpoint, tmp_path):
    """ByT5 with the release's 1510 rows (the prompt quotes text, so it runs) and a Qwen2.5-VL
    embedding of 259 rows, on the guidance pair's mesh (dp=2, tp=4): both embeddings replicated,
    one log line names them, and the frames are stock `HunyuanVideo15Pipeline`'s within 1e-4."""
    configs = family.component_configs(str(indivisible_checkpoint))
    assert configs["text_encoder_2"]["vocab_size"] == 1510 and configs["text_encoder"]["vocab_size"] == 259
    pipe, call = pipeline.stock(str(indivisible_checkpoint), REQUEST)
    expected = pipe(**call).frames[0]
    lines = []
    pipeline.run(REQUEST, pipeline.Options(quiet=True), preset=TINY, model=str(indivisible_checkpoint),
                 workdir=tmp_path, log=lines.append)
    notes = [line for line in lines if "replicated" in line]
    assert len(notes) == 1 and notes[0].startswith("text: "), lines
    assert "text_encoder embed_tokens.weight (259, 16)" in notes[0]
    assert "text_encoder_2 shared.weight (1510, 32)" in notes[0] and "GiB more per chip" in notes[0]
    text = stages.read(tmp_path, "text", _settings(indivisible_checkpoint, REQUEST, "text"))
    assert text.tensors["prompt_embeds_mask_2"].sum() > 0  # the quoted text went through ByT5
    frames = stages.read(tmp_path, "decode", _settings(indivisible_checkpoint, REQUEST, "decode")).tensors["frames"]
    error = float(np.abs(frames.numpy() - expected).max())
    assert frames.shape == expected.shape and error <= 1e-4, error
    assert frames.std() > 0.01
    # a batch says it too, once, at the prompt that loads the models (one step: the line comes at loading)
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{REQUEST.prompt}\n{REQUEST.prompt} again\n")
    lines.clear()
    pipeline.run_batch(prompts, dataclasses.replace(REQUEST, steps=1), pipeline.Options(quiet=True), preset=TINY,
                       model=str(indivisible_checkpoint), outdir=tmp_path / "batch", log=lines.append)
    notes = [line for line in lines if "replicated" in line]
    assert len(notes) == 1 and notes[0].startswith("0000-") and "text_encoder_2 shared.weight (1510, 32)" in notes[0], lines


@pytest.mark.skipif(not devices.has_libtpu(), reason="AOT compiles for a TPU need libtpu")
def test_a_plan_of_that_checkpoint_names_the_replicated_tensors(indivisible_checkpoint):
    from tpupedia import plan

    configs = family.component_configs(str(indivisible_checkpoint))
    p = plan.make("hunyuan", REQUEST, pipeline.Options(), configs=configs, topology="v6e:2x4", stages=("text",),
                  dtype="float32")
    assert p.mesh == {"dp": 2, "tp": 4} and p.fits
    assert [n.split(":")[0] for n in p.notes if "replicated" in n] == ["replicated, as their mesh axis does not divide them"]
    assert "text_encoder_2 shared.weight (1510, 32)" in p.summary()


def test_a_two_layer_qwen_text_model_gets_stock_prompt_embeddings(tmp_path):
    """With 2 layers there are 3 hidden states, and stock keeps `hidden_states[-3]` (the
    embeddings' state, num_hidden_layers_to_skip=2): a run keeps the same, not the last."""
    skip = pipeline.prompt_defaults()["num_hidden_layers_to_skip"]
    assert skip == 2
    checkpoint = family.tiny_checkpoint(tmp_path / "ckpt", text_encoders={"text_encoder": {"num_hidden_layers": skip}})
    request = dataclasses.replace(REQUEST, prompt="a fox in the snow", guidance=1.0)
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=str(checkpoint), stage="text",
                 workdir=tmp_path / "w", log=lambda _: None)
    ours = stages.read(tmp_path / "w", "text", _settings(checkpoint, request, "text")).tensors
    pipe, _ = pipeline.stock(str(checkpoint), request)
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(request.prompt, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(ours["prompt_embeds_mask"].bool(), mask.bool())
    assert float((ours["prompt_embeds"] - embeds).abs().max()) <= 1e-5


def test_a_text_model_shallower_than_stock_skips_is_refused():
    configs = {"text_encoder": {"num_hidden_layers": 1}}
    with pytest.raises(pipeline.PipelineError, match=r"1 layer\(s\).*hidden_states\[-3\]"):
        pipeline.check_text_depth(configs)
    pipeline.check_text_depth({"text_encoder": {"num_hidden_layers": 2}})
