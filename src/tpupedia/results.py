"""Results files: where every measured, compiled or recorded number is kept.

A results file is JSON, `{"records": [...]}`, under `docs/results/` (the docs' results page
renders them). Records are merged by a key (a newer record with the same key replaces the older
one), every write is atomic (a temporary file in the same folder, then a rename), and every
measurement carries `machine()`: where it was taken.

Introduced with `tpupedia bench llama` (notebook `hf_model_in_jax`); used by `tpupedia.bench`,
`tpupedia.dryrun`, the pipelines' stage files (notebook `cogvideox_pipeline`) and `tpupedia doctor`.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform as _platform
from pathlib import Path
from typing import Any, Callable

from tpupedia import files
from tpupedia.errors import TpupediaError

__all__ = ["ResultsError", "LIBRARIES", "version", "versions", "machine", "write_json_atomic", "load", "merge", "error_text"]

LIBRARIES = ("torch", "jax", "jaxlib", "libtpu", "flax", "torchax", "transformers", "diffusers")


class ResultsError(TpupediaError, ValueError):
    """A file that is not a results file."""


def version(dist: str) -> str | None:
    """The installed version of `dist`, or `None`."""
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
        "processes": jax.process_count(),
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "versions": versions(),
    }


def versions() -> dict[str, str | None]:
    """The versions of the libraries that make the numbers (torch, jax, jaxlib, torchax,
    diffusers, transformers; libtpu only where it is installed): what every stage file's JSON twin
    and every measurement records in `machine()`, so that a stage file says what made it."""
    found = {d: version(d) for d in ("torch", "jax", "jaxlib", "torchax", "diffusers", "transformers", "libtpu")}
    return {d: v for d, v in found.items() if v is not None or d != "libtpu"}


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as indented JSON to `path` through a temporary file and a rename."""
    return files.write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def load(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records in a results file (empty if the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ResultsError(f"{path} is not a tpupedia results file (expected {{'records': [...]}})")
    return data["records"]


def merge(record: dict[str, Any], path: str | os.PathLike, key: Callable[[dict[str, Any]], tuple]) -> Path:
    """Add `record` to the results file at `path`, replacing a record with the same `key`."""
    records = [r for r in load(path) if key(r) != key(record)]
    records.append(record)
    records.sort(key=lambda r: json.dumps(key(r), default=str))
    return write_json_atomic(path, {"records": records})


def error_text(value: float, floor: float = 1e-5) -> str:
    """A measured error as a stored notebook output shows it: below `floor` only as the bound
    (`"< 1e-05"`), above it to two significant digits. Float32 rounding noise is real, but its
    digits differ from one CPU to the next (an AMD and an Intel host print 4.2e-07 and 4.8e-07
    for the same forward), and nbval compares outputs exactly; so the floor is the check's own
    tolerance, the bound the reader needs. Introduced in notebook `splash_attention` (as `below`)."""
    return f"< {floor:.0e}" if value < floor else f"{value:.1e}"
