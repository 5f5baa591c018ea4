"""Multi-controller JAX on one host (notebook `beyond_one_host`): `tpupedia launch` runs the CogVideoX pipeline
as 2 processes x 4 devices over one global mesh and writes the frames the 1-process, 8-device run
writes, also when the processes share no disk (process 0 decides, every process gets the
tensors); a failing process is named and stops the job."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tpupedia import distributed, files


def _tpupedia(*args: str, cwd: Path, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TPUPEDIA_PRESET": "tiny", "JAX_PLATFORMS": "cpu",
           "TPUPEDIA_CACHE": str(cache or cwd / "cache")}
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "tpupedia.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


GENERATE = ["generate", "cogvideox", "--preset", "tiny", "--prompt", "a panda"]
ALL_STAGES = (("text", "prompt_embeds"), ("denoise", "latents"), ("decode", "frames"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """A folder with `runs/`, the stage files of the 1-process, 8-device run: this test process's
    (its 8 simulated devices), which writes the tiny checkpoint into the model cache
    (`files.cache_dir()`) the launched jobs below share with it."""
    from tpupedia import cli

    root = tmp_path_factory.mktemp("one-process")
    assert cli.main([*GENERATE, "--quiet", "--workdir", str(root / "runs")]) == 0
    return root


def _assert_same_tensors(workdir: Path, reference: Path, stages_and_names) -> None:
    for stage, name in stages_and_names:
        a = load_file(workdir / f"{stage}.safetensors")[name]
        b = load_file(reference / f"{stage}.safetensors")[name]
        error = float((a.float() - b.float()).abs().max())
        assert error <= 1e-5, (stage, error)


def _launch_apart(monkeypatch, cache: Path, hosts: list[Path], *args: str, fails: bool = False) -> str:
    """`launch` of `GENERATE ARGS` as 2 processes x 4 devices, process N in `hosts[N]`, so that
    `--workdir runs` is a different folder for each, as on hosts that share no disk; returns what
    they printed (and with `fails`, the launcher's error). A job stuck in a collective is stopped
    after 300 s and fails the test."""
    for name, value in (("TPUPEDIA_PRESET", "tiny"), ("JAX_PLATFORMS", "cpu"), ("TPUPEDIA_CACHE", str(cache))):
        monkeypatch.setenv(name, value)
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    out, err = io.StringIO(), io.StringIO()
    try:
        distributed.launch([*GENERATE, *args], 2, 4, out=out, err=err, cwds=hosts, timeout_s=300)
    except distributed.DistributedError as error:
        if fails and "still ran after" not in str(error):
            return f"{out.getvalue()}{err.getvalue()}{error}"
        pytest.fail(f"{error}\n{out.getvalue()[-3000:]}\n{err.getvalue()[-3000:]}")
    assert not fails, f"the job should have failed: {out.getvalue()[-3000:]}"
    return out.getvalue()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_processes_that_share_no_disk_make_the_frames_one_process_makes(one_process, tmp_path, monkeypatch):
    """Issue 18: process 1 used to read the stage files process 0 wrote to its own disk, and crash.
    (Two processes that share a disk, as on one host, are notebook `beyond_one_host`'s proof.)"""
    hosts = [tmp_path / "p0", tmp_path / "p1"]
    for host in hosts:
        host.mkdir()
    _launch_apart(monkeypatch, files.cache_dir(), hosts, "--quiet", "--workdir", "runs", "--out", "panda.mp4")
    _assert_same_tensors(hosts[0] / "runs", one_process / "runs", ALL_STAGES)
    meta = (hosts[0] / "runs" / "denoise.json").read_text()
    assert '"processes": 2' in meta and '"devices": 8' in meta  # one mesh over both processes
    assert (hosts[0] / "panda.mp4").stat().st_size > 0 and not list((hosts[0] / "runs").glob(".*.tmp"))
    assert _files(hosts[1]) == []  # process 1 wrote nothing, and read nothing it could not have


def test_a_rerun_where_only_process_0_has_the_files_skips_them_on_every_process(one_process, tmp_path,
                                                                               monkeypatch):
    """Issue 18: every process decided from its own disk what to skip, so process 1 (no files)
    ran the text stage's collectives while process 0 skipped it, and the job hung. Now process 0
    decides, and the decode stage runs on both from the latents process 0 reads and broadcasts."""
    hosts = [tmp_path / "p0", tmp_path / "p1"]
    (hosts[0] / "runs").mkdir(parents=True)
    hosts[1].mkdir()
    for stage in ("text", "denoise"):
        for suffix in (".safetensors", ".json"):
            shutil.copy(one_process / "runs" / f"{stage}{suffix}", hosts[0] / "runs")
    out = _launch_apart(monkeypatch, files.cache_dir(), hosts, "--workdir", "runs")
    assert "[p0] text: up to date" in out and "[p0] denoise: up to date" in out, out[-3000:]
    assert "[p0] decode: wrote" in out, out[-3000:]
    # one voice per job: process 1 logs nothing of its own (the only line it may print is the CPU
    # collectives' transport, gloo inside jaxlib, announcing a connection: " is connected to ")
    quiet = [line for line in out.splitlines() if line.startswith("[p1]") and line.strip() != "[p1]  is connected to"]
    assert quiet == [], quiet
    _assert_same_tensors(hosts[0] / "runs", one_process / "runs", (("decode", "frames"),))
    assert _files(hosts[1]) == []


def test_an_input_process_0_cannot_read_stops_every_process(one_process, tmp_path, monkeypatch):
    """Process 0 reads a skipped stage's tensors for every process; when it cannot (`--stage
    decode` without a denoise stage file), each process fails with the reason, and none waits
    for a broadcast that never comes."""
    hosts = [tmp_path / "p0", tmp_path / "p1"]
    for host in hosts:
        host.mkdir()
    printed = _launch_apart(monkeypatch, files.cache_dir(), hosts, "--quiet", "--workdir", "runs",
                            "--stage", "decode", fails=True)
    assert "exited with status 2" in printed, printed[-3000:]
    assert "[p0] tpupedia generate: denoise.json not found" in printed, printed[-3000:]
    assert ("[p1] tpupedia generate: process 0 failed, so process 1 stops too: StageError: denoise.json not found"
            in printed), printed[-3000:]


@pytest.mark.parametrize("preset, env", [(["--preset", "full"], "tiny"), (["--preset=full"], None), ([], "full")],
                         ids=["flag", "flag=", "environment"])
def test_launch_refuses_the_full_preset_in_one_line_before_any_process_starts(monkeypatch, capsys, preset, env):
    """`launch` runs every process on simulated CPU devices: the full preset's models used to run
    there quietly, for hours. Now it is one line, and nothing starts."""
    from tpupedia import cli, devices

    monkeypatch.setattr(devices, "tpu_present", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    if env is None:
        monkeypatch.delenv("TPUPEDIA_PRESET", raising=False)
    else:
        monkeypatch.setenv("TPUPEDIA_PRESET", env)
    command = [word for word in GENERATE if word not in ("--preset", "tiny")] + preset
    assert cli.main(["launch", "--local-processes", "2", "--", *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tpupedia launch:" in err and "full preset" in err and "no TPU" in err, err
    monkeypatch.setenv("TPUPEDIA_PRESET", "full")
    distributed.check_launched([*command, "--preset", "tiny"])  # the tiny preset still launches
    distributed.check_launched(["distributed-check"])  # and a command that loads no model


@pytest.mark.parametrize("command, named", [
    (["generate", "wan", "--model", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--prompt", "a fox"], "hub checkpoint Wan-AI"),
    (["generate", "wan", "--prompt", "a fox"], "hub checkpoint Wan-AI/Wan2.2-TI2V-5B-Diffusers"),  # $TPUPEDIA_WAN
    (["bench", "stepcache", "cogvideox", "--preset", "full", "--step-cache", "fbcache:0.05"], "full preset"),
], ids=["--model", "environment", "bench stepcache"])
def test_launch_refuses_a_hub_checkpoint_and_bench_stepcache_of_the_full_preset(monkeypatch, capsys, tmp_path, command,
                                                                              named):
    """A hub checkpoint named with `--model` (or the family's variable) is a released model, which
    the launched processes would run on the host CPU as the full preset's would; so is
    `bench stepcache` on the full preset. One line each, nothing started; a tiny checkpoint's
    folder still launches."""
    from tpupedia import cli, devices

    monkeypatch.setattr(devices, "tpu_present", lambda: False)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.setenv("TPUPEDIA_PRESET", "tiny")
    monkeypatch.setenv("TPUPEDIA_WAN", "Wan-AI/Wan2.2-TI2V-5B-Diffusers")
    assert cli.main(["launch", "--local-processes", "2", "--", *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "host CPU" in err, err
    monkeypatch.delenv("TPUPEDIA_WAN")
    assert cli._launched_hub_checkpoint(["generate", "wan", "--model", str(tmp_path), "--prompt", "a fox"]) is None
    distributed.check_launched(["generate", "wan", "--model", str(tmp_path), "--prompt", "a fox"])  # a folder launches


@pytest.fixture
def two_processes(monkeypatch):
    """`as_process(rank, fn)`: `fn()` as process `rank` of a 2-process job, in this one process.
    Process 0 runs first; what it broadcasts is recorded and handed to process 1 in the same
    order, which must offer arrays of the same shapes and dtypes (as `broadcast_one_to_all`
    requires)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sent = []

    def as_process(rank, fn):
        if rank == 0:
            sent.clear()
        replay = iter(list(sent))

        def broadcast(array, is_source=None):
            array = np.asarray(array)
            if rank == 0:
                sent.append(array.copy())
                return array
            got = next(replay)
            assert (got.shape, got.dtype) == (array.shape, array.dtype)
            return got

        with monkeypatch.context() as m:
            m.setattr(jax, "process_count", lambda: 2)
            m.setattr(jax, "process_index", lambda: rank)
            m.setattr(multihost_utils, "broadcast_one_to_all", broadcast)
            return fn()

    return as_process


def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def test_broadcast_tensors_hands_every_process_the_same_bits(two_processes, monkeypatch):
    import safetensors.torch
    import torch

    tensors = {"latents": torch.tensor([[1.0, -0.0, float("inf")], [float("nan"), 1e-40, 3.14159]],
                                       dtype=torch.bfloat16),
               "frames": torch.rand(2, 4, 4, 3), "ids": torch.arange(5), "mask": torch.tensor([True, False, True])}
    assert distributed.broadcast_tensors(tensors) is tensors  # one process: nothing to send
    assert distributed.leader_decides([3, 0]) == [3, 0]
    monkeypatch.setattr(distributed, "_CHUNK", 64)  # several chunks, the last one short
    assert len(safetensors.torch.save(tensors)) % 4  # and not whole 32-bit words
    two_processes(0, lambda: distributed.broadcast_tensors(tensors))
    got = two_processes(1, lambda: distributed.broadcast_tensors(None))
    assert sorted(got) == sorted(tensors)  # safetensors orders them its own way, as a stage file does
    for name, t in tensors.items():
        assert (got[name].dtype, got[name].shape) == (t.dtype, t.shape), name
        assert torch.equal(_bits(got[name]), _bits(t)), name
    assert two_processes(0, lambda: distributed.leader_decides([1, 0])) == [1, 0]
    assert two_processes(1, lambda: distributed.leader_decides([0, 0])) == [1, 0]  # process 0's, not its own


def test_an_error_on_process_0_stops_every_process(two_processes):
    from tpupedia.pipelines import stages

    def damaged():
        raise stages.StageError("decode.json was edited")

    with pytest.raises(stages.StageError, match="edited"):
        two_processes(0, lambda: distributed.on_leader(damaged))
    with pytest.raises(distributed.DistributedError, match="process 0 failed.*StageError: decode.json was edited"):
        two_processes(1, lambda: distributed.on_leader(lambda: pytest.fail("only process 0 runs it")))
    assert two_processes(0, lambda: distributed.on_leader(lambda: "written")) == "written"
    assert two_processes(1, lambda: distributed.on_leader(lambda: "written")) is None


def test_a_failing_process_is_named_and_the_job_stops(tmp_path):
    done = _tpupedia("launch", "--local-processes", "2", "--devices-per-process", "1", "--",
                     "generate", "cogvideox", "--preset", "tiny", "--prompt", "x", "--frames", "10", cwd=tmp_path)
    assert done.returncode == 2
    # Both processes refuse the same input; whichever exits first is named, and the launcher
    # stops the other, which may or may not have printed its own refusal by then.
    last = done.stderr.strip().splitlines()[-1]
    named = re.fullmatch(r"tpupedia launch: process (\d) of 2 exited with status 2; the others were stopped", last)
    assert named, last
    assert f"[p{named.group(1)}] tpupedia generate: frames=10" in done.stderr


def test_a_tpu_host_lets_jax_find_its_slice(monkeypatch):
    """A queued-resource TPU VM names its workers in the VM's metadata, not in variables: on a host
    with TPU chips and no tpupedia variables, `initialize()` calls `jax.distributed.initialize()`
    with no arguments and lets JAX decide; JAX finding no cluster leaves one process; a failure to
    join is one `DistributedError`. Off a TPU, JAX is not asked."""
    import jax

    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                 "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "JAX_PLATFORMS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    answers = iter([None, ValueError("coordinator_address should be defined."),
                    RuntimeError("Getting metadata['worker-network-endpoints'] failed for 6 tries")])

    def initialize(*args, **kwargs):
        calls.append((args, kwargs))
        answer = next(answers)
        if answer is not None:
            raise answer

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr("tpupedia.devices._backends_initialized", lambda: False)
    monkeypatch.setattr("tpupedia.devices.tpu_present", lambda: False)
    assert distributed.initialize().num_processes == 1 and calls == []  # no TPU: nothing to join
    monkeypatch.setattr("tpupedia.devices.tpu_present", lambda: True)
    assert distributed.initialize().num_processes == 1 and calls == [((), {})]  # JAX decided
    assert distributed.initialize().num_processes == 1 and len(calls) == 2  # no cluster found: one host
    with pytest.raises(distributed.DistributedError, match="joining the TPU slice failed: Getting metadata"):
        distributed.initialize()
    assert calls == [((), {})] * 3


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


def test_a_process_killed_mid_batch_stops_the_job_within_seconds(tmp_path):
    """As a user would meet it: two real JAX processes (gloo) generating a batch; SIGKILL one once
    each has written its first video. The launcher names it and stops the other within the grace period, instead of
    leaving it to wait for gloo's timeouts (about 90 s before `stop` escalated to SIGKILL)."""
    import signal
    import threading
    import time

    (tmp_path / "p.txt").write_text("\n".join(f"prompt number {i}" for i in range(48)) + "\n")  # long: never done first
    first_video = threading.Event()
    firsts = {"[p0] 0000-", "[p1] 0001-"}  # each process's first video; on a busy host one can lag the other

    class Lines:
        def __init__(self):
            self.text = []

        def write(self, line):
            self.text.append(line)
            firsts.difference_update({f for f in firsts if line.startswith(f)})
            if not firsts:  # both processes wrote their first video
                first_video.set()

        def flush(self):
            pass

    out, err, outcome = Lines(), Lines(), {}

    def run():
        try:
            distributed.launch(["generate", "cogvideox", "--preset", "tiny", "--prompts", "p.txt", "--outdir", "out"],
                               processes=2, devices_per_process=1, grace_s=3.0, out=out, err=err,
                               cwds=[tmp_path, tmp_path], timeout_s=240)
        except distributed.DistributedError as e:
            outcome["error"] = str(e)
        outcome["ended"] = time.monotonic()

    job = threading.Thread(target=run)
    job.start()
    assert first_video.wait(180), "".join(out.text + err.text)[-3000:]
    pid = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_rank(p, 1))
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    job.join(60)
    assert not job.is_alive()
    assert outcome["error"] == "process 1 of 2 exited with status -9; the others were stopped"
    assert outcome["ended"] - killed < 3.0 + 5.0  # the grace period, then SIGKILL: seconds, not gloo's timeouts
    from tpupedia import batch

    made = batch.manifest(tmp_path / "out")  # each process's own index.<process>.jsonl: the job did not end
    assert 2 <= len(made) < 48  # process 0 had started; it did not run on alone


def _is_rank(proc: Path, rank: int) -> bool:
    """Whether /proc entry `proc` is a `tpupedia.cli` process that `launch` started as `rank`."""
    try:
        environ = (proc / "environ").read_bytes().split(b"\0")
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False
    return b"tpupedia.cli" in cmdline and f"{distributed.ENV_PROCESS_ID}={rank}".encode() in environ
