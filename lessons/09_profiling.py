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
# # 09 · Profiling: where a step's time and memory go
#
# A plan (notebook `plan_without_tpu`) says whether a program fits and how fast it could be. A profile says
# what it actually did. On a GPU you would reach for Nsight Systems or `torch.profiler`; on a
# TPU the tool is JAX's profiler, whose traces XProf (the TensorBoard profile plugin's successor)
# displays. This notebook takes the three measurements you need before tuning anything, on the
# tiny CogVideoX pipeline of notebook `cogvideox_pipeline`:
#
# 1. **a trace of the denoising step**, read back in Python: how its time splits between
#    attention, the other matmuls, collectives and everything else;
# 2. **the persistent compilation cache** at work: a second process that compiles nothing;
# 3. **device memory over a run**, stage by stage and step by step.
#
# Then the same recipe on a TPU VM, as text. On the 8 simulated CPU devices the shares are the
# CPU's, not a TPU's (section 1 says which parts carry over); the method is the same.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | notebook `cogvideox_pipeline`'s random 2-layer CogVideoX checkpoint, 8 simulated devices | about 1 GB of host RAM | about 60 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | `zai-org/CogVideoX1.5-5B`, the text encoder and the transformer | per chip as notebook `cogvideox_pipeline`'s stages (T5-XXL 2.2 GiB, the step 5.6 GiB at 1360x768, AOT here) | two denoising steps traced, plus three short processes that compile the step (the third for Exercise 2): minutes, most of it the first compile |
#
# *Reading time: about 18 minutes.*

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

from tpupedia import session

preset = session.start()
preset.name

# %% [markdown]
# ## 1. A trace of the denoising step
#
# The pipeline of notebook `cogvideox_pipeline` on this preset's checkpoint, kept `resident` so that its models
# and compiled programs stay between calls. It runs once untraced first: the first call
# compiles, and a profile of a compile measures the compiler, not the step. Then
# `jax.profiler.trace(folder)` records everything the process does inside the block, on the
# host and on every device, into `folder/plugins/profile/<run>/<host>.xplane.pb`: the file XProf
# opens.

# %%
import tempfile
from pathlib import Path

import jax
import torch

from tpupedia import devices
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import cogvideox as pipeline

source, label = family.model_source(preset)
mesh = devices.make_mesh(pipeline.default_mesh_shape(jax.device_count()), ("dp", "tp"))
options = pipeline.Options(quiet=True)
pipe = pipeline.CogVideoX(source, label, getattr(torch, preset.dtype), mesh, options)
pipe.resident = True  # keep the models and the compiled step between calls
request = pipeline.Request(prompt="A panda plays a guitar.", negative_prompt="blurry",
                           **(family.default_request(preset) | {"steps": 2}))
embeds, _ = pipe.encode_text(request)
pipe.denoise(request, embeds)  # compiles the step: left out of the trace

scratch = Path(tempfile.mkdtemp(prefix="tpupedia-12-"))
with jax.profiler.trace(scratch / "trace"):
    latents, timings = pipe.denoise(request, embeds)
(trace_file,) = (scratch / "trace").glob("plugins/profile/*/*.xplane.pb")  # <run> is a timestamp, <host> this machine
print("one trace file:", trace_file.relative_to(scratch / "trace").parts[:2], "...", "".join(trace_file.suffixes))

# %% [markdown]
# ## 2. Reading the trace
#
# XProf's trace viewer shows the file as a timeline (section 5 says how to open it). The same
# data is there in Python: `jax.profiler.ProfileData` reads the file into *planes* (one per host
# and per device kind), each with *lines* (threads, or a device's streams) of timed *events*.
# On this CPU each simulated device runs its share of the program on its own threads, and every
# event that executes an HLO instruction carries the instruction's name (`hlo_op`), its
# program (`hlo_module`) and the device (`device_ordinal`):

# %%
# NBVAL_IGNORE_OUTPUT
from collections import defaultdict

profile = jax.profiler.ProfileData.from_file(str(trace_file))
op_seconds = defaultdict(float)  # (program, HLO instruction) -> seconds, summed over devices and steps
for plane in profile.planes:
    for line in plane.lines:
        for event in line.events:
            stats = dict(event.stats)
            if "hlo_op" in stats:
                op_seconds[stats["hlo_module"], stats["hlo_op"]] += event.duration_ns / 1e9
programs = defaultdict(float)
for (module, _), seconds in op_seconds.items():
    programs[module] += seconds
for module, seconds in sorted(programs.items(), key=lambda kv: -kv[1]):
    print(f"{module:32} {seconds:8.3f} device-seconds")

# %% [markdown]
# The step is the program that dominates. Its events name HLO instructions, so the compiled
# program's text says what each one is: a collective by its opcode; a matmul if it is a `dot`
# or a fusion whose body holds one; attention if its result is a score matrix, the sequence
# against itself (`[..., S, S]`: the reference attention on this CPU; on a TPU, splash's
# kernel is one custom call instead). `tpupedia.plan.programs` rebuilds the step the pipeline
# compiled (notebook `hunyuan_tuning_and_i2v` will count a DeepCache step's FLOPs this way), and compiling it gives the same
# instruction names, which the coverage check below confirms.

# %%
import re

from tpupedia import plan as planner

(step_program,) = planner.programs("cogvideox", request, options, pipe.configs, mesh, "denoise", dtype=preset.dtype)
step_hlo = step_program.compile().compiled.as_text()
step_module = max(programs, key=programs.get)
t = pipe.configs["transformer"]
sequence = t["max_text_seq_length"] + family.video_tokens(request.width, request.height, request.frames, pipe.shapes)

computations = dict(re.findall(r"(?ms)^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", step_hlo))
instructions = dict(re.findall(r"(?m)^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", step_hlo))


def body(instruction: str) -> str:
    """The instruction's line and the bodies of the computations it calls, recursively."""
    line = instructions.get(instruction, "")
    called = re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line)
    return line + "".join(computations.get(c, "") for c in called)


def category(instruction: str) -> str:
    line, text = instructions.get(instruction, ""), body(instruction)
    if re.search(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start|-done)?\(", line):
        return "collectives"
    if re.search(rf"\[[\d,]*\b{sequence},{sequence}\]", text) and re.search(r"\b(dot|custom-call)\(", text):
        return "attention"
    if re.search(r"\b(dot|convolution)\(", text):
        return "other matmuls"
    return "everything else"


# %% [markdown]
# The shares (a timing: nbval does not compare this cell's output):

# %%
# NBVAL_IGNORE_OUTPUT
shares = defaultdict(float)
for (module, op), seconds in op_seconds.items():
    if module == step_module:
        shares[category(op) if op in instructions else "not in the HLO"] += seconds
total = sum(shares.values())
print(f"{step_module}: {total:.3f} device-seconds over {request.steps} steps, sequence {sequence} tokens")
for name in ("attention", "other matmuls", "collectives", "everything else", "not in the HLO"):
    print(f"  {name:16} {shares[name] / total:6.1%}")


# %% tags=["check"]
assert trace_file.stat().st_size > 0 and step_module.startswith("jit_")
assert shares["not in the HLO"] < 0.05 * total  # the rebuilt step names the traced instructions
assert all(shares[name] > 0 for name in ("attention", "other matmuls", "collectives"))
from tpupedia import traces  # the same reading, kept in the package for notebook tune_before_you_rent

assert traces.op_seconds(trace_file) == dict(op_seconds)
assert traces.shares(op_seconds, step_module, step_hlo, sequence) == {k: shares[k] for k in traces.CATEGORIES}

# %% [markdown]
# ### Exercise 1: count the events of one instruction
#
# A share is a sum of events. Before summing time, count: the traced block called the step
# `request.steps` times on a mesh of `jax.device_count()` devices. **Predict** first: how many
# events the trace holds for one instruction of the step, say its first all-reduce, and on how
# many distinct devices; and how many of the step's instructions are collectives, given the two
# all-reduces per block of notebook `cogvideox_pipeline` and the pair that guidance splits and
# combines over `dp`. Then open the solution, run it, and compare.

# %% tags=["solution"]
from collections import Counter

events_per_op, devices_per_op = Counter(), defaultdict(set)
for plane in profile.planes:
    for line in plane.lines:
        for event in line.events:
            stats = dict(event.stats)
            if stats.get("hlo_module") == step_module and "hlo_op" in stats:
                events_per_op[stats["hlo_op"]] += 1
                devices_per_op[stats["hlo_op"]].add(stats.get("device_ordinal"))
collective_ops = sorted(op for op in events_per_op if category(op) == "collectives")
# how many instructions the step has depends on the CPU compiler's fusion (its ISA and threads),
# so the line below counts events per instruction, not instructions
print("events per instruction of the step in the trace:", sorted(set(events_per_op.values())))
print(f"{len(collective_ops)} collectives over {t['num_layers']} blocks:")
for op in collective_ops:
    result_and_opcode = re.sub(r"\{[\d,]*\}", "", instructions[op].split("(%")[0])  # layouts dropped
    print(f"  {op:20} {events_per_op[op]:>3} events on {len(devices_per_op[op])} devices: {result_and_opcode}")

# %% tags=["check"]
all_reduces = [op for op in collective_ops if " all-reduce(" in instructions[op] or " all-reduce-start(" in instructions[op]]
assert len(all_reduces) >= 2 * t["num_layers"]  # to_out and ff.net.2 in every block
assert all(len(devices_per_op[op]) == jax.device_count() for op in collective_ops)  # every device runs each one
if jax.default_backend() == "cpu":  # one event per instruction, per call, per device (measured here)
    assert set(events_per_op.values()) == {request.steps * jax.device_count()}

# %% [markdown]
# Read these shares for what they are. The devices here are threads of one 2-core CPU, so a
# collective is mostly waiting: an all-reduce cannot finish until every participating thread
# has reached it, and the event's duration includes that wait. Eight devices on two cores wait
# a lot. On a TPU the devices run in parallel, the collectives travel over the chips' ICI
# links, and XLA overlaps them with compute where it can; the matmuls run on the MXUs, and
# attention is splash's kernel. The upstream project profiled a HunyuanVideo-1.5 block on a
# TPU v6e-8 and reports about 35 ms in splash attention and about 45 ms in the linear layers
# with their all-reduces (reported upstream; yangwhale/gpu-tpu-pedia, commit 3fa9ce1,
# `tpu/HunyuanVideo-1.5/generate_hunyuan_torchax_staged/TORCHAX_MIGRATION_GUIDE.md`). What
# carries over from this CPU is the method: trace the steady state, read the events by HLO
# instruction, and classify them from the compiled program.

# %% [markdown]
# ## 3. The persistent compilation cache
#
# A full-size step compiles for minutes (notebook `plan_without_tpu`'s dry-run: 182 s for CogVideoX's on a
# CPU host; upstream reports about 60 s for a HunyuanVideo-1.5 program on a TPU VM, and about
# 5 s to load it from the cache). `jax_compilation_cache_dir` makes JAX write each compiled
# program to a folder, keyed by the program and the compiler's options, and a later process
# with the same program reads it back instead of compiling. `tpupedia generate` turns it on
# for the full preset (`--compilation-cache`). Here two fresh processes compile the tiny step
# with one cache folder, and JAX's monitoring events say what happened in each. The settings go
# in twice: as environment variables, which JAX reads at import, so the small programs it
# compiles while starting up land in the same folder whatever the parent process had set (a
# size limit, for one, would add a file of access times beside each entry); and through
# `jax.config.update`, the way to change them from Python:

# %%
import json
import os
import subprocess
import sys

probe = """
import json, sys, time, jax
from tpupedia import session
preset = session.start()
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
events = []
jax.monitoring.register_event_listener(lambda event, **kw: events.append(event))
import torch
from tpupedia import devices, plan
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import cogvideox as pipeline
source, label = family.model_source(preset)
mesh = devices.make_mesh(pipeline.default_mesh_shape(jax.device_count()), ("dp", "tp"))
request = pipeline.Request(prompt="a panda", **(family.default_request(preset) | {"steps": 2}))
(step,) = plan.programs("cogvideox", request, pipeline.Options(quiet=True), family.component_configs(source), mesh,
                        "denoise", dtype=preset.dtype)
start = time.perf_counter()
step.compile()
print(json.dumps({"seconds": time.perf_counter() - start,
                  "cache hits": events.count("/jax/compilation_cache/cache_hits"),
                  "cache misses": events.count("/jax/compilation_cache/cache_misses")}))
"""
cache = scratch / "jax-cache"
runs = []
for _ in range(2):
    done = subprocess.run([sys.executable, "-c", probe, str(cache)], capture_output=True, text=True, check=True,
                          env=os.environ | {"TPUPEDIA_PRESET": preset.name, "JAX_COMPILATION_CACHE_DIR": str(cache),
                                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                                            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                                            "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"})
    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
entries = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
for i, run in enumerate(runs, 1):
    print(f"process {i}: cache hits {run['cache hits']}, misses {run['cache misses']}")
print(f"the cache folder holds {len(entries)} compiled program(s)")

# %% [markdown]
# And how long each compile took (a timing, not compared by nbval):

# %%
# NBVAL_IGNORE_OUTPUT
for i, run in enumerate(runs, 1):
    print(f"process {i}: {run['seconds']:.2f} s to compile the step")

# %% tags=["check"]
assert runs[0]["cache misses"] >= 1 and runs[0]["cache hits"] == 0  # the first process compiles and writes
assert runs[1]["cache hits"] >= 1 and runs[1]["cache misses"] == 0  # the second only reads
assert len(entries) >= 1

# %% [markdown]
# ### Exercise 2: a third process, one step more
#
# The cache is keyed by the program, not by the request. A third process uses the same cache
# folder, but its request asks for 3 denoising steps instead of 2 (the schedule's tables are
# arrays the step closes over, notebook `cogvideox_pipeline`). **Predict** first: does it read
# the step from the cache or compile it, and does the folder grow? JAX's small start-up programs
# are counted too, so also guess whether every one of them is still a hit. Then open the
# solution, run it, and compare.

# %% tags=["solution"]
three_steps = probe.replace('{"steps": 2}', '{"steps": 3}')
assert three_steps != probe  # the request line of the probe changed
done = subprocess.run([sys.executable, "-c", three_steps, str(cache)], capture_output=True, text=True, check=True,
                      env=os.environ | {"TPUPEDIA_PRESET": preset.name, "JAX_COMPILATION_CACHE_DIR": str(cache),
                                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                                        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
                                        "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"})
third = json.loads(done.stdout.strip().splitlines()[-1])
entries_after = sorted(p.name for p in cache.iterdir() if not p.name.startswith("."))
print(f"process 3 (3 steps): cache hits {third['cache hits']}, misses {third['cache misses']}")
print(f"the cache folder holds {len(entries_after)} compiled program(s), {len(entries_after) - len(entries)} new")

# %% tags=["check"]
assert third["cache misses"] >= 1  # another schedule is another program: compiled, not read
assert third["cache hits"] + third["cache misses"] == runs[1]["cache hits"]  # as many programs asked for as before
assert len(entries_after) == len(entries) + third["cache misses"]  # each miss wrote one entry

# %% [markdown]
# ## 4. Device memory over a run
#
# On a TPU, `device.memory_stats()` reports the allocator's numbers (`bytes_in_use`,
# `peak_bytes_in_use`, `bytes_limit`). On a CPU it may report nothing at all, so this section
# counts what JAX itself holds: `jax.live_arrays()` lists every array alive in the process, and
# each array's sharding says what shape of it sits on which device. Sampling that after every
# denoising step, and between stages, of a pipeline that frees each stage's model when it is
# done (not `resident`) draws the run's memory timeline. One trap: do not count through
# `array.addressable_shards[i].data`. Asking for a shard's data creates a new array object for it,
# which the next `live_arrays()` lists too, so the count doubles after the first sample (it did
# here); the sharding's shard shape gives the bytes without creating anything. A second trap
# shows first: `del` does not free the resident pipeline of section 1. It and its compiled step
# refer to each other, so its arrays wait for Python's cycle collector:

# %%
import gc
import math


def bytes_on_device_0() -> int:
    """Bytes of every live array's shard on device 0 (one chip's share of the mesh)."""
    device = jax.devices()[0]
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.live_arrays()
               if device in a.sharding.device_set)


print("memory_stats() on this backend:", jax.devices()[0].memory_stats())
before = bytes_on_device_0()
del pipe, embeds, latents
after_del = bytes_on_device_0()
gc.collect()  # the pipeline and its compiled step refer to each other: only the cycle collector frees them
print(f"section 1's resident pipeline: {before / 2**20:.2f} MiB on device 0, {after_del / 2**20:.2f} MiB after `del`, "
      f"{bytes_on_device_0() / 2**20:.2f} MiB after gc.collect()")
timeline = [("start", bytes_on_device_0())]
run_pipe = pipeline.CogVideoX(source, label, getattr(torch, preset.dtype), mesh, options)
run_embeds, _ = run_pipe.encode_text(request)
timeline.append(("text done", bytes_on_device_0()))
run_latents, _ = run_pipe.denoise(request, run_embeds,
                                  on_step=lambda i, x: timeline.append((f"step {i}", bytes_on_device_0())))
timeline.append(("denoise done", bytes_on_device_0()))
run_frames, _ = run_pipe.decode(request, run_latents["latents"])
timeline.append(("decode done", bytes_on_device_0()))
for name, size in timeline:
    print(f"{name:14} {size / 2**20:9.2f} MiB on device 0")
print(f"of which the transformer's shard while it steps: {run_pipe.plans['transformer'].bytes_per_device / 2**20:.2f} MiB "
      "(the rest: latents, the text pair, the rotary tables)")

# %% [markdown]
# Drawn over the run, the shape to look for is a plateau: memory rises when the denoise stage
# places the transformer's shard, stays flat over the steps (a rise from step to step would be
# something kept alive by each step, the leak this timeline exists to catch), and falls back when
# the stage frees its model, before the decode. The text and decode stages show nothing: the
# timeline samples after each of them, when its model is already freed (sample inside a stage,
# as `on_step` does for the denoise, to see its peak). On a TPU VM with the full preset the same
# picture is in GiB, and the plateau is the number to compare with the plan's weights per chip.

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6.5, 2.6))
ax.step(range(len(timeline)), [size / 2**20 for _, size in timeline], where="post")
ax.set_xticks(range(len(timeline)), [name for name, _ in timeline], rotation=30, ha="right", fontsize=8)
ax.set_ylabel("MiB on device 0")
plt.tight_layout()
plt.show()

# %%
during = [size for name, size in timeline if name.startswith("step")]
weights_share = run_pipe.plans["transformer"].bytes_per_device
assert len(during) == request.steps and min(during) >= weights_share, (timeline, weights_share)  # the transformer's shard is there while it steps
assert max(during) == min(during), timeline  # and nothing accumulates from step to step
assert timeline[-2][1] < weights_share, timeline  # it is gone once the stage is done
assert after_del == before and bytes_on_device_0() < weights_share  # freed by the collector, not by del
memory_stats = jax.devices()[0].memory_stats()
assert memory_stats is None or "bytes_in_use" in memory_stats

# %% [markdown]
# ## 5. The same on a TPU VM
#
# The recipe does not change; the tools around it do.
#
# - **Trace the steady state.** Run once to compile, then wrap a few steps in
#   `jax.profiler.trace("/tmp/trace")` as in section 1. For a long run, start a profiler server
#   in the process (`jax.profiler.start_server(9999)`) and capture a few seconds on demand from
#   XProf instead.
# - **Open it in XProf.** `pip install xprof`, then `xprof --logdir /tmp/trace --port 8791` on the
#   VM and `gcloud compute tpus tpu-vm ssh VM --zone ZONE -- -L 8791:localhost:8791` from your
#   laptop; the trace viewer shows one row per chip, with the HLO instructions on each chip's
#   timeline, and the op profile groups them as section 2 did. On a TPU the categories come
#   labelled: splash's custom call, the `dot`/`convolution` fusions, and the collectives, with
#   how much of each overlaps the others.
# - **Keep the cache.** Point `--compilation-cache` (or `jax_compilation_cache_dir`) at a folder
#   that outlives the VM's processes; on a multi-host slice, one every host can read.
# - **Watch memory.** `jax.devices()[0].memory_stats()` gives the allocator's `bytes_in_use` and
#   `peak_bytes_in_use` per chip; `jax.profiler.save_device_memory_profile("mem.prof")` writes
#   what holds the memory, by the Python line that allocated it, for `pprof`. The plan of
#   notebook `plan_without_tpu` says what the peak should be; compare.
#
# ## Takeaways
#
# - Profile the steady state: the first call compiles, and a trace of it is a trace of the
#   compiler.
# - A trace is data. `jax.profiler.ProfileData` reads it in Python, and each device event names
#   its HLO instruction, so the compiled program's text sorts the time into attention, matmuls,
#   collectives and the rest.
# - On simulated CPU devices, collectives measure threads waiting for each other; only the
#   method carries over to a TPU, not the shares.
# - The persistent compilation cache turns a second process's compile into a file read: the
#   second process here had no misses.
# - Memory over a run is a sum over `jax.live_arrays()` where the backend has no allocator
#   statistics, counted from each array's shard shape: each stage's model appears when it loads
#   and leaves when it is done.
#
# ## Further reading
#
# - [Debugging and profiling on TPU](../kb/debugging-profiling.md): the knowledge-base page on
#   the same tools, with upstream's TPU profiles.
# - [Plan a TPU run without a TPU](08_plan_without_tpu.ipynb): the numbers a profile is checked
#   against.

# %% [markdown]
# ## Self-check
#
# 1. Why does section 1 run the denoising stage once before it starts the trace?
#
#    <details><summary>Answer</summary>
#
#    The first call traces and compiles the step, which takes far longer than a step. A trace of
#    it would measure the compiler, not the program you mean to tune.
#
#    </details>
#
# 2. On the simulated CPU devices, collectives take most of the step's time. Why does that not
#    mean a TPU run of this step is communication-bound?
#
#    <details><summary>Answer</summary>
#
#    Here eight devices are threads on two cores, and a collective's event lasts until every
#    thread has reached it, so it mostly measures waiting. On a TPU the chips run in parallel,
#    collectives travel over ICI and XLA overlaps them with compute; only the method carries over.
#
#    </details>
#
# 3. How does a trace event get sorted into attention, matmuls or collectives, when the trace
#    itself only names an HLO instruction?
#
#    <details><summary>Answer</summary>
#
#    The instruction name is looked up in the compiled program's text: its opcode says whether it
#    is a collective, the computations it calls say whether it holds a `dot` or a convolution,
#    and a result of `[..., S, S]` marks the attention scores. The program is rebuilt with
#    `tpupedia.plan.programs`, and the coverage check confirms it names the traced instructions.
#
#    </details>
#
# 4. A second process with the same program compiles nothing. What would make it miss the cache
#    again, and what would not?
#
#    <details><summary>Answer</summary>
#
#    The key is the program and the compiler's options: other shapes, other constants baked into
#    the program (the schedule's tables, Exercise 2), another mesh or another jax or libtpu
#    version make a miss. A new prompt or seed does not, since they only change the values of
#    the arguments.
#
#    </details>
#
# 5. Why does section 4 count bytes from each array's shard shape, and not through
#    `array.addressable_shards[i].data`?
#
#    <details><summary>Answer</summary>
#
#    Asking for a shard's data creates a new array object, which the next `jax.live_arrays()`
#    lists too, so every sample would count more than the one before. The sharding's shard shape
#    gives the bytes without creating anything.
#
#    </details>
