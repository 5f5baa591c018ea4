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

__all__ = ["ResultsError", "LIBRARIES", "version", "versions", "machine", "write_json_atomic", "load", "merge", "error_text",
           "measured_text", "MEASURED_PATTERN", "MEASURED_AFTER"]

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


MEASURED_AFTER = r"(?:%| [A-Za-z]+)? [≤≥] "
"""What follows a measured value printed against its bound: an optional unit, then `≤` or `≥`."""
MEASURED_PATTERN = rf"(?:-?\d+(?:\.\d+)?(?:e[-+]\d+)?|inf)(?={MEASURED_AFTER})"
"""What nbval's sanitizer (`tests/nbval_sanitize.cfg`) replaces with `MEASURED` in both the stored
and the fresh output: the measured value of a `VALUE ≤ BOUND` or `VALUE ≥ BOUND` line
(`measured_text`). Such a line is compared by its bound and the claim, not by digits that change
with the machine's floating-point order."""


def measured_text(value: float, bound: float, *, at_least: bool = False, fmt: str = ".1e", unit: str = "") -> str:
    """A measured value as a stored notebook output shows it: against the bound its check asserts,
    `'3.1e-06 ≤ 1.0e-04'` (`at_least=True`: `'53.9 dB ≥ 30.0 dB'` with `fmt=".1f", unit=" dB"`).

    Float32 rounding noise is real, but its digits differ from one CPU to the next (one host of a
    kind printed `3.1e-06` and `8.6e-06` for two of notebook `fewer_steps`' errors, another of the
    same kind `4.7e-06` and `1.1e-05`), and nbval compares outputs exactly. So the page shows the
    value and its bound, nbval compares the bound and the sign (`MEASURED_PATTERN`), and the
    notebook's assert keeps the proof. A value past its bound prints `>` (`<`), which no sanitizer
    hides: the comparison fails with the assert. `tpupedia.notebooks.check_measured` rejects a raw
    measured error in a compared cell. Introduced in notebook `splash_attention`."""
    holds = value >= bound if at_least else value <= bound
    sign = ("≥" if holds else "<") if at_least else ("≤" if holds else ">")
    return f"{value:{fmt}}{unit} {sign} {bound:{fmt}}{unit}"


def error_text(value: float, bound: float = 1e-5) -> str:
    """A measured error against the bound its check asserts: `measured_text(value, bound)`,
    `'4.2e-07 ≤ 1.0e-05'`. Introduced in notebook `splash_attention` (as `below`)."""
    return measured_text(value, bound)
