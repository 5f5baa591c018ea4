"""Stage files: the contract between pipeline stages, runs and machines.

Each stage of a pipeline writes `WORKDIR/<stage>.safetensors` (its tensors) and a JSON twin
`WORKDIR/<stage>.json` (what made them). The next stage reads its input only through `read`,
which refuses, with an error that names the field and both values, anything that was not made
by this request or is not whole:

* tensors are written with `safetensors.torch` (bf16 round-trips bit-exactly; the header
  metadata, whose values must be strings, holds the stage and the fingerprint) to a temporary
  file in the same folder and renamed into place; the JSON twin is written the same way,
  *last*, and an older twin is removed *first*: a stage without its JSON is not done, so an
  interrupted write never looks finished;
* the JSON holds the settings that change the tensors (model, checkpoint, prompt, size, frames,
  steps, guidance, seed, scheduler ...), their fingerprint, every tensor's shape and dtype and
  the sha256 of the tensor file, plus the caller's extras (command, machine, timings);
* `read` checks all of it: missing, truncated, edited or foreign files are refused, never
  half-used. `status` and `done` run the same checks without loading the tensors, so a command
  can skip a finished stage and say why it reruns one.

| call | missing files | stale or damaged files | bad stage name |
|---|---|---|---|
| `read` | `StageError` | `StageError` | `StageError` |
| `status` | the reason (str) | the reason (str) | `StageError` |
| `done` | `False` | `False` | `StageError` |

Introduced in notebook `cogvideox_pipeline` (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tpupedia import files
from tpupedia.errors import TpupediaError

__all__ = ["STAGES", "FORMAT", "StageError", "StageFile", "fingerprint", "config_fingerprint", "path", "write", "read", "status",
           "done"]

STAGES = ("text", "image", "denoise", "decode")
FORMAT = "tpupedia-stage/1"

# safetensors' dtype codes, spelled as torch spells them (what the JSON twin records).
_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
           "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
           "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
           "F8_E5M2": "float8_e5m2"}
_FIELDS = ("format", "stage", "fingerprint", "settings", "tensors", "sha256")


class StageError(TpupediaError, ValueError):
    """A stage file that is missing, incomplete, edited, or made for another request."""


@dataclass
class StageFile:
    """A stage's tensors and the metadata of its JSON twin, after every check passed."""

    stage: str
    tensors: dict[str, Any]
    meta: dict[str, Any]
    path: Path


def _plain(value: Any) -> Any:
    """JSON for the few non-JSON types a setting may reasonably be; anything else is refused, so
    a fingerprint never depends on an object's `repr` (memory addresses)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy / torch scalars
        return value.item()
    if type(value).__name__.startswith("dtype"):  # torch.dtype, numpy dtypes: "bfloat16", not "torch.bfloat16"
        return str(value).removeprefix("torch.")
    raise StageError(f"setting value {value!r} ({type(value).__name__}) cannot be written as JSON; "
                     "pass strings, numbers, booleans, lists or dicts")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)


def fingerprint(settings: Mapping[str, Any]) -> str:
    """First 16 hex digits of the sha256 of `settings` as canonical JSON (keys sorted, no
    whitespace): equal for equal settings whatever their order, different when any value
    differs, including its JSON type (`6` and `6.0`, `1` and `true` differ)."""
    return hashlib.sha256(_canonical(settings).encode()).hexdigest()[:16]


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A component config's fingerprint (`fingerprint`), private (`_`-prefixed) entries left out."""
    return fingerprint({k: v for k, v in dict(config).items() if not k.startswith("_")})


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise StageError(f"stage {stage!r} is not one of {', '.join(STAGES)}")


def path(workdir: str | os.PathLike, stage: str) -> Path:
    """`WORKDIR/<stage>.safetensors`."""
    _check_stage(stage)
    return Path(workdir) / f"{stage}.safetensors"


def _json_path(workdir: str | os.PathLike, stage: str) -> Path:
    return path(workdir, stage).with_suffix(".json")


def _describe(tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()}


def write(workdir: str | os.PathLike, stage: str, tensors: Mapping[str, Any], settings: Mapping[str, Any],
          extra: Mapping[str, Any] | None = None) -> Path:
    """Write a stage's tensors and its JSON twin atomically; returns the tensor file's path.

    Order: the old JSON twin (if any) is removed, the tensors are written (temporary file, then
    rename), the JSON twin last. `tensors` is a non-empty dict of torch tensors (moved to CPU,
    made contiguous); `settings` is JSON (paths, dtypes and numpy scalars are converted,
    anything else refused); `extra` (command line, machine, timings ...) is stored as given,
    with `str` for what JSON cannot hold.
    """
    import torch
    from safetensors.torch import save

    _check_stage(stage)
    if not isinstance(tensors, Mapping) or not tensors:
        raise StageError(f"stage {stage}: tensors must be a non-empty dict of torch tensors, "
                         f"got {type(tensors).__name__}")
    bad = [f"{k} ({type(v).__name__})" for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise StageError(f"stage {stage}: tensors must be torch tensors; not tensors: {', '.join(bad)}")
    settings = json.loads(_canonical(dict(settings)))  # exactly what a reader will compare against
    fp = fingerprint(settings)
    target, twin = path(workdir, stage), _json_path(workdir, stage)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    data = save(tensors, metadata={"stage": stage, "fingerprint": fp, "format": FORMAT})
    twin.unlink(missing_ok=True)  # from here until the new twin exists, the stage is not done
    files.write_atomic(target, lambda tmp: tmp.write_bytes(data))
    meta = {  # the checksum of the bytes written, not of the file read back (a decode file is ~1 GB at full size)
        "format": FORMAT, "stage": stage, "fingerprint": fp, "settings": settings,
        "tensors": _describe(tensors), "sha256": _sha256(data), "extra": dict(extra or {}),
    }
    files.write_text_atomic(twin, json.dumps(meta, indent=2, default=str) + "\n")
    return target


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys (`{"vae": {"tiling": true}}` -> `vae.tiling`)."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        if isinstance(v, Mapping) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(made: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """`key=<file value> in the file, key=<run value> in this run`, for each differing key,
    compared as canonical JSON (so `6` and `6.0` differ, as their fingerprints do)."""
    made, wanted = _flatten(made), _flatten(wanted)
    missing = object()
    show = lambda v: "(absent)" if v is missing else repr(v)  # noqa: E731
    out = []
    for k in sorted(set(made) | set(wanted)):
        a, b = made.get(k, missing), wanted.get(k, missing)
        if a is missing or b is missing or _canonical(a) != _canonical(b):
            out.append(f"{k}={show(a)} in the file, {k}={show(b)} in this run")
    return out


def _header(data: bytes, name: str) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """The metadata and the tensor table of a safetensors file's header, without torch."""
    try:
        size = int.from_bytes(data[:8], "little")
        if len(data) < 8 or 8 + size > len(data):
            raise ValueError("header longer than the file")
        header = json.loads(data[8:8 + size])
        metadata = header.pop("__metadata__", None) or {}
        found = {k: {"shape": list(v["shape"]), "dtype": _DTYPES.get(v["dtype"], v["dtype"])}
                 for k, v in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StageError(f"{name} has no readable safetensors header ({err})") from None
    return metadata, found


def _verified(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any]) -> tuple[bytes, dict]:
    """Every check, on the exact bytes that will be loaded: the JSON twin, the request, the
    checksum, the header. Returns those bytes and the JSON record."""
    target, twin = path(workdir, stage), _json_path(workdir, stage)
    if not twin.is_file():
        raise StageError(f"{twin.name} not found in {Path(workdir).name!r}: run the {stage} stage first "
                         f"(a stage is done only when its JSON twin exists)")
    try:
        meta = json.loads(twin.read_text())
        fields = {k: meta[k] for k in _FIELDS}
        if not (isinstance(fields["settings"], dict) and isinstance(fields["tensors"], dict)
                and isinstance(fields["sha256"], str)):
            raise TypeError("settings and tensors must be objects, sha256 a string")
    except (ValueError, KeyError, TypeError) as err:
        raise StageError(f"{twin.name} is not a readable stage record ({type(err).__name__}: {err})") from None
    if fields["format"] != FORMAT or fields["stage"] != stage:
        raise StageError(f"{twin.name}: format {fields['format']!r}, stage {fields['stage']!r}; "
                         f"expected {FORMAT!r}, {stage!r}")
    wanted = json.loads(_canonical(dict(settings)))
    diff = _differences(fields["settings"], wanted)
    if fingerprint(fields["settings"]) != fields["fingerprint"]:
        differing = f"; it differs from this run in: {'; '.join(diff)}" if diff else ""
        raise StageError(f"{twin.name} was edited: its settings no longer match its fingerprint "
                         f"{fields['fingerprint']}{differing}. Rerun the {stage} stage (--force)")
    if diff:
        raise StageError(f"{twin.name} was made for another request: {'; '.join(diff)}. "
                         "Use the same settings, another --workdir, or --force to redo the stage")
    try:
        data = target.read_bytes()
    except OSError:
        raise StageError(f"{target.name} is missing or unreadable although {twin.name} exists; "
                         f"rerun the {stage} stage (--force)") from None
    if _sha256(data) != fields["sha256"]:
        raise StageError(f"{target.name} does not match the checksum in {twin.name} (truncated or edited); "
                         f"rerun the {stage} stage (--force)")
    metadata, found = _header(data, target.name)
    if metadata.get("stage") != stage or metadata.get("fingerprint") != fields["fingerprint"]:
        raise StageError(f"{target.name} header says stage={metadata.get('stage')!r}, "
                         f"fingerprint={metadata.get('fingerprint')!r}; {twin.name} says stage={stage!r}, "
                         f"fingerprint={fields['fingerprint']!r}. Rerun the {stage} stage (--force)")
    if found != fields["tensors"]:
        raise StageError(f"{target.name} holds {found}, but {twin.name} lists {fields['tensors']}")
    return data, meta


def read(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any],
         verified: tuple[bytes, dict] | None = None) -> StageFile:
    """The stage's tensors, if its files are whole and were made for `settings`; else
    `StageError` naming what is wrong (each differing setting with both values). The checks
    and the load use the same bytes, so a file replaced meanwhile cannot slip through.
    `verified`: the bytes and record `status(..., keep=...)` already checked, so that a file is
    read from disk once (a full-size decode file is about 1 GB)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data, meta = verified or _verified(workdir, stage, settings)
    target = path(workdir, stage)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, OSError) as err:
        raise StageError(f"{target.name} cannot be read ({err})") from None
    if _describe(tensors) != meta["tensors"]:  # the header agreed; this guards the loader
        raise StageError(f"{target.name} holds {_describe(tensors)}, but its JSON twin lists {meta['tensors']}")
    return StageFile(stage, tensors, meta, target)


def status(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any],
           keep: dict | None = None) -> str | None:
    """`None` when the stage is done for `settings` (`read` would succeed); otherwise the reason
    it has to run, for the CLI to print. A missing, stale or damaged file is a reason, not an
    error; only a stage name outside `STAGES` raises. Checks the checksum and the header
    (names, shapes, dtypes) without loading the tensors. `keep` (a dict): a done stage's checked
    bytes and record are put in it by stage name, for `read(..., verified=...)`."""
    try:
        verified = _verified(workdir, stage, settings)
    except StageError as err:
        if stage not in STAGES:
            raise
        return str(err)
    if keep is not None:
        keep[stage] = verified
    return None


def done(workdir: str | os.PathLike, stage: str, settings: Mapping[str, Any]) -> bool:
    """True only when `read(workdir, stage, settings)` would succeed; False when the files are
    missing, stale (made for other settings) or damaged. `status` says which."""
    return status(workdir, stage, settings) is None
