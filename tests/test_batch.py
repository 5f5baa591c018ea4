"""Batch generation (notebook 10): prompts files, per-prompt outputs that are whole or absent, and
a job killed mid-batch that a rerun finishes with every prompt done exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpupedia import batch


def test_prompts_files_text_and_jsonl(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("# a comment\nA panda plays guitar!\n\n  Ein Bär im Schnee  \n")
    items = batch.read_prompts(text)
    assert [(i.index, i.name) for i in items] == [(0, "0000-a-panda-plays-guitar"), (1, "0001-ein-bar-im-schnee")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a cat", "seed": 7, "frames": 17}\n{"prompt": "a dog"}\n')
    items = batch.read_prompts(jsonl)
    assert items[0].overrides == (("frames", 17), ("seed", 7)) and items[1].overrides == ()
    assert [i.index for i in batch.share(items * 1, 1, 2)] == [1]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x", "seed": "7"}', "line 2: seed='7' must be int"),
    ('{"prompt": "x", "steps": 3}', "line 2: unknown field 'steps'"),
    ('{"seed": 1}', 'line 2: needs a non-empty "prompt"'),
    ("{not json", "line 2: not JSON"),
])
def test_bad_prompt_lines_are_named(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(batch.BatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        batch.read_prompts(path)


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "TPUPEDIA_PRESET": "tiny", "JAX_PLATFORMS": "cpu", "TPUPEDIA_CACHE": str(tmp_path / "cache")}


def test_a_killed_batch_resumes_and_every_prompt_is_done_once(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "seed": s}) for p, s in
                                 (("a panda", 1), ("a cat on a skateboard", 2), ("rain over a city", 3))) + "\n")
    command = [sys.executable, "-m", "tpupedia.cli", "generate", "cogvideox", "--preset", "tiny",
               "--prompts", str(prompts), "--outdir", "out", "--quiet"]
    job = subprocess.Popen(command, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = tmp_path / "out" / "0000-a-panda.json"
    deadline = time.monotonic() + 300
    while not first.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.poll() is None, job.stderr.read().decode()[-2000:]  # still running: the kill lands mid-batch
    job.send_signal(signal.SIGKILL)
    job.wait()
    done_before = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert "0000-a-panda.json" in done_before and len(done_before) < 3
    rerun = subprocess.run(command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    out = tmp_path / "out"
    items = batch.read_prompts(prompts)
    assert sorted(p.name for p in out.glob("*.mp4")) == [f"{i.name}.mp4" for i in items]
    lines = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    assert sorted(e["index"] for e in lines) == [0, 1, 2]  # once each: the finished prompt was not redone
    assert [e["seed"] for e in sorted(lines, key=lambda e: e["index"])] == [1, 2, 3]
    for item in items:
        meta = json.loads((out / f"{item.name}.json").read_text())
        assert batch.is_done(out, item, meta["fingerprint"]) and meta["process"] == 0
    (out / "0001-a-cat-on-a-skateboard.mp4").write_bytes(b"truncated")  # a damaged output is not "done"
    meta = json.loads((out / "0001-a-cat-on-a-skateboard.json").read_text())
    assert not batch.is_done(out, items[1], meta["fingerprint"])
