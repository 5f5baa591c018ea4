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
# # 13 · Beyond one host
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
# 5. what bigger slices buy: videos per hour and cost per video, from the roofline and from a
#    reported step time, and why the two differ; then the path to a real run.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | tiny random checkpoints, in several local processes | about 1 GB of host RAM per process | about 100 s, measured here on a 2-core CPU (each launch starts fresh Python processes; section 4 compiles for three slices) |
# | `full` (multi-host TPU slice) | the real checkpoints, on every host | as in notebooks `cogvideox_pipeline` and `hunyuan_video`, per chip | not measured here: the same commands run unchanged on a slice, but nothing here has been run on one by this project |
#
# On the full preset sections 1 to 3 print the commands every host of a slice runs instead of
# running them: a TPU VM's chips belong to one process at a time (this notebook's), and local
# CPU processes would run the real CogVideoX1.5-5B checkpoint on the CPU. Sections 4 and 5 run
# as on the tiny preset.
#
# *Reading time: about 25 minutes.*

# %%
# %xmode Minimal
# On Colab or Kaggle: fetch and install the course once, then work in its notebooks/ folder;
# anywhere else this does nothing.
import os
import sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    raise RuntimeError("this copy of the course names no public repository to install from: clone the "
                       "course yourself, install it as its README says, and open its notebooks/ folder")
# (end of the hosted-runtime setup: python -m tpupedia.notebooks hosted writes the lines above)

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
# Three calls make a program multi-host, and the whole of it fits in twenty lines. Each
# process: (1) joins the job with `jax.distributed.initialize`, after which `jax.devices()`
# lists every process's devices and `jax.local_devices()` its own; (2) builds one mesh over all
# of them and places a global array with `jax.make_array_from_callback`, which asks each process
# only for the pieces its own devices hold; (3) runs one jitted function over the array, the
# same SPMD program in every process, its result replicated so that every process can read it.
# What only one process knows (a file on its own disk) reaches the others with
# `multihost_utils.broadcast_one_to_all`, and `multihost_utils.sync_global_devices` waits for
# every process. Here is that script, written to the scratch folder:

# %%
script = scratch / "one_array.py"
script.write_text("""\
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

if len(sys.argv) > 1:  # local: this CPU's processes, each with 4 devices, collectives over gloo
    coordinator, count, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=rank)
else:  # a TPU slice: the environment names the coordinator, the count and this host's rank
    jax.distributed.initialize()
mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("hosts", "chips"))
full = np.arange(jax.device_count() * 2, dtype=np.float32).reshape(jax.device_count(), 2)
array = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P(("hosts", "chips"))), lambda index: full[index])
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(array)  # replicated: every process can read it
leader_read = np.int32(42 if jax.process_index() == 0 else -1)  # what only process 0 found on its disk
leader_read = multihost_utils.broadcast_one_to_all(leader_read)  # now every process holds process 0's value
multihost_utils.sync_global_devices("summed")
rows = sorted(int(shard.index[0].start) for shard in array.addressable_shards)
print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of {jax.device_count()} "
      f"devices, rows {rows}, whole array here: {array.is_fully_addressable}, sum {float(total):.0f} of "
      f"{full.sum():.0f}, process 0 read {int(leader_read)}")
""")
print(f"{script.name}: {len(script.read_text().splitlines())} lines")

# %% [markdown]
# Launching it is the other half: start one process per host, tell each the coordinator's
# address, the process count and its own rank. On one CPU host, two local processes stand in
# for two hosts with four chips each:

# %%
from tpupedia import distributed

if preset.host_runs_whole_models:  # tiny: two local CPU processes, seconds
    port = distributed.free_port()
    processes = [subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{port}", "2", str(rank)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [process.communicate(timeout=300) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err[-2000:] for _, err in outputs]
    lines = [out.strip().splitlines()[-1] for out, _ in outputs]
    print("\n".join(lines))
else:  # full: the same file on every host of the slice, no arguments
    print("on every host:", shlex.join(["python", script.name]))

# %% [markdown]
# Each process holds half of the array (`whole array here: False`), yet both print the whole
# sum: the reduction ran across processes. Nothing in the program says "send rows 4 to 7 to
# process 0"; the compiler derived the all-reduce from the shardings, exactly as on one host.
# `tpupedia launch` is the launcher above with the output relayed and a failed process stopping
# the others; `tpupedia distributed-check` is the script.

# %% tags=["check"]
if preset.host_runs_whole_models:
    assert all("sum 120 of 120, process 0 read 42" in line for line in lines)
    assert "process 0 of 2: 4 of 8 devices, rows [0, 1, 2, 3], whole array here: False" in lines[0]
    assert "process 1 of 2: 4 of 8 devices, rows [4, 5, 6, 7], whole array here: False" in lines[1]

# %% [markdown]
# ## 2. The same video, from one process or two
#
# `tpupedia generate cogvideox` calls `tpupedia.distributed.initialize()` first: under
# `tpupedia launch` (or on a multi-host TPU VM) it joins the job, and the pipeline of notebook `cogvideox_pipeline`
# builds its `dp=2, tp=4` mesh over `jax.devices()`, now spread over both processes. Every
# process runs the same three stages, and the hosts need not share a disk: process 0 decides,
# every process gets the tensors. Only process 0 looks at the work directory (which stages are
# done, the files a skipped stage left) and writes the stage files; what it decides and reads is
# broadcast, and a stage's output reaches the next stage in memory on every process.

# %%
from tpupedia import cli

generate = ["generate", "cogvideox", "--prompt", "a panda playing a guitar", "--quiet"]
if preset.host_runs_whole_models:  # tiny: two local processes, then one: this notebook's, on its 8 devices
    _ = tpupedia(*local, *generate, "--workdir", "two")
    assert cli.main([*generate, "--workdir", str(scratch / "one")]) == 0
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
# ### Exercise 1: a process dies mid-video; predict what the rerun redoes
#
# Process 0 is killed while it decodes video 0 (seed 1): video 0 has no mp4 and no record, and
# its stage folder `.stages/0000-a-panda-playing-a-guitar/` holds a `text` and a `denoise` stage
# file. To make the case sharper, the files put there are section 2's single-process run's: the
# same prompt, but seed 42. The solution builds that state in a copy of the batch's folder and
# reruns the batch in one process.
# **Predict** first: which of the four prompts does the rerun redo, and which of video 0's three
# stages (text, denoise, decode) run again and which are read from the stage files? Then open the
# solution, run it, and compare (the record's `timings` is empty for a stage that was read).

# %% tags=["solution"]
import shutil

if preset.host_runs_whole_models:  # tiny: the folder a crash would leave, then the same batch once more
    crashed, first = scratch / "crashed", items[0]  # video 0: seed 1, made by process 0
    shutil.copytree(scratch / "out", crashed)
    for suffix in (".mp4", ".json"):  # killed before its video and record were written
        (crashed / f"{first.name}{suffix}").unlink()
    work = crashed / ".stages" / first.name
    work.mkdir(parents=True)
    for stage in ("text", "denoise"):  # section 2's files: the same prompt, seed 42
        for stage_file in sorted((scratch / "one").glob(f"{stage}.*")):
            shutil.copy(stage_file, work / stage_file.name)
    resumed = [line.split(" (")[0] for line in tpupedia(*batch_args[:4], "--outdir", crashed.name) if line[:4].isdigit()]
    timings = json.loads((crashed / f"{first.name}.json").read_text())["timings"]
    print("\n".join(resumed))
    print("video 0, stages read from their files:", [s for s in ("text", "denoise", "decode") if not timings[s]])
    print("video 0, stages that ran again:", [s for s in ("text", "denoise", "decode") if timings[s]])
    print("stage folder left after the rerun:", (crashed / ".stages").exists())
else:  # full: a crashed job is rerun with the same command on every host
    on_every_host(*batch_args[:4], "--outdir", "crashed")

# %% tags=["check"]
if preset.host_runs_whole_models:
    assert resumed[0] == "0000-a-panda-playing-a-guitar: wrote 0000-a-panda-playing-a-guitar.mp4"
    assert all(line.endswith("done already, skipped") for line in resumed[1:]) and len(resumed) == 4
    assert timings["text"] == {} and timings["denoise"] and timings["decode"]  # the seed is not a text setting
    assert all(batch.is_done(crashed, i, records[i.index]["fingerprint"]) for i in items)
    assert not (crashed / ".stages").exists()

# %% [markdown]
# ## 4. One video on a bigger slice, planned ahead of time
#
# The other way to use 16 chips is to spread **one** video's step over them. `tpupedia dryrun`
# compiles the CogVideoX1.5-5B step for a multi-host topology as easily as for one host: libtpu
# describes a `v6e:4x4` slice (16 chips, 4 hosts) and a `v6e:8x8` (64 chips, 16 hosts) on this CPU. One layer compiled, weights
# scaled to all 42, splash attention, the guidance pair on `dp` and the heads on `tp`.
#
# Each plan gets three floors on its step time (notebook `plan_without_tpu`): FLOPs at the bf16 peak, weights
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
# and 16 chips make the floor 1.8x lower, not 2x. (Priced at the 800 GB/s headline figure, the
# bandwidth of all of a chip's links together, both plans would look compute-bound: one
# collective never gets all of it.)

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
# Where those 16 chips are. libtpu's description of the slice gives each chip an `id`, the
# `process_index` of the host that drives it (one process per host, as in section 1) and its
# `coords` in the torus; the mesh gives it an index along `dp` and `tp`. The picture draws the
# v6e-16's `dp=2, tp=8` mesh twice from those attributes: above as the program indexes it,
# below grouped by host, coloured by host in both. Each `tp` group of 8 chips spans two 4-chip
# hosts, and so does each `dp` pair: both axes' collectives cross hosts. They still run over ICI,
# because the four hosts are one slice.

# %% tags=["diagram-hosts"]
from tpupedia.diagrams import hosts as hosts_diagram

slice_16 = devices.topology_mesh("v6e:4x4", (two.mesh["dp"], two.mesh["tp"]), ("dp", "tp"))
hosts_diagram.draw(slice_16)

# %% tags=["check"]
assert {axis.name: axis.hosts_per_group for axis in hosts_diagram.layout(slice_16).axes} == {"dp": 2, "tp": 2}
assert len({chip.process_index for chip in slice_16.devices.flat}) == 4 and slice_16.devices.size == 16

# %% [markdown]
# The v6e-64 (8x8, 16 hosts) is the counter-example. With `dp=2` the `tp` axis has 32 chips, and
# 48 heads do not split 32 ways, so the attention override falls back to splitting queries along
# the sequence (notebook `splash_attention`). The compiler then re-shards activations around every attention:
# all-gathers, all-to-alls and dozens of collective-permutes per layer. Each chip holds less and
# computes less, but it now sends far more than it can compute: the step is
# **communication-bound**, its ICI floor several times its compute floor, and it is set by ICI,
# not by the FLOPs. Spreading one video over more chips stops paying once the mesh no longer
# matches the model's shape, and on this model it starts to cost at 16 chips; for many videos,
# the data parallelism of section 3 scales instead.

# %% tags=["check"]
assert eight.mesh == {"dp": 2, "tp": 32} and eight.fits and layout_warnings
assert eight.bound == "communication" and eight.floors["communication"] > 4 * eight.floors["compute"]
assert sum(eight.collectives.values()) > 10 * sum(two.collectives.values())

# %% [markdown]
# ### Exercise 2: predict the bytes a chip sends when the tp group doubles
#
# The v6e-8 and v6e-16 plans run the same two all-reduces per layer over the same activations:
# `dp=2` in both, so each `tp` group reduces one half of the guidance pair. Only the group grows,
# from 4 to 8 chips. A ring all-reduce of `B` bytes over `n` chips sends `2(n-1)/n B` from each chip.
# **Predict** the ratio of the bytes one chip sends per step on the v6e-16 to the v6e-8, and the
# v6e-16's ICI floor in seconds from the v6e-8's. Then open the solution, run it, and compare.

# %% tags=["solution"]
def ring_factor(n):  # bytes one chip sends in a ring all-reduce, per byte of the array
    return 2 * (n - 1) / n


predicted_ratio = ring_factor(two.mesh["tp"]) / ring_factor(one.mesh["tp"])
planned_ratio = sum(two.collective_bytes.values()) / sum(one.collective_bytes.values())
print(f"predicted {predicted_ratio:.4f}x the bytes (2*7/8 over 2*3/4), planned {planned_ratio:.4f}x")
print(f"ICI floor: v6e-8 {one.floors['communication']:.3f} s -> predicted {one.floors['communication'] * predicted_ratio:.3f} s, "
      f"planned {two.floors['communication']:.3f} s on the v6e-16")

# %% tags=["check"]
assert abs(predicted_ratio - 7 / 6) < 1e-12
assert abs(planned_ratio - predicted_ratio) < 1e-6  # the same arrays, only the ring is longer
assert abs(two.floors["communication"] - one.floors["communication"] * predicted_ratio) < 1e-6 * two.floors["communication"]

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
#   each stage's per-chip peak there, and section 8 of notebook `cogvideox_vae_flax` shows that a 1360x768 VAE
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
    rows[topo.accelerator_type] = (topo.hosts, floor, reported, topo.num_chips)
    print(f"{topo.accelerator_type:>8} {topo.hosts:>5} {chips:>14} {floor:>17,.0f} {reported:>26,.0f}")

# %% tags=["check"]
assert rows["v6e-8"][0] == 1 and rows["v6e-16"][0] == 4 and rows["v6e-256"][0] == 64
assert abs(rows["v6e-16"][2] / rows["v6e-8"][2] - 2.0) < 1e-9  # 16 chips, linear: twice the v6e-8

# %% [markdown]
# The two columns differ by 6.5x on every slice. Where does a v6e-8's time go, if not into
# FLOPs at peak? Upstream's staged run splits its 720p video (reported upstream, TPU v6e-8,
# same README): about 2 s of T5, about 103.8 s of denoising once compiled, 0.86 s of VAE decode.
# So the gap is in the denoising step: 103.8 s / 50 = 2.08 s against a floor of 0.33 s, of
# which attention's FLOPs are 0.22 s and the linear layers' 0.10 s. The plan of section 4 adds
# what the all-reduces cost at best if nothing overlapped them. The rest is what a floor does
# not count: matmuls below the MXUs' peak, the elementwise work between them (norms, RoPE,
# the softmax inside splash), memory traffic, and collectives not hidden behind compute. Two
# reports upstream say this rest is large and partly recoverable. Its 10-step history of the
# same step went from 4.04 to 2.31 s per step through sharding and mesh changes alone, no FLOP
# removed (768p; `tpu/CogVideoX/README.md`, commit 3fa9ce1). And its profile of a
# HunyuanVideo-1.5 block on a TPU v6e-8 spent about 45 ms in the linear layers with their
# all-reduces against about 35 ms in splash attention, although attention holds most of that
# model's FLOPs at 720p (`tpu/HunyuanVideo-1.5/generate_hunyuan_torchax_staged/TORCHAX_MIGRATION_GUIDE.md`).

# %%
import matplotlib.pyplot as plt

step_flops = cogvideox.step_flops(1280, 720, 81)
peak = 8 * v6e.bf16_flops
floor_parts = {"attention FLOPs at peak": step_flops["attention"] / peak,
               "linear FLOPs at peak": step_flops["linear"] / peak,
               "all-reduces at ICI floor (section 4)": one.floors["communication"]}
reported_step = 103.8 / 50  # reported upstream: the staged run's denoising stage, 50 steps, TPU v6e-8
fig, (left, right) = plt.subplots(1, 2, figsize=(8, 2.8))
bottom = 0.0
for (name, seconds), colour in zip(floor_parts.items(), ("tab:blue", "tab:cyan", "tab:orange")):
    left.bar(["floor"], [seconds], bottom=bottom, color=colour, label=name)
    bottom += seconds
left.bar(["reported upstream"], [reported_step], color="tab:gray", label="reported step (all of it)")
left.set_ylabel("seconds per step, v6e-8")
left.legend(fontsize=7)
names = list(rows)
right.bar([n + " floor" for n in names], [rows[n][1] for n in names], color="tab:blue")
right.bar([n + " reported" for n in names], [rows[n][2] for n in names], color="tab:gray")
right.set_yscale("log")
right.set_ylabel("videos per hour")
right.tick_params(axis="x", labelrotation=60, labelsize=7)
plt.tight_layout()
plt.show()
flop_floor = floor_parts["attention FLOPs at peak"] + floor_parts["linear FLOPs at peak"]
print(f"FLOP floor {flop_floor:.2f} s per step (attention {floor_parts['attention FLOPs at peak']:.2f}, linear "
      f"{floor_parts['linear FLOPs at peak']:.2f}); the all-reduces, if nothing overlapped them, at least "
      f"{one.floors['communication']:.2f} s more; reported {reported_step:.2f} s: {reported_step / flop_floor:.1f}x the "
      "FLOP floor")

# %% [markdown]
# More hosts buy videos per hour, not cheaper videos: with one pipeline per host, each video
# costs the same chip-hours on any slice. At the on-demand list price of $2.70 per v6e
# chip-hour (us-central1; dated and sourced on [What a video costs](../kb/cost-per-video.md)),
# a video costs, from each estimate:

# %%
usd_per_chip_hour = 2.70  # on demand, v6e, us-central1: docs/kb/cost-per-video.md gives the source and date
costs = {}
for name, (hosts, floor, reported, chips) in rows.items():
    costs[name] = chips * usd_per_chip_hour / reported
    print(f"{name:>8}: ${chips * usd_per_chip_hour / floor:.3f} per video at the floor, ${costs[name]:.2f} at the "
          "reported time")

# %% tags=["check"]
assert max(costs.values()) - min(costs.values()) < 1e-9  # the same cost on every slice
assert abs(costs["v6e-8"] - 8 * 2.70 * 106.47 / 3600) < 1e-9  # $0.64: 8 chips for 106.47 s
assert 6 < reported_step / flop_floor < 7 and reported_step > sum(floor_parts.values())

# %% [markdown]
# ### Exercise 3: one video over 16 chips or one per host; predict which is cheaper
#
# Section 4 spread one video's step over a v6e-16; section 5 gave each host its own pipeline and
# found the cost per video the same on every slice. Take the floors of section 4's plans as the
# step times. **Predict** first: does a video cost more, less or the same in chip-seconds when one
# pipeline spans the whole v6e-16 than when it runs on a v6e-8, and by roughly what factor? Then
# open the solution, run it, and compare.

# %% tags=["solution"]
chip_seconds = {name: r.num_chips * r.roofline_seconds for name, r in (("v6e-8", one), ("v6e-16", two))}
for name, cost in chip_seconds.items():
    print(f"{name}: one pipeline over all chips, {cost:.2f} chip-seconds per step at the floor")
print(f"a video over the v6e-16 costs {chip_seconds['v6e-16'] / chip_seconds['v6e-8']:.2f}x one over the v6e-8")

# %% tags=["check"]
# twice the chips, a floor 1.8x lower, not 2x: each video costs more; dp over hosts keeps the v6e-8's cost
assert 1.0 < chip_seconds["v6e-16"] / chip_seconds["v6e-8"] < 1.2
assert two.roofline_seconds == two.floors["communication"] and one.roofline_seconds == one.floors["compute"]

# %% [markdown]
# ### The path to a real run
#
# Nothing in this notebook ran on a slice. On one, every host runs the same command, and
# `gcloud` can start it on all of them at once (after [Set up a TPU VM](../guides/tpu-vm.md) on
# each; `--outdir` on a disk every host can write, or a per-host folder):
#
#     gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command \
#       "cd gpu-tpu-pedia && TPUPEDIA_PRESET=full .venv/bin/tpupedia generate cogvideox \
#          --prompts prompts.jsonl --outdir /mnt/shared/videos"
#
# Each host first joins the job (`jax.distributed.initialize()` needs no arguments there), then
# plans its own requests before loading a weight (the preflight of notebook `plan_without_tpu`), then works
# through its share of the prompts, as the processes of section 3 did. Each host prints a line
# per prompt it owns, the form section 3's rerun printed: `0002-rain-over-a-neon-city: wrote
# 0002-rain-over-a-neon-city.mp4` followed by its timings, or `done already, skipped` for a prompt
# an earlier run finished; and `index.jsonl` in the output folder gets one line per video, with
# the process that made it. The same command again after a failure redoes only what is missing.

# %% [markdown]
# ## Takeaways
#
# - A multi-host slice is one JAX program per host; `jax.distributed.initialize()` makes
#   `jax.devices()` global, and a mesh over it spans the slice. `tpupedia launch` reproduces that
#   on one CPU host, with real cross-process collectives.
# - The pipeline needed three changes to run across processes, each a line of section 1's
#   script: inputs placed with global shardings (`jax.make_array_from_callback`), outputs
#   replicated so every process can read them (`out_shardings=NamedSharding(mesh, P())`), and
#   process 0 alone deciding and reading from its disk, what it read broadcast to the others
#   (`multihost_utils.broadcast_one_to_all`).
# - For many videos, give each host its own prompts: no cross-host traffic, and atomic
#   per-prompt outputs make the job restartable at any point.
# - Deployment: `docs/deploy/jobset-v6e-16.yaml` (GKE JobSet) and `docs/deploy/xpk-v6e-16.sh`
#   run the same `tpupedia generate cogvideox --prompts ...` on every host of a v6e-16.

# %% [markdown]
# ## Further reading
#
# - [Scaling out to multi-host slices](../kb/scaling-out.md): multi-controller JAX, ICI and DCN,
#   and the deployment files in depth.
# - [Three-axis meshes: dp, sp, tp](../kb/three-axis-meshes.md): what to do when heads stop
#   dividing, as on the v6e-64 of section 4.
# - [What a video costs](../kb/cost-per-video.md): section 5's prices, their sources and dates,
#   and the same arithmetic for 8x H100.
# - ["Trillium (v6e): GKE, XPK, training recipes"](../guides/trillium-gke.md): creating the slices
#   this notebook plans.

# %% [markdown]
# ## Self-check
#
# 1. Each process of section 1 holds half of the array, yet both print the whole sum. Where did
#    the rows of the other process come from, and who wrote that transfer?
#
#    <details><summary>Answer</summary>
#
#    The compiler inserted an all-reduce across both processes, derived from the input's sharding
#    over both hosts and the replicated `out_shardings`. The program never names a transfer; with
#    the gloo collectives the processes exchange partial sums as chips of one slice would over ICI.
#
#    </details>
#
# 2. Why does only process 0 look at the work directory in a multi-process `generate`, and what
#    would go wrong if every process decided on its own which stages to skip?
#
#    <details><summary>Answer</summary>
#
#    The hosts of a slice need not share a disk, so their files can differ. A process that skipped a
#    stage would not join that stage's collectives while the others ran them, and the job would hang;
#    so process 0 decides and **broadcasts** the decision and the tensors it read.
#
#    </details>
#
# 3. In section 3's batch, why do the processes send nothing to each other while they generate,
#    and what would make a finished prompt count as not done on the next run?
#
#    <details><summary>Answer</summary>
#
#    Each process runs its own prompts (index modulo the process count) on its own devices, a
#    separate mesh per process. A prompt is done only when its JSON record parses, names this
#    request's settings fingerprint, and the mp4's checksum matches: a cut mp4, a missing record or
#    a changed setting (a new seed) makes it redo that prompt.
#
#    </details>
#
# 4. The v6e-16 plan has half the compute floor of the v6e-8 plan. Why is its step floor not half?
#
#    <details><summary>Answer</summary>
#
#    The all-reduces now run over 8-chip `tp` groups and each chip sends `2(n-1)/n` of the same
#    activations, 7/6 of the v6e-8's bytes, at the same 200 GB/s a ring gets from a chip. The ICI
#    floor did not fall and now lies above the halved compute floor: the step is communication-bound.
#
#    </details>
#
# 5. Why does the v6e-64 plan send far more than the v6e-16, when it only doubles the chips again?
#
#    <details><summary>Answer</summary>
#
#    Its `tp` axis has 32 chips and 48 heads do not divide 32 ways, so attention falls back to
#    splitting queries along the sequence, and the compiler re-shards activations around every
#    attention with all-gathers, all-to-alls and collective-permutes. The mesh no longer matches the
#    model's shape; data parallelism over hosts scales instead.
#
#    </details>
