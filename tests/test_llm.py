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
    assert tok.decode(ids[0]) == "<s>hello" and tok.decode(ids[0], skip_special_tokens=True) == "hello"
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
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True) == text
    assert len(tok) == 259


def test_tiny_tokenizer_has_llama2_special_tokens_and_no_pad(tmp_path):
    """Llama-2's tokenizer (meta-llama/Llama-2-7b-hf): <unk>=0, <s>=1 prepended, </s>=2, no pad
    token. The tiny preset's saved and reloaded tokenizer must behave the same, so code that
    assumes a pad token fails in CI, not on the TPU VM."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llm.tiny_checkpoint(tmp_path / "ckpt"))
    assert (tok.unk_token, tok.unk_token_id) == ("<unk>", 0)
    assert (tok.bos_token, tok.bos_token_id) == ("<s>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("</s>", 2)
    assert tok.pad_token is None and tok.pad_token_id is None
    assert tok("hello").input_ids[0] == 1 and tok("hello").input_ids.count(1) == 1


def test_compare_logits_float32_is_absolute():
    ref = torch.randn(1, 6, 320, generator=torch.Generator().manual_seed(0))
    assert llm.compare_logits(ref + 5e-6, ref, "float32").ok
    far = llm.compare_logits(ref + 5e-5, ref, "float32")
    assert not far.ok and abs(far.max_abs - 5e-5) < 1e-6 and far.top1_agree == 6


def test_compare_logits_bfloat16_is_relative_and_checks_top1_where_decided():
    ref = 15 * torch.randn(2, 5, 320, generator=torch.Generator().manual_seed(0))
    one_rounding = llm.compare_logits(ref.to(torch.bfloat16), ref, "bfloat16")
    assert one_rounding.ok and 0 < one_rounding.relative <= 2**-8
    assert not llm.compare_logits(ref * (1 + 2**-3), ref, "bfloat16").ok  # 2^-3 relative: past the bound
    # one position whose top two differ by 6 bfloat16 steps (0.75 at 16): swapping them stays
    # within the relative bound (2^-4 * 16 = 1) but changes the token, which a decided position may not
    close = torch.zeros(3, 320)
    close[:, 7], close[:, 9] = 16.0, 16.0 - 0.75
    swapped = close.clone()
    swapped[1, 7], swapped[1, 9] = 16.0 - 0.75, 16.0
    flipped = llm.compare_logits(swapped, close, "bfloat16")
    assert flipped.decided == 3 and flipped.decided_agree == 2 and flipped.top1_agree == 2
    assert flipped.max_abs <= flipped.bound and not flipped.ok


def test_bf16_step():
    assert list(llm.bf16_step([1.0, 10.0, 16.0, 20.0, -20.0])) == [2**-7, 2**-4, 2**-3, 2**-3, 2**-3]
