"""Benchmarks that separate the first call (tracing + compilation) from the steady state.

Every record says where it was measured (platform, device kind, CPU count, library versions)
and how (the command), and is merged into one JSON results file that the docs' results page
renders. Targets live here and in that file, never in timed unit tests.

Introduced with `tpupedia bench llama` (notebook `hf_model_in_jax`'s model at a mid size); notebook `plan_without_tpu` adds
`bench dit`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tpupedia import results
from tpupedia.results import machine

__all__ = [
    "DEFAULT_RESULTS",
    "Timing",
    "time_call",
    "merge_record",
    "bench_llama",
    "bench_dit",
    "DEFAULT_PIPELINE_RESULTS",
    "bench_generate",
    "stock_steps",
    "bench_stepcache",
    "bench_deepcache",
    "bench_quantize",
    "step_cache_bound",
    "FIRST_VIDEO_PROMPT",
    "DEFAULT_FIRST_VIDEO_RESULTS",
    "FirstVideoError",
    "bench_first_video",
    "first_video_key",
]

DEFAULT_RESULTS = Path("docs/results/benchmarks.json")


@dataclass(frozen=True)
class Timing:
    """First call and steady-state seconds of one callable."""

    first_s: float
    steady_s: float
    """Median of the repeated calls after the first."""
    repeats: int
    samples_s: tuple[float, ...] = field(default=(), repr=False)


def time_call(fn: Callable[[], Any], sync: Callable[[Any], Any] = lambda x: x, repeat: int = 5) -> Timing:
    """Time `fn()` once cold and `repeat` times warm; `sync(result)` waits for the device."""
    start = time.perf_counter()
    sync(fn())
    first = time.perf_counter() - start
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        sync(fn())
        samples.append(time.perf_counter() - start)
    return Timing(first, statistics.median(samples), repeat, tuple(samples))


def _key(record: dict[str, Any]) -> tuple:
    m = record["machine"]
    return (record["bench"], json.dumps(record["config"], sort_keys=True), m["device_kind"], m["cpu_count"])


def merge_record(record: dict[str, Any], path: str | os.PathLike = DEFAULT_RESULTS,
                 key: Callable[[dict[str, Any]], tuple] | None = None) -> Path:
    """Merge `record` into a results file (`tpupedia.results.merge`), by default replacing an
    earlier record of the same bench, config and machine."""
    return results.merge(record, path, key or _key)


def _with_peak(record: dict[str, Any]) -> dict[str, Any]:
    """Add achieved FLOP/s and, where the chip's peak is known, MFU for the jitted run."""
    from tpupedia.hardware import chip_for_device_kind

    flops = record["approx_matmul_flops"]
    record["achieved_flops_per_s"] = {
        "torch_eager": flops / record["torch_eager"]["steady_s"],
        "torchax_jit": flops / record["torchax_jit"]["steady_s"],
    }
    chip = chip_for_device_kind(record["machine"]["device_kind"])
    record["mfu_torchax_jit"] = (record["achieved_flops_per_s"]["torchax_jit"] / chip.bf16_flops) if chip else None
    return record


def bench_llama(layers: int = 8, hidden: int = 512, seq: int = 512, batch: int = 4,
                repeat: int = 5, seed: int = 0) -> dict[str, Any]:
    """One forward of a random Llama: PyTorch eager vs torchax jitted, same machine, same run.

    Heads are `hidden // 64` (head dim 64), KV heads half of that, MLP `4 * hidden`,
    float32, no KV cache. Returns a results record (see `merge_record`).
    """
    import jax
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpupedia import torchax_utils

    heads = max(1, hidden // 64)
    config = dict(layers=layers, hidden=hidden, seq=seq, batch=batch, heads=heads,
                  kv_heads=max(1, heads // 2), dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=config["kv_heads"],
        max_position_embeddings=max(seq, 2048), use_cache=False,
    )).eval()
    ids = torch.randint(0, 32000, (batch, seq), generator=torch.Generator().manual_seed(seed))

    with torch.no_grad():
        eager = time_call(lambda: model(ids).logits, repeat=repeat)
        reference = model(ids).logits

    env = torchax_utils.default_env()
    torchax_utils.register_common_outputs()
    with env:
        model.to("jax")
        ids_jax = ids.to("jax")
        jitted = torchax_utils.JitModule(model)
        jit = time_call(lambda: jitted(ids_jax).logits, sync=lambda t: jax.block_until_ready(t.jax()), repeat=repeat)
        got = jitted(ids_jax).logits.to("cpu")
    error = float((got - reference).abs().max())
    flops = 2 * sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * batch * seq
    return _with_peak({
        "bench": "llama",
        "config": config,
        "machine": machine(),
        "torch_eager": asdict(eager) | {"samples_s": list(eager.samples_s)},
        "torchax_jit": asdict(jit) | {"samples_s": list(jit.samples_s)},
        "ratio_jit_over_eager": jit.steady_s / eager.steady_s,
        "max_abs_diff": error,
        "approx_matmul_flops": flops,
        "measured_at": _dt.date.today().isoformat(),
        "command": f"tpupedia bench llama --layers {layers} --hidden {hidden} --seq {seq} --batch {batch} --repeat {repeat}",
    })


DIT_HELP = "one denoising step of a video family's transformer: torchax jit vs PyTorch eager and torch.compile"
"""`tpupedia bench dit`'s help line."""


def _dit_family() -> Any:
    """The video family whose module builds the benchmark's transformer (`bench_step`)."""
    from tpupedia import families

    return next(s for s in families.video() if hasattr(s.facts, "bench_step"))


def bench_dit(layers: int = 2, heads: int = 8, head_dim: int = 64, frames: int = 9, height: int = 64,
              width: int = 64, text_tokens: int = 32, repeat: int = 5, torch_compile: bool = True,
              seed: int = 0) -> dict[str, Any]:
    """One denoising step of a video transformer (CFG batch 2), float32: PyTorch eager,
    `torch.compile` (when it works here) and torchax jitted, same machine and run. The
    transformer and its inputs come from the family module that has a `bench_step` (its
    architecture at the given width and depth; see that function's docstring)."""
    import jax
    import torch

    from tpupedia import torchax_utils

    model, inputs, flops = _dit_family().facts.bench_step(layers, heads, head_dim, frames, height, width,
                                                          text_tokens, seed)
    config = dict(layers=layers, heads=heads, head_dim=head_dim, frames=frames, height=height, width=width,
                  text_tokens=text_tokens, batch=2, dtype="float32")

    def eager_step():
        return model(**inputs, return_dict=False)[0]

    with torch.no_grad():
        eager = time_call(eager_step, repeat=repeat)
        reference = eager_step()
        compiled = None
        if torch_compile:
            try:
                compiled_model = torch.compile(model)
                compiled = time_call(lambda: compiled_model(**inputs, return_dict=False)[0], repeat=repeat)
            except Exception as err:  # noqa: BLE001 - recorded, not fatal: torch.compile needs a toolchain
                compiled = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"

    env = torchax_utils.default_env()
    torchax_utils.register_common_outputs()
    with env:
        model.to("jax")
        on_device = {k: tuple(a.to("jax") for a in v) if isinstance(v, tuple) else v.to("jax") for k, v in inputs.items()}
        jitted = torchax_utils.JitModule(model)

        def jit_step():
            return jitted(**on_device, return_dict=False)[0]

        jit = time_call(jit_step, sync=lambda out: jax.block_until_ready(out.jax()), repeat=repeat)
        got = jit_step().to("cpu")
    record = {
        "bench": "dit",
        "config": config,
        "machine": machine(),
        "torch_eager": asdict(eager) | {"samples_s": list(eager.samples_s)},
        "torch_compile": (asdict(compiled) | {"samples_s": list(compiled.samples_s)}) if isinstance(compiled, Timing) else compiled,
        "torchax_jit": asdict(jit) | {"samples_s": list(jit.samples_s)},
        "ratio_jit_over_eager": jit.steady_s / eager.steady_s,
        "max_abs_diff": float((got - reference).abs().max()),
        "approx_matmul_flops": flops["total"],
        "measured_at": _dt.date.today().isoformat(),
        "command": (f"tpupedia bench dit --layers {layers} --heads {heads} --head-dim {head_dim} --frames {frames} "
                    f"--height {height} --width {width} --text-tokens {text_tokens} --repeat {repeat}"),
    }
    return _with_peak(record)


DEFAULT_PIPELINE_RESULTS = Path("docs/results/pipelines.json")


def _pipeline_key(record: dict[str, Any]) -> tuple:
    m = record["machine"]
    return (record["bench"], json.dumps(record["config"], sort_keys=True), m["device_kind"], m["devices"])


def bench_generate(family: str, preset: Any, request: Any, options: Any, model: str | None = None,
                   stock: bool | None = None, command: str | None = None, plan: str = "auto",
                   vae_tiling: str | None = None) -> dict[str, Any]:
    """Run the three stages of `family` (`tpupedia.pipelines.<family>`) once, in a temporary work
    directory, and return a results record with each stage's first-call and steady timings, the
    whole run's wall time and where it ran. With `stock` (the default where the checkpoint is a
    tiny one: a stock pipeline runs on the host), the family's stock diffusers pipeline then runs
    the same request from the same checkpoint in the same process (`stock_steps`), and the record
    gives the ratio of the two steady step times (below 1: the compiled step is faster).
    `command` is recorded as the command that made the record; `plan` and `vae_tiling` are the
    run's (`tpupedia.pipelines.common.run`). Introduced with notebook `cogvideox_pipeline`, used by notebooks `hunyuan_video` and `wan_on_tpu`; `tpupedia bench generate FAMILY`
    writes the record."""
    import importlib
    import tempfile

    from tpupedia import families

    spec = families.get(family, "video")
    pipeline = importlib.import_module(spec.pipeline)
    stock = (not preset.pretrained) if stock is None else stock
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpupedia-bench-") as workdir:
        reports = pipeline.run(request, options, preset=preset, model=model, workdir=workdir, force=True,
                               log=lambda _: None, plan=plan, vae_tiling=vae_tiling)
    total = time.perf_counter() - start
    timings = {r.stage: r.timings for r in reports}
    source = spec.facts.model_source(preset, model)[0]
    record = {
        "bench": f"generate-{family}",
        "config": _pipeline_config(pipeline, preset, request, options, model) | {"mesh": _mesh(pipeline, source, request, options)},
        "machine": machine(),
        "stages": timings,
        "total_s": total,
        "measured_at": _dt.date.today().isoformat(),
        "command": command or (f"tpupedia bench generate {family} --preset {preset.name}" if model is None
                               else f"tpupedia bench generate {family} --model {model}"),
    }
    if stock:
        from tpupedia.pipelines import common

        record["stock"] = stock_steps(pipeline, source, request, common.torch_dtype(options, preset))
        record["ratio_step_over_stock"] = timings["denoise"]["steady_s"] / record["stock"]["steady_s"]
    return record


def _mesh(pipeline: Any, source: str, request: Any, options: Any) -> str:
    """The `dp=N,tp=M` mesh a run of `request` used on this process's devices."""
    import jax

    from tpupedia.pipelines import common

    configs = pipeline.PIPELINE.family.component_configs(source)
    dp, tp = common.mesh_shape(options, jax.device_count(), pipeline.PIPELINE.guidance_batch(request, configs))
    return f"dp={dp},tp={tp}"


def stock_steps(pipeline: Any, source: str, request: Any, dtype: Any) -> dict[str, Any]:
    """The stock diffusers pipeline of a family (`pipeline.stock`) on `request`, eager on the host
    as a new user runs it: its whole call's seconds and each denoising step's, timed between the
    ends of consecutive scheduler steps (the first also holds the text encoding and set-up, so
    `steady_s`, the median, leaves it out, as the compiled loop leaves out its compiling step)."""
    import numpy as np
    import torch

    pipe, call = pipeline.stock(source, request, dtype=dtype)
    ends, step = [], pipe.scheduler.step

    def timed_step(*args, **kwargs):
        out = step(*args, **kwargs)
        ends.append(time.perf_counter())
        return out

    pipe.scheduler.step = timed_step
    start = time.perf_counter()
    with torch.no_grad():
        pipe(**call)
    total = time.perf_counter() - start
    seconds = np.diff([start, *ends])
    return {"total_s": total, "steady_s": float(np.median(seconds[1:])) if len(seconds) > 1 else float(seconds[0]),
            "steps": len(seconds), "step_s": [round(float(t), 6) for t in seconds],
            "torch_threads": torch.get_num_threads()}


def _pipeline_config(pipeline: Any, preset: Any, request: Any, options: Any, model: str | None) -> dict[str, Any]:
    """A pipeline request and options as a results record's `config` (prompts left out)."""
    from tpupedia.pipelines import common

    config = {k: (str(getattr(request, k)) if k in ("deepcache", "step_cache") and v is not None else v)
              for k, v in asdict(request).items()
              if k not in ("prompt", "negative_prompt") and not (k in ("image", "quantize") and v is None)}
    return config | {"source": model or f"preset:{preset.name}", "attention": common.attention_backend(options.attention),
                     "vae": pipeline.PIPELINE.vae_choice(options), "sharding": options.sharding,
                     "dtype": str(common.torch_dtype(options, preset)).removeprefix("torch.")}


def bench_stepcache(family: str, preset: Any, request: Any, options: Any, model: str | None = None, *,
                    bench: str = "stepcache", plan: str = "auto",
                    vae_tiling: str | None = None) -> dict[str, Any]:
    """Video family `family` twice from the same seed, without and with its step cache
    (`request.step_cache`, or HunyuanVideo-1.5's `request.deepcache`): the steps run in full (a
    threshold's from its calibration pass, whose time is recorded apart), the denoising time (each
    program's first call left out, the per-step mean scaled to all steps), the speed-up against
    the bound the two compiled programs' FLOPs allow (`step_cache_bound`), and PSNR/SSIM of the
    cached video against the uncached one; `plan` and `vae_tiling` are each run's
    (`tpupedia.pipelines.common.run`). Notebooks `hunyuan_tuning_and_i2v` (DeepCache) and
    `fewer_steps`; `tpupedia bench stepcache FAMILY --step-cache SPEC` writes the record."""
    import dataclasses
    import importlib
    import tempfile

    import jax
    from safetensors.numpy import load_file

    from tpupedia import devices, families, metrics
    from tpupedia.pipelines import common, stepcache

    pipeline = importlib.import_module(families.get(family, "video").pipeline)
    field_name = "deepcache" if getattr(request, "deepcache", None) is not None else "step_cache"
    cache = getattr(request, field_name)
    if cache is None:
        raise common.PipelineError(f"bench {bench} {family}: give a step cache (--step-cache SPEC)")

    runs = {}
    for name, value in (("plain", None), ("cached", cache)):
        with tempfile.TemporaryDirectory(prefix="tpupedia-bench-") as workdir, common.step_times():
            reports = pipeline.run(dataclasses.replace(request, **{field_name: value}), options, preset=preset,
                                   model=model, workdir=workdir, force=True, log=lambda _: None, plan=plan,
                                   vae_tiling=vae_tiling)
            frames = load_file(f"{workdir}/decode.safetensors")["frames"]
        timings = {r.stage: r.timings for r in reports}["denoise"]
        full = set(timings.get("full_steps", range(request.steps)))
        cached_steps = set(range(request.steps)) - full
        compiling = {min(full)} | ({min(cached_steps)} if cached_steps else set())  # each program's first call
        timed = [t for i, t in enumerate(timings["step_s"]) if i not in compiling]
        runs[name] = {"frames": frames, "full": sorted(full), "full_steps": len(full),
                      "calibration_s": timings.get("calibration_s"),
                      "seconds": sum(timed) / len(timed) * request.steps}  # per-step mean, scaled to the run
    plain, cached = runs["plain"], runs["cached"]
    source = pipeline.PIPELINE.source(preset, model, request)[0]
    configs = families.get(family, "video").facts.component_configs(str(source))
    tail = cache.tail  # the blocks a DeepCache step runs (both kinds carry it)
    as_run = stepcache.StepCache("deepcache" if field_name == "deepcache" else cache.method, tail=tail,
                                 full=tuple(cached["full"]))  # the bound of the steps the run ran in full
    mesh = devices.make_mesh(common.mesh_shape(options, jax.device_count(), pipeline.PIPELINE.guidance_batch(request, configs)),
                             ("dp", "tp"))
    fields = {"step_cache": as_run} | ({"deepcache": None} if field_name == "deepcache" else {})
    bound = step_cache_bound(family, dataclasses.replace(request, **fields), options, configs, mesh)
    quality = metrics.compare(cached["frames"], plain["frames"])
    spec = str(cache) if field_name == "step_cache" else f"deepcache:{cache}"
    return {
        "bench": bench,
        "step_cache": spec,
        "config": _pipeline_config(pipeline, preset, request, options, model) | {"family": family},
        "machine": machine(),
        "result": {"steps": request.steps, "full_steps": cached["full_steps"], "plain_s": plain["seconds"],
                   "cached_s": cached["seconds"], "speedup": plain["seconds"] / cached["seconds"],
                   "bound": bound["bound"], "calibration_s": cached["calibration_s"], **quality},
        "measured_at": _dt.date.today().isoformat(),
        "command": (f"tpupedia bench {bench} {family} --preset {preset.name} --{field_name.replace('_', '-')} {cache} "
                    f"--steps {request.steps}"),
    }


def bench_quantize(family: str, preset: Any, request: Any, options: Any, model: str | None = None, *,
                   fmt: str = "int8", plan: str = "auto", vae_tiling: str | None = None) -> dict[str, Any]:
    """Video family `family` twice from the same seed, with the checkpoint's weights and with the
    transformers' linears in `fmt` (`tpupedia.quantize`, `Request.quantize`): PSNR, SSIM and the
    largest error of the quantized video against the other, beside the bound the tests assert
    (`quantize.TINY_BOUNDS`, for the tiny checkpoints), and each run's denoising time (the mean step
    after the compiling first one, scaled to all steps). On a CPU host the times say
    what the host did, not what a TPU would. Notebook `fewer_steps`; `tpupedia bench quantize
    FAMILY` writes the record."""
    import dataclasses
    import importlib
    import tempfile

    from safetensors.numpy import load_file

    from tpupedia import families, metrics, quantize

    if fmt not in quantize.FORMATS:  # refused before anything runs
        raise quantize.QuantizeError(f"bench quantize {family}: format {fmt!r} is not one of {', '.join(quantize.FORMATS)}")
    pipeline = importlib.import_module(families.get(family, "video").pipeline)
    runs = {}
    for name, value in (("plain", None), ("quantized", fmt)):
        with tempfile.TemporaryDirectory(prefix="tpupedia-bench-") as workdir:
            reports = pipeline.run(dataclasses.replace(request, quantize=value), options, preset=preset, model=model,
                                   workdir=workdir, force=True, log=lambda _: None, plan=plan, vae_tiling=vae_tiling)
            frames = load_file(f"{workdir}/decode.safetensors")["frames"]
        denoise = {r.stage: r.timings for r in reports}["denoise"]
        runs[name] = {"frames": frames, "seconds": denoise["steady_s"] * request.steps}
    quality = metrics.compare(runs["quantized"]["frames"], runs["plain"]["frames"])
    source = model or f"preset:{preset.name}"
    return {
        "bench": "quantize",
        "quantize": fmt,
        "config": _pipeline_config(pipeline, preset, dataclasses.replace(request, quantize=fmt), options, model)
        | {"family": family},
        "machine": machine(),
        "result": {"steps": request.steps, "plain_s": runs["plain"]["seconds"], "quantized_s": runs["quantized"]["seconds"],
                   **quality, "bound": dict(quantize.TINY_BOUNDS[fmt]) if source.startswith("preset:tiny") else None},
        "measured_at": _dt.date.today().isoformat(),
        "command": (f"tpupedia bench quantize {family} " + (f"--model {model}" if model else f"--preset {preset.name}")
                    + f" --quantize {fmt} --steps {request.steps}"),
    }


def bench_deepcache(family: str, preset: Any, request: Any, options: Any, model: str | None = None) -> dict[str, Any]:
    """`bench_stepcache` for a family's own DeepCache flag (`request.deepcache`, HunyuanVideo-1.5),
    recorded as `bench deepcache`. Notebook `hunyuan_tuning_and_i2v`."""
    return bench_stepcache(family, preset, request, options, model, bench="deepcache")


def step_cache_bound(family: str, request: Any, options: Any, configs: dict[str, dict], mesh: Any, *,
                     dtype: str = "float32") -> dict[str, Any]:
    """The most `request.step_cache` can speed the denoising of `family` up on `mesh`: XLA's FLOPs
    of its two compiled programs, the full step and the cached step (`tpupedia.plan.programs`,
    the models on `meta`, nothing run), and `tpupedia.pipelines.stepcache.speedup_bound` for
    its full steps (every step, for a threshold the calibration run has not picked yet; the
    first expert's pair for a two-expert checkpoint). Time is what `tpupedia bench deepcache`
    and `bench generate` measure; this is the ceiling the FLOPs allow."""
    from tpupedia import plan
    from tpupedia.pipelines import stepcache

    cache = request.step_cache
    programs = plan.programs(family, request, options, configs, mesh, "denoise", dtype=dtype)
    full, cached = programs[0].flops(), programs[1].flops()
    n_full = request.steps if cache.calibrated else len(cache.full_steps(request.steps))
    return {"step_cache": str(cache), "steps": request.steps, "full_steps": n_full, "full_flops": full,
            "cached_flops": cached, "bound": stepcache.speedup_bound(full, cached, request.steps, n_full)}


# --- the README's first video, as a user runs it --------------------------------------------------

FIRST_VIDEO_PROMPT = "a panda playing a guitar"
"""The README's prompt for its first video."""

DEFAULT_FIRST_VIDEO_RESULTS = Path("docs/results/first_video.json")

FIRST_RUN_UNSET = ("TPUPEDIA_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
"""Environment variables (by prefix) a user's first run does not have: this package's settings
(preset, model overrides, cache folder, a job's coordinates) and JAX's persistent compilation
cache, which the test session and `make test` set for their own processes."""

_WROTE = re.compile(r"^(\w+): wrote ")


class FirstVideoError(results.ResultsError):
    """The generate command under measurement failed (its status and last lines)."""


def _cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return platform.processor() or platform.machine()


def _first_video_run(family: str, prompt: str, cache: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """One `tpupedia generate FAMILY --preset tiny` in a new process, in a new empty folder, with
    `TPUPEDIA_CACHE=cache`: the wall time from starting the process to its exit, and its parts,
    from the moments its `STAGE: wrote` lines arrive (the process prints them unbuffered as each
    stage file is written) and the first calls its stage files record. The parts add up to the
    whole: until the first stage's first call (process start, imports, set-up, the tiny
    checkpoint if the cache lacks it, the first models' loading), each stage's first call and the
    rest of that stage (loading its models, writing its file), writing the mp4, and the exit."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tpupedia-first-video-") as folder:
        command = [sys.executable, "-m", "tpupedia.cli", "generate", family, "--preset", "tiny", "--prompt", prompt,
                   "--out", "x.mp4"]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=folder, env=env | {"TPUPEDIA_CACHE": str(cache), "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        marks: dict[str, float] = {}
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - start
            for part in line.rstrip("\n").split("\r"):
                found = _WROTE.match(part)
                if found and found.group(1) not in marks:
                    marks[found.group(1)] = now
                if part.strip():
                    tail = (tail + [part])[-20:]
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hung run
            proc.kill()
            raise FirstVideoError(f"bench first-video {family}: no video after {timeout_s:.0f} s") from None
        total = time.perf_counter() - start
        video = Path(folder) / "x.mp4"
        if status != 0 or "video" not in marks or not video.is_file() or video.stat().st_size == 0:
            raise FirstVideoError(f"bench first-video {family}: `{shlex.join(command[1:])}` exited with status "
                                  f"{status} and no video; its last lines: " + " | ".join(tail[-5:]))
        stages, machine_seen = {}, None
        for name in (m for m in marks if m != "video"):
            meta = json.loads((Path(folder) / "tpupedia-runs" / family / f"{name}.json").read_text())
            stages[name] = {"first_s": meta["extra"]["timings"]["first_s"]}
            machine_seen = meta["extra"]["machine"]
    previous = None
    for name, t in stages.items():  # in the order the stages ran
        ended = marks[name]
        if previous is None:
            until_first = ended - t["first_s"]
            t["rest_s"] = 0.0  # the first stage's loading is in until_first_call_s
        else:
            t["rest_s"] = ended - marks[previous] - t["first_s"]
        previous = name
    return {"cache": None, "load_before": round(load, 2), "total_s": total, "until_first_call_s": until_first,
            "stages": stages, "video_s": marks["video"] - marks[previous], "exit_s": total - marks["video"],
            "machine": machine_seen}


def bench_first_video(family: str, *, prompt: str = FIRST_VIDEO_PROMPT, runs: int = 2, again: bool = True,
                      cache: str | os.PathLike | None = None, timeout_s: float = 600) -> dict[str, Any]:
    """The README's first video (`tpupedia generate FAMILY --preset tiny --prompt ... --out
    x.mp4`) as a user runs it, `runs` times: each a new process in a new empty folder with a new
    empty `TPUPEDIA_CACHE` (so the tiny checkpoint is written, and nothing is compiled before),
    and the environment without this package's settings or a JAX compilation cache
    (`FIRST_RUN_UNSET`). With `again`, each is followed by a second run with the cache it left
    (the checkpoint written; the tiny preset keeps no compiled programs). `cache` runs every run
    with that cache folder instead (a user's later runs). A record: every run's wall time to
    the process's exit and its parts (`_first_video_run`), the best of each kind, the CPU, the
    date and the commands. `tpupedia bench first-video FAMILY` writes it; the results page
    renders it, and the README quotes it. A benchmark, not a test: nothing here is a target."""
    import shutil
    import tempfile

    if runs < 1:
        raise FirstVideoError(f"bench first-video: --runs must be a positive integer, got {runs}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(FIRST_RUN_UNSET)}
    measured, machine_seen = [], None
    for _ in range(runs):
        folder = Path(cache) if cache is not None else Path(tempfile.mkdtemp(prefix="tpupedia-first-video-cache-"))
        try:
            kinds = ("given" if cache is not None else "empty",) + (("kept",) if again else ())
            for kind in kinds:
                run = _first_video_run(family, prompt, folder, env, timeout_s)
                run["cache"] = kind
                machine_seen = run.pop("machine")
                measured.append(run)
        finally:
            if cache is None:
                shutil.rmtree(folder, ignore_errors=True)
    best = {kind: min((r["total_s"] for r in measured if r["cache"] == kind), default=None)
            for kind in ("empty", "kept", "given")}
    command = f"tpupedia bench first-video {family} --runs {runs}" + ("" if again else " --no-again")
    if prompt != FIRST_VIDEO_PROMPT:
        command += f" --prompt {shlex.quote(prompt)}"
    return {
        "bench": "first-video",
        "config": {"family": family, "preset": "tiny", "prompt": prompt},
        "machine": {"cpu": _cpu_model(), "cpu_count": os.cpu_count()} | (machine_seen or {}),
        "runs": measured,
        "best": {k: v for k, v in best.items() if v is not None},
        "measured_at": _dt.date.today().isoformat(),
        "command": command if cache is None else command + " --cache DIR",
        "generate": f"tpupedia generate {family} --preset tiny --prompt {shlex.quote(prompt)} --out x.mp4",
    }


def first_video_key(record: dict[str, Any]) -> tuple:
    """A first-video record replaces an earlier one of the same family on the same kind of CPU."""
    m = record["machine"]
    return (record["bench"], record["config"]["family"], m["cpu"], m["cpu_count"])
