"""Batch generation (notebook `beyond_one_host`): prompts files, per-prompt outputs that are whole or absent, and
a job killed mid-batch that a rerun finishes with every prompt done exactly once."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpupedia import batch, presets


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


def test_a_prompts_file_is_read_as_utf8_and_any_other_encoding_is_named_in_one_line(tmp_path, monkeypatch, capsys):
    """UTF-8 whatever the locale (a BOM too); a file saved in another encoding is refused in one
    line naming its line and byte, by the library and by `generate --prompts`, before any model loads."""
    good = tmp_path / "good.txt"
    good.write_bytes("\ufeffA fox\nEin Bär im Schnee\n".encode())
    assert [i.prompt for i in batch.read_prompts(good)] == ["A fox", "Ein Bär im Schnee"]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("A fox\nEin Bär im Schnee\n".encode("latin-1"))
    with pytest.raises(batch.BatchError, match=r"^latin\.txt line 2: byte 0xe4 is not UTF-8; save the prompts file as "
                                               r"UTF-8$"):
        batch.read_prompts(latin)
    from tpupedia import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate", "cogvideox", "--preset", "tiny", "--prompts", "latin.txt", "--outdir", "out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "latin.txt line 2: byte 0xe4 is not UTF-8" in err[0], err
    assert not (tmp_path / "out").exists()


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


def test_a_finished_batch_leaves_only_videos_and_records_and_reads_no_stage_file_twice(tmp_path, monkeypatch):
    """Each finished prompt leaves its mp4 and its JSON record (its stage files, a float32 decode
    file of about 1 GB per video at full size, are removed), and the decode file a stage wrote is
    never read back: the video comes from the frames in memory."""
    from tpupedia.models import cogvideox as family
    from tpupedia.pipelines import cogvideox

    reads = []  # every file read whole: a stage file's check (`stages.status`) and load (`stages.read`) both read it so
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or read_bytes(self))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a panda\na cat\nrain over a city\n")
    base = cogvideox.Request(prompt="-", negative_prompt="", frames=5, height=16, width=16, steps=2, seed=3, fps=8)
    made = cogvideox.run_batch(prompts, base, cogvideox.Options(quiet=True), preset=presets.get("tiny"),
                               model=str(family.tiny_checkpoint(tmp_path / "cog")), outdir=tmp_path / "out",
                               log=lambda _: None)
    names = [i.name for i in batch.read_prompts(prompts)]
    assert made == names
    decode_reads = [p for p in reads if p.name == "decode.safetensors"]
    assert decode_reads == [], decode_reads  # each decode file written once, never read back
    left = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*"))
    assert left == sorted(["index.jsonl"] + [f"{n}{ext}" for n in names for ext in (".json", ".mp4")])
    # a prompt whose run was killed after its decode stage: its file is read from disk once, for
    # the check and the video together, and removed with the others
    prompts.write_text(prompts.read_text() + "a fox\n")
    fox = batch.read_prompts(prompts)[-1]
    cogvideox.run(dataclasses.replace(base, prompt="a fox"), cogvideox.Options(quiet=True), preset=presets.get("tiny"),
                  model=str(family.tiny_checkpoint(tmp_path / "cog")), workdir=tmp_path / "out" / ".stages" / fox.name,
                  log=lambda _: None)
    reads.clear()
    made = cogvideox.run_batch(prompts, base, cogvideox.Options(quiet=True), preset=presets.get("tiny"),
                               model=str(family.tiny_checkpoint(tmp_path / "cog")), outdir=tmp_path / "out",
                               log=lambda _: None)
    assert made == [fox.name]
    assert sorted(p.name for p in reads if p.parent.name == fox.name) == [  # each checked once, decode loaded from that
        f"{s}.safetensors" for s in ("decode", "denoise", "text")]
    assert not (tmp_path / "out" / ".stages").exists()


def test_the_processes_of_a_job_each_append_to_their_own_index_and_process_0_merges_them(tmp_path, monkeypatch):
    """A Cloud Storage FUSE mount loses lines that several hosts append to one file: each process
    of a job appends only to `index.<process>.jsonl`; `manifest` reads them merged, and process
    0's `gather_manifest` writes `index.jsonl` alone from every process's lines."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a panda\na cat\nrain over a city\na boat\n")
    out = tmp_path / "out"
    out.mkdir()
    appended, real_open = {}, os.open

    def opening(path, flags, *args):
        if flags & os.O_APPEND:
            appended.setdefault(Path(path).name, set()).add(writer)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", opening)
    for item in batch.read_prompts(prompts):
        writer = item.index % 2
        batch.record(out, item, "f", lambda p: p.write_bytes(b"mp4"), {"seed": item.index, "process": writer},
                     process=writer, processes=2)
    assert all(len(writers) == 1 for writers in appended.values()), appended  # one writer per file
    assert "index.jsonl" not in appended
    assert [(e["index"], e["process"]) for e in batch.manifest(out)] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    texts = [(out / batch.manifest_file(p, 2)).read_text() for p in (0, 1)]  # what each process gathers
    for p in (0, 1):
        (out / batch.manifest_file(p, 2)).unlink()
    batch.gather_manifest(out, texts)
    lines = [json.loads(x) for x in (out / "index.jsonl").read_text().splitlines()]
    assert [(e["index"], e["seed"]) for e in lines] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert batch.manifest(out) == lines


def test_a_batchs_checks_read_the_checkpoints_configs_once(tmp_path, monkeypatch):
    """The full-size pre-run check of every line of a batch on one checkpoint (`run_batch`, as
    `tpupedia generate --prompts` calls it) reads its configs from the Hub once, not once per line
    (thousands of requests; one rate-limit answer ends it), and plans each line with them for one
    process's own chips, models resident; a line that will not fit refuses the batch, naming it,
    before anything is built."""
    import jax

    from tpupedia import plan
    from tpupedia.errors import TpupediaError
    from tpupedia.pipelines import cogvideox

    family, reads, planned = cogvideox.PIPELINE.family, [], []
    configs = family.full_configs()
    monkeypatch.setattr(family, "component_configs", lambda source: reads.append(source) or configs)
    monkeypatch.setattr(cogvideox.PIPELINE, "source", classmethod(lambda cls, preset, model, request:
                                                                  (family.FULL_ID, family.FULL_ID)))  # no Hub here

    def preflight(name, request, options, got, run_devices, **kwargs):
        planned.append((request.seed, got is configs, len(run_devices), kwargs["resident"]))
        if request.seed == 4:  # resident or not
            raise plan.PlanError("cogvideox will not fit: stage decode needs 40.00 GiB")
        return request

    monkeypatch.setattr(plan, "preflight", preflight)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"prompt {i}", "seed": i}) for i in range(5)))
    base = cogvideox.Request(prompt="-", **family.default_request(presets.get("full")))
    with pytest.raises(TpupediaError, match=r"prompt 4 \('prompt 4'\): cogvideox will not fit"):
        cogvideox.run_batch(prompts, base, cogvideox.Options(), preset=presets.get("full"), outdir=tmp_path / "out",
                            log=lambda _: None)
    assert reads == [family.FULL_ID]
    n = len(jax.local_devices())
    assert planned == [(i, True, n, True) for i in range(5)] + [(4, True, n, False)]  # then as a single run
    assert not (tmp_path / "out" / ".stages").exists()  # nothing was built or run


def test_a_batch_whose_models_cannot_all_stay_resident_frees_them_as_a_single_run_does(tmp_path, monkeypatch):
    """HunyuanVideo-1.5 at 720p on a v6e-8: the text encoders, the transformer and the VAE do not
    fit beside each other, but each stage alone does. The batch then runs as a single run does,
    each stage freeing its models for the next (every prompt planned that way, the pipeline not
    resident, said in a line), rather than refusing; and where staying resident would lower Wan's
    float32 VAE to bfloat16, the batch keeps the precision and frees instead."""
    import dataclasses

    from tpupedia import plan
    from tpupedia.pipelines import common, wan

    family = wan.PIPELINE.family
    configs = family.full_configs()
    monkeypatch.setattr(family, "component_configs", lambda source: configs)
    monkeypatch.setattr(wan.PIPELINE, "source", classmethod(lambda cls, preset, model, request:
                                                            (family.FULL_ID, family.FULL_ID)))
    asked, built = [], []

    def preflight(name, request, options, got, run_devices, *, resident, **kwargs):
        asked.append((request.seed, resident))
        if resident and request.seed == 1:
            raise plan.PlanError("wan will not fit: stage text needs 40.00 GiB with the transformer resident")
        return dataclasses.replace(request, vae_dtype="bfloat16") if resident and request.seed == 2 else request

    class Stop(Exception):
        pass

    def first_stage(pipe, request, **kwargs):  # the batch's pipeline, as built and set up: stop here
        built.append(pipe.resident)
        raise Stop

    monkeypatch.setattr(plan, "preflight", preflight)
    monkeypatch.setattr(wan.PIPELINE, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(wan.PIPELINE, "release", lambda self, stage, force=False: 0)
    monkeypatch.setattr(common, "run_stages", first_stage)
    prompts = tmp_path / "p.jsonl"
    full = presets.get("full")
    base = wan.Request(prompt="-", **family.default_request(full))
    lines = []
    for seeds, resident in (([0, 3], True), ([0, 1], False), ([0, 2], False)):
        asked.clear()
        prompts.write_text("\n".join(json.dumps({"prompt": f"prompt {i}", "seed": i}) for i in seeds))
        with pytest.raises(Stop):
            wan.run_batch(prompts, base, wan.Options(), preset=full, outdir=tmp_path / f"out{seeds[1]}", log=lines.append)
        said = any("do not all stay resident" in line for line in lines)
        assert said == (not resident) and built.pop() is resident, (seeds, lines)
        lines.clear()
        if resident:
            assert asked == [(0, True), (3, True)]
        else:  # tried resident, planned as a single run, then every prompt planned that way
            assert asked[-2:] == [(0, False), (seeds[1], False)] and (seeds[1], True) in asked
