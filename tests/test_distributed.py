"""Multi-controller JAX on one host (notebook 10): `tpupedia launch` runs the CogVideoX pipeline
as 2 processes x 4 devices over one global mesh and writes the frames the 1-process, 8-device run
writes; a failing process is named and stops the job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tpupedia import distributed


def _tpupedia(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TPUPEDIA_PRESET": "tiny", "JAX_PLATFORMS": "cpu", "TPUPEDIA_CACHE": str(cwd / "cache")}
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "tpupedia.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_two_processes_make_the_frames_one_process_makes(tmp_path):
    generate = ["generate", "cogvideox", "--preset", "tiny", "--prompt", "a panda", "--quiet"]
    multi = _tpupedia("launch", "--local-processes", "2", "--devices-per-process", "4", "--",
                      *generate, "--workdir", "multi", cwd=tmp_path)
    assert multi.returncode == 0, multi.stdout[-3000:] + multi.stderr[-3000:]
    single = _tpupedia(*generate, "--workdir", "single", cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    for stage, name in (("text", "prompt_embeds"), ("denoise", "latents"), ("decode", "frames")):
        a = load_file(tmp_path / "multi" / f"{stage}.safetensors")[name]
        b = load_file(tmp_path / "single" / f"{stage}.safetensors")[name]
        error = float((a.float() - b.float()).abs().max())
        assert error <= 1e-5, (stage, error)
    meta = (tmp_path / "multi" / "denoise.json").read_text()
    assert '"processes": 2' in meta and '"devices": 8' in meta  # one mesh over both processes
    assert not list((tmp_path / "multi").glob(".*.tmp"))


def test_a_failing_process_is_named_and_the_job_stops(tmp_path):
    done = _tpupedia("launch", "--local-processes", "2", "--devices-per-process", "1", "--",
                     "generate", "cogvideox", "--preset", "tiny", "--prompt", "x", "--frames", "10", cwd=tmp_path)
    assert done.returncode == 2
    assert "[p0] tpupedia generate: frames=10" in done.stderr and "[p1] tpupedia generate: frames=10" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("tpupedia launch: process ")
    assert "exited with status 2" in done.stderr


def test_initialize_refuses_bad_variables(monkeypatch):
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    monkeypatch.setattr("tpupedia.devices._backends_initialized", lambda: False)
    with pytest.raises(distributed.DistributedError, match="must be integers"):
        distributed.initialize()
    monkeypatch.setattr("tpupedia.devices._backends_initialized", lambda: True)
    with pytest.raises(distributed.DistributedError, match="already started"):
        distributed.initialize()
    with pytest.raises(distributed.DistributedError, match="nothing to launch"):
        distributed.launch([], 2, 4)


def test_a_batch_is_split_over_the_processes(tmp_path):
    (tmp_path / "p.txt").write_text("a panda\na cat\nrain over a city\n")
    done = _tpupedia("launch", "--local-processes", "2", "--devices-per-process", "4", "--", "generate", "cogvideox",
                     "--preset", "tiny", "--prompts", "p.txt", "--outdir", "out", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:]
    import json

    made_by = {e["index"]: e["process"] for e in map(json.loads, (tmp_path / "out" / "index.jsonl").read_text().splitlines())}
    assert made_by == {0: 0, 1: 1, 2: 0}  # prompt i on process i mod 2, each on its own 4 devices


def test_stop_escalates_to_sigkill_for_a_process_that_ignores_sigterm():
    """What a JAX process in a distributed job does with SIGTERM (its preemption notifier catches
    it): `stop` must still end it within the grace period, not after gloo's timeouts."""
    import signal
    import time

    ignoring = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    assert ignoring.stdout.readline().strip() == "ready"
    start = time.monotonic()
    distributed.stop([ignoring, polite], grace_s=1.0)
    assert time.monotonic() - start < 10
    assert polite.returncode == -signal.SIGTERM and ignoring.returncode == -signal.SIGKILL
