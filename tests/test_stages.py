"""Stage files (notebook `cogvideox_pipeline`): bit-exact round trips, atomic writes, and every refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tpupedia.errors import TpupediaError
from tpupedia.pipelines import stages

SETTINGS = {"model": "cogvideox", "source": "preset:tiny", "prompt": "a panda", "seed": 3, "frames": 9,
            "guidance": 6.0, "transformer": {"layers": 2, "heads": 2}}


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"latents": torch.randn(1, 4, 4, 4, 4, generator=g).to(torch.bfloat16),
            "frames": torch.rand(9, 32, 32, 3, generator=g),
            "ids": torch.arange(7, dtype=torch.int64)}


def _edit_json(workdir: Path, stage: str, change) -> None:
    twin = workdir / f"{stage}.json"
    meta = json.loads(twin.read_text())
    change(meta)
    twin.write_text(json.dumps(meta))


def test_round_trip_is_bit_exact_for_bf16_and_fp32(tmp_path):
    tensors = _tensors()
    tensors["latents"][0, 0, 0, 0, 0] = torch.tensor(1 / 3, dtype=torch.bfloat16)  # not representable in fewer bits
    target = stages.write(tmp_path, "denoise", tensors, SETTINGS, extra={"timings": {"first_s": 1.0}})
    assert target == tmp_path / "denoise.safetensors" == stages.path(tmp_path, "denoise")
    got = stages.read(tmp_path, "denoise", SETTINGS)
    assert set(got.tensors) == set(tensors)
    for name, t in tensors.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t)
    bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)  # noqa: E731
    assert torch.equal(bits(got.tensors["latents"]), bits(tensors["latents"]))
    assert torch.equal(bits(got.tensors["frames"]), bits(tensors["frames"]))
    meta = got.meta
    assert meta["extra"]["timings"] == {"first_s": 1.0}
    assert meta["tensors"]["latents"] == {"shape": [1, 4, 4, 4, 4], "dtype": "bfloat16"}
    assert meta["tensors"]["frames"] == {"shape": [9, 32, 32, 3], "dtype": "float32"}
    assert meta["settings"] == SETTINGS and meta["fingerprint"] == stages.fingerprint(SETTINGS)
    assert meta["format"] == stages.FORMAT and meta["stage"] == "denoise" and len(meta["sha256"]) == 64
    from safetensors import safe_open
    with safe_open(str(target), framework="pt") as fh:  # header metadata: strings only
        assert fh.metadata()["stage"] == "denoise" and fh.metadata()["fingerprint"] == meta["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["denoise.json", "denoise.safetensors"]  # no temporaries
    assert stages.status(tmp_path, "denoise", SETTINGS) is None and stages.done(tmp_path, "denoise", SETTINGS)


def test_fingerprint_is_canonical_and_short():
    a = stages.fingerprint({"a": 1, "b": {"x": [1, 2], "y": "é"}})
    assert a == stages.fingerprint({"b": {"y": "é", "x": [1, 2]}, "a": 1})  # key order does not matter
    assert len(a) == 16 and int(a, 16) >= 0
    assert stages.fingerprint({"a": 1}) != stages.fingerprint({"a": 2})
    assert stages.fingerprint({"g": 6}) != stages.fingerprint({"g": 6.0})  # JSON types count
    assert stages.fingerprint({"s": (1, 2)}) == stages.fingerprint({"s": [1, 2]})  # tuples are JSON lists
    assert stages.fingerprint({"d": torch.bfloat16, "p": Path("x"), "n": np.int64(3)}) == \
        stages.fingerprint({"d": "bfloat16", "p": "x", "n": 3})
    with pytest.raises(stages.StageError, match="cannot be written as JSON"):
        stages.fingerprint({"bad": object()})


def test_settings_mismatch_names_each_field_and_both_values(tmp_path):
    stages.write(tmp_path, "text", _tensors(), SETTINGS)
    other = {**SETTINGS, "seed": 4, "prompt": "a cat", "guidance": 6, "steps": 50,
             "transformer": {"layers": 3, "heads": 2}}
    with pytest.raises(stages.StageError) as err:
        stages.read(tmp_path, "text", other)
    message = str(err.value)
    assert message.startswith("text.json was made for another request")
    assert "seed=3 in the file, seed=4 in this run" in message
    assert "prompt='a panda' in the file, prompt='a cat' in this run" in message
    assert "guidance=6.0 in the file, guidance=6 in this run" in message  # equal in Python, not in JSON
    assert "steps=(absent) in the file, steps=50 in this run" in message
    assert "transformer.layers=2 in the file, transformer.layers=3 in this run" in message  # nested: dotted
    assert "frames" not in message and "heads" not in message  # only what differs
    assert "--force" in message and "--workdir" in message
    assert stages.status(tmp_path, "text", other) == message
    assert not stages.done(tmp_path, "text", other)
    assert stages.done(tmp_path, "text", dict(reversed(list(SETTINGS.items()))))  # order does not matter


def test_missing_truncated_and_flipped_files_are_refused(tmp_path):
    with pytest.raises(stages.StageError, match="run the text stage first"):
        stages.read(tmp_path / "nowhere", "text", SETTINGS)
    target = stages.write(tmp_path, "text", _tensors(), SETTINGS)
    data = target.read_bytes()
    for damaged in (data[: len(data) // 2], data[:100], b""):  # truncated
        target.write_bytes(damaged)
        with pytest.raises(stages.StageError, match="checksum"):
            stages.read(tmp_path, "text", SETTINGS)
        assert not stages.done(tmp_path, "text", SETTINGS)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF  # one byte of tensor data changed
    target.write_bytes(bytes(flipped))
    with pytest.raises(stages.StageError, match="does not match the checksum in text.json"):
        stages.read(tmp_path, "text", SETTINGS)
    assert "checksum" in stages.status(tmp_path, "text", SETTINGS)
    target.unlink()
    with pytest.raises(stages.StageError, match="text.safetensors is missing"):
        stages.read(tmp_path, "text", SETTINGS)
    target.write_bytes(data)
    assert stages.done(tmp_path, "text", SETTINGS)


def test_hand_edited_json_is_refused_naming_the_field(tmp_path):
    stages.write(tmp_path, "denoise", _tensors(), SETTINGS)
    _edit_json(tmp_path, "denoise", lambda m: m["settings"].update(seed=99))  # fingerprint left as it was
    with pytest.raises(stages.StageError) as err:
        stages.read(tmp_path, "denoise", SETTINGS)
    assert "denoise.json was edited" in str(err.value) and "seed=99 in the file, seed=3 in this run" in str(err.value)
    with pytest.raises(stages.StageError, match="was edited"):  # even when the run asks for the edited value
        stages.read(tmp_path, "denoise", {**SETTINGS, "seed": 99})
    assert not stages.done(tmp_path, "denoise", {**SETTINGS, "seed": 99})

    stages.write(tmp_path, "denoise", _tensors(), SETTINGS)
    _edit_json(tmp_path, "denoise", lambda m: m["tensors"]["latents"].update(shape=[1, 4, 4, 4, 2]))
    with pytest.raises(stages.StageError, match=r"denoise.safetensors holds .* but denoise.json lists"):
        stages.read(tmp_path, "denoise", SETTINGS)
    assert not stages.done(tmp_path, "denoise", SETTINGS)  # done() agrees with read() without loading

    for broken in ("{not json", "[1, 2]", json.dumps({"format": stages.FORMAT, "stage": "denoise"})):
        (tmp_path / "denoise.json").write_text(broken)
        with pytest.raises(stages.StageError, match="not a readable stage record"):
            stages.read(tmp_path, "denoise", SETTINGS)
        assert not stages.done(tmp_path, "denoise", SETTINGS)

    stages.write(tmp_path, "denoise", _tensors(), SETTINGS)
    _edit_json(tmp_path, "denoise", lambda m: m.update(stage="decode"))
    with pytest.raises(stages.StageError, match="stage 'decode'; expected"):
        stages.read(tmp_path, "denoise", SETTINGS)


def test_a_tensor_file_from_another_request_is_refused_even_with_a_matching_checksum(tmp_path):
    """Someone copies `text.safetensors` from another run and fixes the checksum in the JSON:
    the header's fingerprint still tells."""
    stages.write(tmp_path / "a", "text", _tensors(), SETTINGS)
    foreign = stages.write(tmp_path / "b", "text", _tensors(), {**SETTINGS, "seed": 5})
    (tmp_path / "a" / "text.safetensors").write_bytes(foreign.read_bytes())
    import hashlib
    _edit_json(tmp_path / "a", "text", lambda m: m.update(sha256=hashlib.sha256(foreign.read_bytes()).hexdigest()))
    with pytest.raises(stages.StageError, match="header says stage='text', fingerprint="):
        stages.read(tmp_path / "a", "text", SETTINGS)
    assert not stages.done(tmp_path / "a", "text", SETTINGS)


def test_an_interrupted_write_leaves_the_stage_not_done(tmp_path, monkeypatch):
    real = os.replace

    def fail_on(suffix):
        def replace(src, dst):
            if str(dst).endswith(suffix):
                raise OSError("disk full")
            return real(src, dst)
        return replace

    monkeypatch.setattr(os, "replace", fail_on(".json"))
    with pytest.raises(OSError, match="disk full"):
        stages.write(tmp_path, "decode", _tensors(), SETTINGS)
    monkeypatch.setattr(os, "replace", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.safetensors"]  # temporaries removed, no twin
    assert "run the decode stage first" in stages.status(tmp_path, "decode", SETTINGS)
    assert not stages.done(tmp_path, "decode", SETTINGS)
    with pytest.raises(stages.StageError, match="run the decode stage first"):
        stages.read(tmp_path, "decode", SETTINGS)

    # A finished stage being rewritten (--force) is not done while the rewrite is under way:
    stages.write(tmp_path, "decode", _tensors(), SETTINGS)
    assert stages.done(tmp_path, "decode", SETTINGS)
    monkeypatch.setattr(os, "replace", fail_on(".safetensors"))
    with pytest.raises(OSError, match="disk full"):
        stages.write(tmp_path, "decode", _tensors(), SETTINGS)
    monkeypatch.setattr(os, "replace", real)
    assert not stages.done(tmp_path, "decode", SETTINGS)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_bad_stage_names_and_tensors(tmp_path):
    for call in (lambda: stages.write(tmp_path, "vae", _tensors(), SETTINGS),
                 lambda: stages.read(tmp_path, "vae", SETTINGS),
                 lambda: stages.status(tmp_path, "vae", SETTINGS),
                 lambda: stages.done(tmp_path, "vae", SETTINGS)):
        with pytest.raises(stages.StageError, match="'vae' is not one of text, image, denoise, decode"):
            call()
    with pytest.raises(stages.StageError, match=r"not tensors: x \(list\)"):
        stages.write(tmp_path, "text", {"x": [1, 2], "y": torch.zeros(1)}, SETTINGS)
    with pytest.raises(stages.StageError, match="non-empty dict"):
        stages.write(tmp_path, "text", {}, SETTINGS)
    with pytest.raises(stages.StageError, match="cannot be written as JSON"):
        stages.write(tmp_path, "text", _tensors(), {**SETTINGS, "model": object()})
    assert list(tmp_path.iterdir()) == []  # nothing written by a refused call
    assert issubclass(stages.StageError, TpupediaError) and issubclass(stages.StageError, ValueError)


def test_importing_stages_does_not_import_jax_or_torch():
    code = ("import sys, tpupedia.pipelines.stages; "
            "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_one_checkpoint_folder_however_spelled_makes_the_same_request(tmp_path, monkeypatch):
    """`--model DIR//ckpt`, `--model DIR/ckpt/` and a relative path to the same folder are one
    checkpoint: stage files name a local folder by its resolved path (they were refused as "made
    for another request"); the folder is still loaded as typed, and a hub id stays as it is."""
    from tpupedia import presets
    from tpupedia.models import checkpoints

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model_index.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TPUPEDIA_NO_SUCH_VARIABLE", raising=False)

    def choose(model):
        return checkpoints.choose_source(presets.get("tiny"), model, "TPUPEDIA_NO_SUCH_VARIABLE", "owner/name",
                                         lambda: tmp_path)

    spellings = [f"{tmp_path}//ckpt", f"{tmp_path}/ckpt/", "ckpt", "./ckpt", ckpt]
    assert [choose(m)[0] for m in spellings] == [str(m) for m in spellings]  # loaded from as typed
    assert {choose(m)[1] for m in spellings} == {str(ckpt.resolve())}
    stages.write(tmp_path / "run", "text", _tensors(), dict(SETTINGS, source=choose(spellings[0])[1]))
    for model in spellings[1:]:
        assert stages.status(tmp_path / "run", "text", dict(SETTINGS, source=choose(model)[1])) is None, model
    assert checkpoints.source_label("owner/name") == "owner/name"  # a hub id: no such folder here


@pytest.mark.parametrize("libtpu", [None, "0.0.42.1"], ids=["without-libtpu", "with-libtpu"])
def test_every_stage_file_records_the_library_versions(tmp_path, monkeypatch, libtpu):
    """A stage's JSON twin says which torch, jax, jaxlib, torchax, diffusers and transformers
    made its tensors (and libtpu, where it is installed): `run_stages` records `machine()`."""
    from types import SimpleNamespace

    from tpupedia import results
    from tpupedia.pipelines import common

    monkeypatch.setattr(results, "version", lambda d: libtpu if d == "libtpu" else f"{d}-1.2.3")

    class Pipe:  # the one text stage of a pipeline, without a model
        options, mesh, plans = common.Options(), SimpleNamespace(shape={"dp": 1, "tp": 1}), {}

        def indivisible_note(self, exclude=()):
            return ""

        def settings(self, stage, request):
            return dict(SETTINGS, stage=stage)

        def encode_text(self, request):
            return {"prompt_embeds": torch.zeros(1, 2)}, {"first_s": 0.1}

    common.run_stages(Pipe(), common.Request(prompt="a panda"), stage="text", workdir=tmp_path, log=lambda _: None,
                      collective=False)
    recorded = json.loads((tmp_path / "text.json").read_text())["extra"]["machine"]["versions"]
    wanted = {d: f"{d}-1.2.3" for d in ("torch", "jax", "jaxlib", "torchax", "diffusers", "transformers")}
    assert recorded == wanted | ({"libtpu": libtpu} if libtpu else {})


def test_the_denoise_loop_waits_for_the_chips_only_where_it_needs_a_value(monkeypatch):
    """`common.denoise_loop` waits after the first (compiling) call and after the last, and
    dispatches the steps between without waiting; inside `step_times()` it waits after each and
    records every step's seconds, as `tpupedia bench deepcache` needs. Same results either way."""
    import jax
    import jax.numpy as jnp

    from tpupedia.pipelines import common

    waits = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(1) or real_wait(x))
    step = jax.jit(lambda i, x: x * 0.5 + i)
    seen = []
    state, timings = common.denoise_loop(lambda i, x: step(i, x), jnp.ones(4), 6, lambda i, x: seen.append(i))
    assert len(waits) == 2 and seen == list(range(6)) and timings["steps"] == 6 and "step_s" not in timings
    assert timings["first_s"] > 0 and timings["steady_s"] > 0
    waits.clear()
    with common.step_times():
        again, per_step = common.denoise_loop(lambda i, x: step(i, x), jnp.ones(4), 6)
    assert len(waits) == 6 and len(per_step["step_s"]) == 6
    assert jnp.array_equal(state, again)
