# ---
# jupyter:
#   jupytext:
#     formats: notebooks///ipynb,lessons///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · Beyond one host
#
# A v6e-8 is one machine: one Python process drives all eight chips. Bigger slices (v6e-16, 32,
# ..., 256) are several machines, and JAX runs them as a **multi-controller** job: every host
# runs the same program, sees its own chips, and after `jax.distributed.initialize()` sees all
# of them, so a mesh built from `jax.devices()` spans the slice and one jitted function runs as
# one SPMD program, with the collectives between hosts inserted by the compiler.
#
# One CPU host can run that for real: several local processes, each with its own simulated CPU
# devices, joined by `jax.distributed` with CPU collectives over gloo. `tpupedia launch` starts
# them; on a TPU slice, GKE or XPK starts one process per host instead (the deployment files are
# in `docs/deploy/`).
#
# 1. one program, many processes: what a process sees of a global array;
# 2. the CogVideoX pipeline over 2 processes gives the 1-process frames;
# 3. batch generation: prompts split over processes, a lost output redone, nothing twice;
# 4. one video's step on a 4-host and a 16-host slice, compiled ahead of time;
# 5. what bigger slices buy: videos per hour from the roofline and from a reported step time.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | tiny random checkpoints, in several local processes | about 1 GB of host RAM per process | about 2 minutes, measured here on a 2-core CPU (each launch starts fresh Python processes) |
# | `full` (multi-host TPU slice) | the real checkpoints, on every host | as lessons 06 and 07, per chip | not measured here: the same commands run unchanged on a slice, but nothing here has been run on one by this project |
#
# On the full preset sections 1 to 3 print the commands every host of a slice runs instead of
# running them: a TPU VM's chips belong to one process at a time (this notebook's), and local
# CPU processes would run the real CogVideoX1.5-5B checkpoint on the CPU. Sections 4 and 5 run
# as on the tiny preset.
#
# *Reading time: about 8 minutes.*

# %%
# %xmode Minimal
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tpupedia import session

preset = session.start()
scratch = Path(tempfile.mkdtemp(prefix="tpupedia-10-"))
env = dict(os.environ, TPUPEDIA_PRESET=preset.name, JAX_PLATFORMS="cpu")


def tpupedia(*args):
    """Run the tpupedia command in a fresh process (as a user would), from the scratch folder."""
    done = subprocess.run([sys.executable, "-m", "tpupedia.cli", *args], cwd=scratch, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout.splitlines()


def on_every_host(*args):
    """What the full preset shows instead: the command each host of a slice runs (GKE or XPK starts
    one process per host with it, `docs/deploy/`)."""
    print("on every host:", shlex.join([f"TPUPEDIA_PRESET={preset.name}", "tpupedia", *args]))


local = ["launch", "--local-processes", "2", "--devices-per-process", "4", "--"]  # two "hosts" of 4 devices

preset.name

# %% [markdown]
# ## 1. One program, many processes
#
# `tpupedia distributed-check` joins the job, builds a mesh over every process's devices
# (`hosts` x `chips`), places one global array on it with `jax.make_array_from_callback` (each
# process fills only the rows its own devices hold) and sums it with one jitted function. Here
# two processes with four devices each stand in for two hosts with four chips:

# %%
if preset.host_runs_whole_models:  # tiny: two local CPU processes, seconds
    lines = [line for line in tpupedia(*local, "distributed-check")
             if line[5:].lstrip().startswith(("process", "global", "jitted"))]
    print("\n".join(sorted(lines, key=lambda line: line[:4])))  # printed concurrently: grouped by process
else:  # full: one process per host of the slice
    on_every_host("distributed-check")

# %% [markdown]
# Each process holds half of the array (`fully addressable here: False`), yet both print the
# whole sum: the reduction ran across processes. Nothing in the program says "send rows 4 to 7
# to process 0"; the compiler derived the all-reduce from the shardings, exactly as on one host.

# %%
if preset.host_runs_whole_models:
    assert sum("jitted sum over all processes: 120 (expected 120)" in line for line in lines) == 2
    assert any("rows held here: [0, 1, 2, 3]" in line for line in lines)
    assert any("rows held here: [4, 5, 6, 7]" in line for line in lines)

# %% [markdown]
# ## 2. The same video, from one process or two
#
# `tpupedia generate cogvideox` calls `tpupedia.distributed.initialize()` first: under
# `tpupedia launch` (or on a multi-host TPU VM) it joins the job, and the pipeline of notebook 06
# builds its `dp=2, tp=4` mesh over `jax.devices()`, now spread over both processes. Every
# process runs the same three stages, and the hosts need not share a disk: process 0 decides,
# every process gets the tensors. Only process 0 looks at the work directory (which stages are
# done, the files a skipped stage left) and writes the stage files; what it decides and reads is
# broadcast, and a stage's output reaches the next stage in memory on every process.

# %%
generate = ["generate", "cogvideox", "--prompt", "a panda playing a guitar", "--quiet"]
if preset.host_runs_whole_models:  # tiny: two local processes, then one
    _ = tpupedia(*local, *generate, "--workdir", "two")
    _ = tpupedia(*generate, "--workdir", "one")
else:  # full: the slice's hosts together
    on_every_host(*generate, "--workdir", "run")

# %%
import json

from safetensors.torch import load_file

from tpupedia import results

if preset.host_runs_whole_models:  # the stage files of both runs
    for stage, name in (("text", "prompt_embeds"), ("denoise", "latents"), ("decode", "frames")):
        a, b = (load_file(scratch / run / f"{stage}.safetensors")[name].float() for run in ("two", "one"))
        print(f"{stage:8} {name:14} max abs difference, 2 processes vs 1:",
              results.error_text(float((a - b).abs().max())))
    machine = json.loads((scratch / "two" / "denoise.json").read_text())["extra"]["machine"]
    print("the 2-process run's devices:", machine["devices"], "in", machine["processes"], "processes")

# %%
if preset.host_runs_whole_models:
    frames_two = load_file(scratch / "two" / "decode.safetensors")["frames"]
    frames_one = load_file(scratch / "one" / "decode.safetensors")["frames"]
    assert float((frames_two - frames_one).abs().max()) <= 1e-5
    assert machine == machine | {"devices": 8, "processes": 2}

# %% [markdown]
# The difference is float32 rounding: the same sums, reduced in a different order once the
# collectives cross processes.
#
# ## 3. Batch generation that survives failures
#
# Many videos, many hosts: the simplest scaling is data parallelism over hosts. With
# `--prompts FILE --outdir DIR`, each process takes the prompts whose index modulo the process
# count is its id and runs them on its **own** devices, with no communication between hosts.
# Each video is written to a temporary file and renamed, then its JSON record (with the mp4's
# checksum and the settings' fingerprint), then one line of `index.jsonl`. A prompt is done only
# when all of that checks out, so a job killed at any point loses at most the prompts in flight.

# %%
prompts = scratch / "prompts.jsonl"
prompts.write_text("\n".join(json.dumps(p) for p in [
    {"prompt": "a panda playing a guitar", "seed": 1},
    {"prompt": "a cat on a skateboard", "seed": 2},
    {"prompt": "rain over a neon city", "seed": 3},
    {"prompt": "a paper boat on a river", "seed": 4},
]) + "\n")
batch_args = ["generate", "cogvideox", "--prompts", prompts.name, "--outdir", "out", "--quiet"]  # in `scratch`
if preset.host_runs_whole_models:  # tiny: two local processes share the four prompts
    _ = tpupedia(*local, *batch_args)
    index = [json.loads(line) for line in (scratch / "out" / "index.jsonl").read_text().splitlines()]
    for entry in sorted(index, key=lambda e: e["index"]):
        print(f"{entry['file']:34} seed {entry['seed']}  made by process {entry['process']}")
else:  # full: every host takes its share
    on_every_host(*batch_args)

# %% [markdown]
# Now a failure: one video is lost (a crash between the rename and the record would leave the
# same state: a JSON whose checksum no longer matches), and a temporary file is left behind.
# The rerun redoes that prompt alone:

# %%
from tpupedia import batch

if preset.host_runs_whole_models:  # tiny: damage the batch's output, rerun in one process
    lost = scratch / "out" / "0002-rain-over-a-neon-city.mp4"
    lost.write_bytes(lost.read_bytes()[:100])
    (scratch / "out" / ".0003-a-paper-boat-on-a-river.tmp.mp4").write_bytes(b"half a video")
    rerun = [line.split(" (")[0] for line in tpupedia(*batch_args[:-1]) if line[:4].isdigit()]  # without the timing
    print("\n".join(rerun))
else:  # full: after a failure, the same command again
    on_every_host(*batch_args[:-1])

# %%
if preset.host_runs_whole_models:
    items = batch.read_prompts(prompts)
    records = {i.index: json.loads((scratch / "out" / f"{i.name}.json").read_text()) for i in items}
    assert rerun == ["0000-a-panda-playing-a-guitar: done already, skipped",
                     "0001-a-cat-on-a-skateboard: done already, skipped",
                     "0002-rain-over-a-neon-city: wrote 0002-rain-over-a-neon-city.mp4",
                     "0003-a-paper-boat-on-a-river: done already, skipped"]
    assert all(batch.is_done(scratch / "out", i, records[i.index]["fingerprint"]) for i in items)
    assert sorted(e["index"] for e in batch.manifest(scratch / "out")) == [0, 1, 2, 3]
    assert {e["index"]: e["process"] for e in index} == {0: 0, 1: 1, 2: 0, 3: 1}

# %% [markdown]
# ## 4. One video on a bigger slice, planned ahead of time
#
# The other way to use 16 chips is to spread **one** video's step over them. `tpupedia dryrun`
# compiles the CogVideoX1.5-5B step for a multi-host topology as easily as for one host: libtpu
# describes a `v6e:4x4` slice (16 chips, 4 hosts) and a `v6e:8x8` (64 chips, 16 hosts) on this CPU. One layer compiled, weights
# scaled to all 42, splash attention, the guidance pair on `dp` and the heads on `tp`.
#
# Each plan gets three floors on its step time (notebook 09): FLOPs at the bf16 peak, weights
# read once from HBM, and the bytes each chip sends in collectives over ICI. For that last one,
# what matters is how fast *one chip* can send in *one collective*. Google's v6e page gives
# 800 GB/s of ICI per chip, but that counts both directions of all 4 ports: one port carries
# 100 GB/s each way. The chips form a 2D torus, one port per neighbour (left, right, up, down),
# and a ring along one mesh axis runs over that axis's two ports, one direction each. So a chip
# sends at most 200 GB/s into such a ring, a quarter of the headline figure. Along an axis
# shorter than 16 chips a v6e slice has no wraparound link, so the ring is really a line and
# slower still: the floor stays a floor.

# %%
from tpupedia import dryrun

import warnings

plans, layout_warnings = {}, []
for name in ("v6e:2x4", "v6e:4x4", "v6e:8x8"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans[name] = dryrun.run("cogvideox", topology=name, resolution="720p", frames=81, attention="splash", layers=1)
    layout_warnings += [f"{name}: {w.message}" for w in caught if "heads do not divide" in str(w.message)]
print("\n".join(layout_warnings))
from tpupedia import devices, hardware

v6e = hardware.chip("v6e")
print(f"v6e ICI: {v6e.link_bytes_per_s / 1e9:.0f} GB/s both ways over {v6e.ici_ports} ports -> "
      f"{v6e.ici_port_bytes_per_s / 1e9:.0f} GB/s per port and direction -> {v6e.ring_bytes_per_s / 1e9:.0f} GB/s "
      "out of a chip in a ring along one axis (2 ports, one direction each)")
g = 2**30
for name, r in plans.items():
    mesh = devices.topology_mesh(name, (r.mesh["dp"], r.mesh["tp"]), ("dp", "tp"))
    hosts_per_group = max(len({d.process_index for d in row}) for row in mesh.devices)  # one row = one tp group
    print(f"{name} mesh {r.mesh}: {r.arguments_bytes / g:.2f} GiB arguments + {r.temporaries_bytes / g:.2f} GiB "
          f"temporaries per chip; {r.collectives} per layer, {sum(r.collective_bytes.values()) / g:.1f} GiB sent "
          f"per chip per step, each tp group on {hosts_per_group} host(s) of libtpu's description")
    print(f"    floors per step: compute {r.floors['compute']:.3f} s, HBM {r.floors['memory']:.4f} s, "
          f"ICI {r.floors['communication']:.3f} s -> {r.bound}-bound")

# %% [markdown]
# Twice the chips: each chip holds less of the model and the compute floor halves. The program
# has the same collectives (Megatron's two all-reduces per layer), now over 8 chips per `tp`
# group, which libtpu lays over two 4-chip hosts, and each chip sends a little more (ring
# traffic grows as 2(n-1)/n). Within one slice every chip is on the inter-chip interconnect
# (ICI), so those all-reduces cross hosts over ICI, not the data-centre network; only several
# slices (multislice) talk over DCN. The v6e-8 plan is compute-bound: its ICI floor is under
# half its compute floor. The v6e-16 plan is not: its compute floor halved, its bytes did not,
# and its ICI floor is now a little above its compute floor. So it is **communication-bound**,
# and 16 chips make the floor 1.8x lower, not 2x. (At the 800 GB/s headline figure both plans
# looked compute-bound, and earlier versions of this notebook said so.)

# %%
one, two, eight = plans["v6e:2x4"], plans["v6e:4x4"], plans["v6e:8x8"]
assert two.mesh == {"dp": 2, "tp": 8} and two.fits and one.fits
assert two.arguments_bytes < one.arguments_bytes and abs(two.floors["compute"] / one.floors["compute"] - 0.5) < 1e-6
assert one.collectives == two.collectives == {"all-reduce": 2}
assert sum(two.collective_bytes.values()) > sum(one.collective_bytes.values())
assert one.bound == "compute" and one.floors["communication"] < 0.5 * one.floors["compute"]
assert two.bound == "communication" and two.floors["compute"] < two.floors["communication"] < 1.2 * two.floors["compute"]
for r in plans.values():  # bytes sent over a one-axis ring: 2 ports x 100 GB/s, not the 800 GB/s total
    assert abs(r.floors["communication"] - sum(r.collective_bytes.values()) / 200e9) < 1e-12

# %% [markdown]
# The v6e-64 (8x8, 16 hosts) is the counter-example. With `dp=2` the `tp` axis has 32 chips, and
# 48 heads do not split 32 ways, so the attention override falls back to splitting queries along
# the sequence (notebook 04). The compiler then re-shards activations around every attention:
# all-gathers, all-to-alls and dozens of collective-permutes per layer. Each chip holds less and
# computes less, but it now sends far more than it can compute: the step is
# **communication-bound**, its ICI floor several times its compute floor, and it is set by ICI,
# not by the FLOPs. Spreading one video over more chips stops paying once the mesh no longer
# matches the model's shape, and on this model it starts to cost at 16 chips; for many videos,
# the data parallelism of section 3 scales instead.

# %%
assert eight.mesh == {"dp": 2, "tp": 32} and eight.fits and layout_warnings
assert eight.bound == "communication" and eight.floors["communication"] > 4 * eight.floors["compute"]
assert sum(eight.collectives.values()) > 10 * sum(two.collectives.values())

# %% [markdown]
# ## 5. What a bigger slice buys
#
# Data parallelism over hosts multiplies videos per hour by the number of pipelines; each
# pipeline gets the chips of one host. A v6e-8 is one 8-chip VM; larger v6e slices are built
# from 4-chip VMs (`tpupedia.hardware`: a v6e-16 is 4 hosts, a v6e-256 is 64). Two estimates of
# the time per CogVideoX1.5-5B video (720p, 81 frames, 50 steps):
#
# - the **roofline floor**: 50 steps of `tpupedia.models.cogvideox.step_flops` at the chips' bf16
#   peak, the fastest any implementation could be;
# - the **reported** v6e-8 time, 106.47 s per video (reported upstream, TPU v6e-8; yangwhale/
#   gpu-tpu-pedia, commit 3fa9ce1, CogVideoX README), assumed to double on a 4-chip host
#   (an assumption about time, not memory: each chip of a 4-chip host has the same HBM, holds
#   twice the transformer's shards, and still fits every stage; the results page's plans give
#   each stage's per-chip peak there, and section 8 of notebook 06 shows that a 1360x768 VAE
#   frame batch fits one chip).

# %%
from tpupedia import hardware
from tpupedia.models import cogvideox

v6e = hardware.chip("v6e")
floor_per_chip_s = 50 * cogvideox.step_flops(1280, 720, 81)["total"] / v6e.bf16_flops  # one chip, all the work
print(f"{'slice':>8} {'hosts':>5} {'chips/pipeline':>14} {'floor (videos/h)':>17} {'reported-based (videos/h)':>26}")
rows = {}
for name in ("v6e:2x4", "v6e:4x4", "v6e:8x8", "v6e:16x16"):
    topo = hardware.parse_topology(name)
    chips = topo.num_chips // topo.hosts
    floor = topo.hosts * 3600 / (floor_per_chip_s / chips)
    reported = topo.hosts * 3600 / (106.47 * 8 / chips)
    rows[topo.accelerator_type] = (topo.hosts, floor, reported)
    print(f"{topo.accelerator_type:>8} {topo.hosts:>5} {chips:>14} {floor:>17,.0f} {reported:>26,.0f}")

# %%
assert rows["v6e-8"][0] == 1 and rows["v6e-16"][0] == 4 and rows["v6e-256"][0] == 64
assert abs(rows["v6e-16"][2] / rows["v6e-8"][2] - 2.0) < 1e-9  # 16 chips, linear: twice the v6e-8

# %% [markdown]
# ## Takeaways
#
# - A multi-host slice is one JAX program per host; `jax.distributed.initialize()` makes
#   `jax.devices()` global, and a mesh over it spans the slice. `tpupedia launch` reproduces that
#   on one CPU host, with real cross-process collectives.
# - The pipeline needed three changes to run across processes: inputs placed with global
#   shardings, outputs replicated so every process can read them, and process 0 alone
#   deciding and reading from its disk, its decisions and tensors broadcast to the others.
# - For many videos, give each host its own prompts: no cross-host traffic, and atomic
#   per-prompt outputs make the job restartable at any point.
# - Deployment: `docs/deploy/jobset-v6e-16.yaml` (GKE JobSet) and `docs/deploy/xpk-v6e-16.sh`
#   run the same `tpupedia generate cogvideox --prompts ...` on every host of a v6e-16.
