import torch

from tpupedia import llm, presets


def test_tiny_checkpoint_roundtrips_through_from_pretrained(tmp_path):
    path = llm.tiny_checkpoint(tmp_path / "ckpt")
    files = {p.name for p in path.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    model, tok = llm.load_causal_lm(presets.get("tiny"), path)
    assert model.dtype == torch.float32 and not model.training
    ids = tok("hello", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "hello"
    assert model(ids).logits.shape == (1, ids.shape[1], 320)


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a, _ = llm.load_causal_lm(presets.get("tiny"), llm.tiny_checkpoint(tmp_path / "a"))
    b, _ = llm.load_causal_lm(presets.get("tiny"), llm.tiny_checkpoint(tmp_path / "b"))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_model_source_per_preset(monkeypatch):
    monkeypatch.delenv(llm.ENV_MODEL, raising=False)
    assert llm.model_source(presets.get("full")) == llm.FULL_MODEL_ID
    monkeypatch.setenv(llm.ENV_MODEL, "some/other-llama")
    assert llm.model_source(presets.get("full")) == "some/other-llama"
    assert llm.model_source(presets.get("tiny")) == "some/other-llama"


def test_offline_tokenizer_covers_every_byte():
    tok = llm.offline_tokenizer()
    text = "TPU v6e — 918 TFLOP/s ✓"
    assert tok.decode(tok(text).input_ids) == text
    assert len(tok) == 259 and tok.pad_token_id == 0 and tok.eos_token_id == 2
