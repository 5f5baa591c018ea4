"""Stage files: the contract between pipeline stages, runs and machines.

Each stage of a pipeline writes `WORKDIR/<stage>.safetensors` (its tensors) and a JSON twin
`WORKDIR/<stage>.json` (what made them). The next stage reads its input only through `read`,
which refuses, with an error that names the field and both values, anything that was not made
by this request or is not whole:

* tensors are written with `safetensors.torch` (bf16 round-trips bit-exactly; header metadata
  values are strings) to a temporary file in the same folder and renamed into place; the JSON
  twin is written the same way, *last*: a stage without its JSON is not done;
* the JSON holds the settings that change the tensors (model, checkpoint, prompt, size, frames,
  steps, guidance, seed, scheduler ...), their fingerprint, every tensor's shape and dtype and
  the sha256 of the tensor file, plus the caller's extras (command, machine, timings);
* `read` checks all of it: missing, truncated, edited or foreign files are refused, never
  half-used.

Introduced in notebook 06 (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tpupedia.errors import TpupediaError

__all__ = ["STAGES", "FORMAT", "StageError", "StageFile", "fingerprint", "path", "write", "read", "status"]

STAGES = ("text", "denoise", "decode")
FORMAT = "tpupedia-stage/1"


class StageError(TpupediaError, ValueError):
    """A stage file that is missing, incomplete, edited, or made for another request."""


@dataclass
class StageFile:
    """A stage's tensors and the metadata of its JSON twin, after every check passed."""

    stage: str
    tensors: dict[str, Any]
    meta: dict[str, Any]
    path: Path


def _canonical(value: Mapping[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def fingerprint(settings: Mapping[str, Any]) -> str:
    """First 16 hex digits of the sha256 of the settings as canonical JSON."""
    return hashlib.sha256(_canonical(settings).encode()).hexdigest()[:16]


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise StageError(f"stage {stage!r} is not one of {', '.join(STAGES)}")


def path(workdir: str | os.PathLike, stage: str) -> Path:
    """`WORKDIR/<stage>.safetensors`."""
    _check_stage(stage)
    return Path(workdir) / f"{stage}.safetensors"


def _json_path(workdir: str | os.PathLike, stage: str) -> Path:
    return path(workdir, stage).with_suffix(".json")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic(target: Path, write) -> None:
    """Call `write(temporary_path)`, then rename it onto `target` (same folder, so atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write(workdir: str | os.PathLike, stage: str, tensors: Mapping[str, Any], settings: Mapping[str, Any],
          extra: Mapping[str, Any] | None = None) -> Path:
    """Write a stage's tensors and JSON twin atomically (tensors first, JSON last). Returns the
    tensor file's path. `settings` must be JSON-serialisable; `extra` is stored as given."""
    import torch
    from safetensors.torch import save_file

    _check_stage(stage)
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad or not tensors:
        raise StageError(f"stage {stage}: tensors must be a non-empty dict of torch tensors; bad entries: {bad}")
    settings = json.loads(_canonical(settings))  # what a reader will compare against
    fp = fingerprint(settings)
    target = path(workdir, stage)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    _atomic(target, lambda tmp: save_file(tensors, str(tmp), metadata={"stage": stage, "fingerprint": fp, "format": FORMAT}))
    meta = {
        "format": FORMAT, "stage": stage, "fingerprint": fp, "settings": settings,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()},
        "sha256": _sha256(target), "extra": dict(extra or {}),
    }
    _atomic(_json_path(workdir, stage), lambda tmp: tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n"))
    return target


def _differences(made: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(made) | set(wanted))
    missing = object()
    out = []
    for k in keys:
        a, b = made.get(k, missing), wanted.get(k, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
            out.append(f"{k}={show(a)} in the file, {k}={show(b)} in this run")
    return out


def _verified(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any]) -> tuple[Path, dict]:
    """Every check that needs no tensor loaded: the JSON twin, the request, the checksum."""
    target, twin = path(workdir, stage), _json_path(workdir, stage)
    if not twin.is_file():
        raise StageError(f"{twin.name} not found in {Path(workdir).name!r}: run the {stage} stage first "
                         f"(a stage is done only when its JSON twin exists)")
    try:
        meta = json.loads(twin.read_text())
        fields = {k: meta[k] for k in ("format", "stage", "fingerprint", "settings", "tensors", "sha256")}
    except (ValueError, KeyError, TypeError) as err:
        raise StageError(f"{twin.name} is not a readable stage record ({type(err).__name__}: {err})") from None
    if fields["format"] != FORMAT or fields["stage"] != stage:
        raise StageError(f"{twin.name}: format {fields['format']!r}, stage {fields['stage']!r}; expected {FORMAT!r}, {stage!r}")
    wanted = json.loads(_canonical(settings))
    if fingerprint(fields["settings"]) != fields["fingerprint"]:
        raise StageError(f"{twin.name} was edited: its settings no longer match its fingerprint {fields['fingerprint']}")
    if fields["fingerprint"] != fingerprint(wanted):
        diff = "; ".join(_differences(fields["settings"], wanted))
        raise StageError(f"{twin.name} was made for another request: {diff}. "
                         "Use the same settings, another --workdir, or --force to redo the stage")
    if not target.is_file():
        raise StageError(f"{target.name} is missing although {twin.name} exists; rerun the {stage} stage (--force)")
    if _sha256(target) != fields["sha256"]:
        raise StageError(f"{target.name} does not match the checksum in {twin.name} (truncated or edited); "
                         f"rerun the {stage} stage (--force)")
    return target, meta


def read(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any]) -> StageFile:
    """The stage's tensors, if its files are whole and were made for `settings`; else `StageError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    target, meta = _verified(workdir, stage, settings)
    twin = _json_path(workdir, stage)
    try:
        tensors = load_file(str(target))
    except (SafetensorError, OSError) as err:
        raise StageError(f"{target.name} cannot be read ({err})") from None
    found = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()}
    if found != meta["tensors"]:
        raise StageError(f"{target.name} holds {found}, but {twin.name} lists {meta['tensors']}")
    return StageFile(stage, tensors, meta, target)


def status(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any]) -> str | None:
    """`None` when the stage is done for `settings` (`read` would succeed); otherwise the reason
    it has to run, for the CLI to print. Never raises for a bad file: a bad file means "run".
    The checksum is verified; the tensors are not loaded."""
    try:
        _verified(workdir, stage, settings)
    except StageError as err:
        return str(err)
    return None
