"""The tiny checkpoints' tokenizer folders hold the files the released checkpoints ship, and load
through the same call (`tpupedia.models.tokenizer_files`)."""

from __future__ import annotations

import json
import sys

import pytest

from tpupedia.models import cogvideox, hunyuan, tokenizer_files

COGVIDEOX_LAYOUT = ["special_tokens_map.json", "spiece.model", "tokenizer_config.json"]
"""zai-org/CogVideoX1.5-5B/tokenizer on the Hub: a SentencePiece model, no tokenizer.json."""
QWEN_LAYOUT = ["merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
"""Qwen2.5-VL's tokenizer folder: byte-level BPE, the chat template inside tokenizer_config.json."""


@pytest.fixture(scope="module")
def cog(tmp_path_factory):
    return cogvideox.tiny_checkpoint(tmp_path_factory.mktemp("cog")) / "tokenizer"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return hunyuan.tiny_checkpoint(tmp_path_factory.mktemp("hy")) / "tokenizer"


def test_cogvideox_tokenizer_is_a_sentencepiece_folder_with_t5_special_tokens(cog):
    from diffusers import DiffusionPipeline
    from transformers import AutoTokenizer, T5Tokenizer

    assert tokenizer_files.layout(cog) == COGVIDEOX_LAYOUT
    config = json.loads((cog / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "T5Tokenizer" and config["extra_ids"] == 100
    index = DiffusionPipeline.load_config(cog.parent)
    assert index["tokenizer"] == ["transformers", "T5Tokenizer"]  # what the stock pipeline loads
    tok = AutoTokenizer.from_pretrained(cog)  # the pipeline's call
    assert isinstance(tok, T5Tokenizer)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id) == (0, 1, 2, None)
    ids = tok("A panda plays an acoustic guitar.").input_ids
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids  # course prompts are in the vocabulary
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1  # sentinels count down from the end, as T5's
    assert len(tok) <= cogvideox.tiny_text_encoder_config()["vocab_size"]
    padded = tok(["a fox"], padding="max_length", max_length=16, truncation=True).input_ids[0]
    assert len(padded) == 16 and padded[-1] == tok.pad_token_id


def test_the_sentencepiece_model_is_what_needs_the_sentencepiece_package(cog, monkeypatch):
    """Why `sentencepiece` is a dependency: without it this folder (and the Hub's) cannot be read."""
    from transformers import AutoTokenizer
    from transformers.utils import import_utils

    def clear_availability_caches():
        for name in dir(import_utils):
            fn = getattr(import_utils, name)
            if name.startswith("is_sentencepiece_available") and hasattr(fn, "cache_clear"):
                fn.cache_clear()
                yield name

    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "sentencepiece", None)
        for name in list(clear_availability_caches()):
            patch.setattr(import_utils, name, lambda: False)
        with pytest.raises(Exception) as err:
            AutoTokenizer.from_pretrained(cog)
    assert "tiktoken" in str(err.value) or "sentencepiece" in str(err.value).lower(), str(err.value)[:300]
    # Other transformers modules hold the cached check itself, evaluated above with the package
    # hidden: clear it again now that the package is back, or every later load in this process
    # falls back to the tiktoken reader.
    assert list(clear_availability_caches()) and import_utils.is_sentencepiece_available()


def test_the_sentencepiece_model_is_trained_deterministically(tmp_path):
    a = tokenizer_files.write_t5_spiece(tmp_path / "a") / "spiece.model"
    b = tokenizer_files.write_t5_spiece(tmp_path / "b") / "spiece.model"
    assert a.read_bytes() == b.read_bytes() and len(a.read_bytes()) > 100


def test_hunyuan_tokenizer_has_qwens_files_and_its_chat_template_in_the_config(qwen, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    assert tokenizer_files.layout(qwen) == QWEN_LAYOUT
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    tok = AutoTokenizer.from_pretrained(qwen)
    reference = hunyuan.tiny_qwen_tokenizer()
    messages = [{"role": "system", "content": "Describe the video."}, {"role": "user", "content": "a fox in the snow"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>" and tok.bos_token is None
    # vocab.json and merges.txt alone describe the same tokenizer as tokenizer.json
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(qwen / name, tmp_path / name)
    from_files = AutoTokenizer.from_pretrained(tmp_path)
    text = "a fox in the snow, 4K"
    assert from_files(text).input_ids == tok(text).input_ids and len(tok(text).input_ids) == len(text.encode())
