"""Benchmarks that separate the first call (tracing + compilation) from the steady state.

Every record says where it was measured (platform, device kind, CPU count, library versions)
and how (the command), and is merged into one JSON results file that the docs' results page
renders. Targets live here and in that file, never in timed unit tests.

Introduced with `tpupedia bench llama` (notebook 01's model at a mid size); notebook 09 adds
`bench dit`.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import json
import os
import platform as _platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "DEFAULT_RESULTS",
    "Timing",
    "time_call",
    "machine",
    "merge_record",
    "load_results",
    "bench_llama",
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


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where a measurement was taken: platform, device kind and count, CPU count, versions."""
    import jax

    devs = jax.devices()
    return {
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "devices": len(devs),
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "jax", "jaxlib", "torchax", "transformers")},
    }


def load_results(path: str | os.PathLike = DEFAULT_RESULTS) -> list[dict[str, Any]]:
    """The records in a results file (empty if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path} is not a tpupedia results file (expected {{'records': [...]}})")
    return data["records"]


def _key(record: dict[str, Any]) -> tuple:
    m = record["machine"]
    return (record["bench"], json.dumps(record["config"], sort_keys=True), m["device_kind"], m["cpu_count"])


def merge_record(record: dict[str, Any], path: str | os.PathLike = DEFAULT_RESULTS) -> Path:
    """Add `record` to the results file, replacing an earlier run of the same bench, config and
    machine. Written atomically (temporary file + rename)."""
    path = Path(path)
    records = [r for r in load_results(path) if _key(r) != _key(record)]
    records.append(record)
    records.sort(key=lambda r: (r["bench"], r["machine"]["device_kind"], json.dumps(r["config"], sort_keys=True)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"records": records}, indent=2) + "\n")
    tmp.replace(path)
    return path


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
    return {
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
    }
