"""Benchmarks that separate the first call (tracing + compilation) from the steady state.

Every record says where it was measured (platform, device kind, CPU count, library versions)
and how (the command), and is merged into one JSON results file that the docs' results page
renders. Targets live here and in that file, never in timed unit tests.

Introduced with `tpupedia bench llama` (notebook 01's model at a mid size); notebook 09 adds
`bench dit`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tpupedia import results
from tpupedia.models import cogvideox
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
    "bench_deepcache",
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


DIT_HELP = "one CogVideoX-shaped denoising step: torchax jit vs PyTorch eager and torch.compile"
"""`tpupedia bench dit`'s help line."""


def bench_dit(layers: int = 2, heads: int = 8, head_dim: int = 64, frames: int = 9, height: int = 64,
              width: int = 64, text_tokens: int = 32, repeat: int = 5, torch_compile: bool = True,
              seed: int = 0) -> dict[str, Any]:
    """One denoising step of a CogVideoX-shaped transformer (CFG batch 2), float32:
    PyTorch eager, `torch.compile` (when it works here) and torchax jitted, same machine and run.

    The architecture is CogVideoX1.5's (patch 2x2x2, 4x MLP, joint text-video attention) at
    the given width and depth; the full model is `layers=42, heads=48, head_dim=64`.
    """
    import jax
    import torch
    from diffusers import CogVideoXTransformer3DModel

    from tpupedia import torchax_utils

    cogvideox.check_frames(frames)
    cogvideox.check_size(width, height)
    config = dict(layers=layers, heads=heads, head_dim=head_dim, frames=frames, height=height, width=width,
                  text_tokens=text_tokens, batch=2, dtype="float32")
    full = cogvideox.full_transformer_config(layers)
    full.update(num_attention_heads=heads, attention_head_dim=head_dim, text_embed_dim=4 * heads * head_dim // 3 or 64,
                max_text_seq_length=text_tokens, sample_height=height // 8, sample_width=width // 8, sample_frames=frames)
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**full).eval()
    latent_frames, _ = cogvideox.padded_latent_frames(frames)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, latent_frames, 16, height // 8, width // 8, generator=g)
    text = torch.randn(2, text_tokens, full["text_embed_dim"], generator=g)
    t = torch.tensor([500, 500])
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    grid = (height // 16, width // 16)
    rope = get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=None, grid_size=grid,
                                   temporal_size=latent_frames // 2, grid_type="slice", max_size=grid)

    def eager_step():
        return model(hidden_states=x, encoder_hidden_states=text, timestep=t, image_rotary_emb=rope, return_dict=False)[0]

    with torch.no_grad():
        eager = time_call(eager_step, repeat=repeat)
        reference = eager_step()
        compiled = None
        if torch_compile:
            try:
                compiled_model = torch.compile(model)
                compiled = time_call(lambda: compiled_model(hidden_states=x, encoder_hidden_states=text, timestep=t,
                                                            image_rotary_emb=rope, return_dict=False)[0], repeat=repeat)
            except Exception as err:  # noqa: BLE001 - recorded, not fatal: torch.compile needs a toolchain
                compiled = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"

    env = torchax_utils.default_env()
    torchax_utils.register_common_outputs()
    with env:
        model.to("jax")
        xj, tj, cj = x.to("jax"), t.to("jax"), text.to("jax")
        rj = tuple(r.to("jax") for r in rope)
        jitted = torchax_utils.JitModule(model)

        def jit_step():
            return jitted(hidden_states=xj, encoder_hidden_states=cj, timestep=tj, image_rotary_emb=rj, return_dict=False)[0]

        jit = time_call(jit_step, sync=lambda out: jax.block_until_ready(out.jax()), repeat=repeat)
        got = jit_step().to("cpu")
    flops = cogvideox.step_flops(width, height, frames, layers=layers, heads=heads, head_dim=head_dim,
                                        text_tokens=text_tokens)
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


def bench_generate(family: str, preset: Any, request: Any, options: Any, model: str | None = None) -> dict[str, Any]:
    """Run the three stages of `family` (`tpupedia.pipelines.<family>`) once, in a temporary work
    directory, and return a results record with each stage's first-call and steady timings, the
    whole run's wall time and where it ran. Introduced with notebook 06 (CogVideoX), used for
    HunyuanVideo-1.5 by notebook 07; `tpupedia bench generate FAMILY` writes the record."""
    import importlib
    import tempfile

    from tpupedia import families

    pipeline = importlib.import_module(families.get(family, "video").pipeline)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tpupedia-bench-") as workdir:
        reports = pipeline.run(request, options, preset=preset, model=model, workdir=workdir, force=True,
                               log=lambda _: None)
    total = time.perf_counter() - start
    return {
        "bench": f"generate-{family}",
        "config": _pipeline_config(pipeline, preset, request, options, model),
        "machine": machine(),
        "stages": {r.stage: r.timings for r in reports},
        "total_s": total,
        "measured_at": _dt.date.today().isoformat(),
        "command": (f"tpupedia bench generate {family} --preset {preset.name}" if model is None
                    else f"tpupedia bench generate {family} --model {model}"),
    }


def _pipeline_config(pipeline: Any, preset: Any, request: Any, options: Any, model: str | None) -> dict[str, Any]:
    """A pipeline request and options as a results record's `config` (prompts left out)."""
    from tpupedia.pipelines import common

    config = {k: (str(getattr(request, k)) if k == "deepcache" and v is not None else v)
              for k, v in asdict(request).items() if k not in ("prompt", "negative_prompt")}
    return config | {"source": model or f"preset:{preset.name}", "attention": common.attention_backend(options.attention),
                     "vae": pipeline.PIPELINE.vae_choice(options), "sharding": options.sharding,
                     "dtype": str(common.torch_dtype(options, preset)).removeprefix("torch.")}


def bench_deepcache(family: str, preset: Any, request: Any, options: Any, model: str | None = None) -> dict[str, Any]:
    """Video family `family` (one whose request takes a `deepcache` schedule: HunyuanVideo-1.5)
    twice from the same seed, without and with `request.deepcache`: the steps recomputed, the
    denoising time (steps that compiled left out, scaled to all steps) and PSNR/SSIM of the
    cached video against the uncached one. Notebook 07; `tpupedia bench deepcache FAMILY` writes
    the record."""
    import dataclasses
    import importlib
    import tempfile

    from safetensors.numpy import load_file

    from tpupedia import families, metrics

    pipeline = importlib.import_module(families.get(family, "video").pipeline)

    runs = {}
    for name, schedule in (("plain", None), ("cached", request.deepcache)):
        with tempfile.TemporaryDirectory(prefix="tpupedia-bench-") as workdir:
            reports = pipeline.run(dataclasses.replace(request, deepcache=schedule), options, preset=preset, model=model,
                                  workdir=workdir, force=True, log=lambda _: None)
            frames = load_file(f"{workdir}/decode.safetensors")["frames"]
        step_s = {r.stage: r.timings for r in reports}["denoise"]["step_s"]
        full = set(schedule.full_steps(request.steps)) if schedule else set(range(request.steps))
        cached_steps = set(range(request.steps)) - full
        compiling = {min(full)} | ({min(cached_steps)} if cached_steps else set())  # each program's first call
        timed = [s for i, s in enumerate(step_s) if i not in compiling]
        runs[name] = {"frames": frames, "full_steps": len(full),
                      "seconds": sum(timed) / len(timed) * request.steps}  # per-step mean, scaled to the run
    plain, cached = runs["plain"], runs["cached"]
    quality = metrics.compare(cached["frames"], plain["frames"])
    return {
        "bench": "deepcache",
        "config": _pipeline_config(pipeline, preset, request, options, model),
        "machine": machine(),
        "result": {"steps": request.steps, "full_steps": cached["full_steps"], "plain_s": plain["seconds"],
                   "cached_s": cached["seconds"], "speedup": plain["seconds"] / cached["seconds"], **quality},
        "measured_at": _dt.date.today().isoformat(),
        "command": f"tpupedia bench deepcache {family} --preset {preset.name} --deepcache {request.deepcache} --steps {request.steps}",
    }
