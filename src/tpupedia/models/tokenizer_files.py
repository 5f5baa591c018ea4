"""Tokenizer folders in the file formats the released checkpoints ship, built offline.

A tiny checkpoint is only a good stand-in if its tokenizer folder holds the same kind of files as
the real one, because that is where loading fails first: the Hub's CogVideoX tokenizer is a
SentencePiece model (`spiece.model`, `special_tokens_map.json`, `tokenizer_config.json`, no
`tokenizer.json`), which transformers 5 can read only with the `sentencepiece` package installed
(without it, it falls back to a tiktoken reader and raises); HunyuanVideo-1.5's Qwen2.5-VL
tokenizer is byte-level BPE (`tokenizer.json`, `vocab.json`, `merges.txt`) with the chat template
inside `tokenizer_config.json`; Wan's umT5 tokenizer folder holds both `spiece.model` and
`tokenizer.json`. `save_pretrained` in transformers 5.23 writes neither layout (it
writes `tokenizer.json` for T5 and a separate `chat_template.jinja` for Qwen), so the tiny
checkpoints lay their tokenizer folders out here, after `save_pretrained`, and load them through
the same `AutoTokenizer.from_pretrained` call the full checkpoints go through.

Introduced with the full path of notebooks `cogvideox_pipeline` and `hunyuan_video`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

__all__ = ["T5_CORPUS", "T5_EXTRA_IDS", "write_t5_spiece", "write_t5_fast", "write_qwen_bpe", "layout"]

T5_CORPUS = (
    "A panda plays an acoustic guitar in a bamboo forest.",
    "a fox in the snow, a red fox jumps over the lazy dog",
    "a cat on a mat; the quick brown fox: waves, a beach at sunset, city lights at night!",
    "The camera slowly pans across a neon sign that reads \"OPEN\" (close-up), 4K, 24 fps?",
    "zebra, yak, vivid, extreme, quiet jazz - 0123456789",
)
"""What the tiny SentencePiece model is trained on: the course's prompts and every letter, digit
and common punctuation mark, so course prompts tokenize into pieces, not `<unk>`."""
T5_EXTRA_IDS = 100
"""T5's sentinel tokens `<extra_id_0..99>`, appended after the SentencePiece vocabulary (as in
the released tokenizer: 32,000 pieces + 100 = 32,100 ids, embedded in 32,128 rows)."""


def _special_tokens(extra_ids: int) -> dict[str, Any]:
    return {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
            "additional_special_tokens": [f"<extra_id_{i}>" for i in range(extra_ids)]}


def _clear(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():  # whatever save_pretrained left: this folder is the tokenizer's alone
        if path.is_file():
            path.unlink()


def write_t5_spiece(folder: str | Path, *, vocab_size: int = 96, max_length: int = 226,
                    corpus: tuple[str, ...] = T5_CORPUS) -> Path:
    """Train a unigram SentencePiece model on `corpus` (at most `vocab_size` pieces; `<pad>`=0,
    `</s>`=1, `<unk>`=2, no BOS, as T5's) and write a T5 tokenizer folder as the Hub's CogVideoX
    checkpoints have it: `spiece.model`, `special_tokens_map.json`, `tokenizer_config.json`
    (`T5Tokenizer`, 100 extra ids, `model_max_length` = `max_length`), no `tokenizer.json`.
    Deterministic: the same arguments give the same bytes."""
    import sentencepiece as spm

    folder = Path(folder)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 8), model_writer=model, vocab_size=vocab_size, hard_vocab_limit=False,
        model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    _clear(folder)
    (folder / "spiece.model").write_bytes(model.getvalue())
    special = _special_tokens(T5_EXTRA_IDS)
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": T5_EXTRA_IDS, "model_max_length": max_length,
              "legacy": True, "clean_up_tokenization_spaces": True, "sp_model_kwargs": {}, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def write_t5_fast(folder: str | Path, *, max_length: int = 512, corpus: tuple[str, ...] = T5_CORPUS) -> Path:
    """A T5 tokenizer folder as the Wan diffusers checkpoints ship umT5's (`T5TokenizerFast` in
    their `model_index.json`): the SentencePiece model of `write_t5_spiece` *and* its
    `tokenizer.json`, with `special_tokens_map.json` and `tokenizer_config.json`. transformers
    loads the fast tokenizer from `tokenizer.json`; `spiece.model` stays for slow readers."""
    import tempfile

    from transformers import AutoTokenizer

    folder = write_t5_spiece(folder, max_length=max_length, corpus=corpus)
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(folder).save_pretrained(tmp)
        (folder / "tokenizer.json").write_text((Path(tmp) / "tokenizer.json").read_text())
    return folder


def write_qwen_bpe(folder: str | Path, tokenizer: Any) -> Path:
    """Write `tokenizer` (a transformers Qwen2 tokenizer) as Qwen2.5-VL's folder is laid out:
    `tokenizer.json`, `vocab.json`, `merges.txt` and `tokenizer_config.json` holding the chat
    template (no `chat_template.jinja`)."""
    import tempfile

    folder = Path(folder)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        saved = {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}
    _clear(folder)
    model = json.loads(saved["tokenizer.json"])["model"]
    (folder / "tokenizer.json").write_text(saved["tokenizer.json"])
    (folder / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n")
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    config = json.loads(saved["tokenizer_config.json"])
    config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return folder


def layout(folder: str | Path) -> list[str]:
    """The file names in a tokenizer folder, sorted (what the tests compare with the Hub's)."""
    return sorted(p.name for p in Path(folder).iterdir() if p.is_file())
