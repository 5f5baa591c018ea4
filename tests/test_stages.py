"""Stage files (notebook 06): bit-exact round trips, atomic writes, and every refusal."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tpupedia.pipelines import stages

SETTINGS = {"model": "cogvideox", "source": "preset:tiny", "prompt": "a panda", "seed": 3, "frames": 9}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"latents": torch.randn(1, 4, 4, 4, 4, generator=g).to(torch.bfloat16),
            "frames": torch.rand(9, 32, 32, 3, generator=g)}


def test_round_trip_is_bit_exact_for_bf16_and_fp32(tmp_path):
    tensors = _tensors()
    stages.write(tmp_path, "denoise", tensors, SETTINGS, extra={"timings": {"first_s": 1.0}})
    got = stages.read(tmp_path, "denoise", SETTINGS)
    for name, t in tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)
    assert got.meta["extra"]["timings"] == {"first_s": 1.0}
    assert got.meta["tensors"]["latents"] == {"shape": [1, 4, 4, 4, 4], "dtype": "bfloat16"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["denoise.json", "denoise.safetensors"]  # no temporaries
    assert stages.status(tmp_path, "denoise", SETTINGS) is None


def test_settings_mismatch_names_each_field_and_both_values(tmp_path):
    stages.write(tmp_path, "text", _tensors(), SETTINGS)
    with pytest.raises(stages.StageError) as err:
        stages.read(tmp_path, "text", {**SETTINGS, "seed": 4, "prompt": "a cat"})
    message = str(err.value)
    assert "seed=3 in the file, seed=4 in this run" in message
    assert "prompt='a panda' in the file, prompt='a cat' in this run" in message
    assert "frames" not in message  # only what differs
    assert stages.status(tmp_path, "text", {**SETTINGS, "seed": 4}).startswith("text.json was made for another request")


def test_missing_truncated_and_edited_files_are_refused(tmp_path):
    with pytest.raises(stages.StageError, match="run the text stage first"):
        stages.read(tmp_path, "text", SETTINGS)
    target = stages.write(tmp_path, "text", _tensors(), SETTINGS)
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(stages.StageError, match="checksum"):
        stages.read(tmp_path, "text", SETTINGS)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # one byte of tensor data changed
    target.write_bytes(bytes(flipped))
    with pytest.raises(stages.StageError, match="checksum"):
        stages.read(tmp_path, "text", SETTINGS)
    target.write_bytes(data)
    twin = tmp_path / "text.json"
    meta = json.loads(twin.read_text())
    meta["settings"]["seed"] = 99  # hand-edited, fingerprint left as it was
    twin.write_text(json.dumps(meta))
    with pytest.raises(stages.StageError, match="edited"):
        stages.read(tmp_path, "text", {**SETTINGS, "seed": 99})
    twin.write_text("{not json")
    with pytest.raises(stages.StageError, match="not a readable stage record"):
        stages.read(tmp_path, "text", SETTINGS)


def test_an_interrupted_write_leaves_the_stage_not_done(tmp_path, monkeypatch):
    real = os.replace

    def fail_on_json(src, dst):
        if str(dst).endswith(".json"):
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_json)
    with pytest.raises(OSError):
        stages.write(tmp_path, "decode", _tensors(), SETTINGS)
    monkeypatch.setattr(os, "replace", real)
    assert not (tmp_path / "decode.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # temporaries removed
    assert "run the decode stage first" in stages.status(tmp_path, "decode", SETTINGS)


def test_bad_stage_names_and_tensors(tmp_path):
    with pytest.raises(stages.StageError, match="'vae' is not one of text, denoise, decode"):
        stages.write(tmp_path, "vae", _tensors(), SETTINGS)
    with pytest.raises(stages.StageError, match="torch tensors"):
        stages.write(tmp_path, "text", {"x": [1, 2]}, SETTINGS)
    assert stages.fingerprint({"a": 1, "b": 2}) == stages.fingerprint({"b": 2, "a": 1})
    assert stages.fingerprint({"a": 1}) != stages.fingerprint({"a": 2})
