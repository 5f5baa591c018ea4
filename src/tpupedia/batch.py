"""Batch generation that survives failures: prompts file in, one checked output per prompt out.

A batch is a prompts file (one prompt a line, or JSONL with `prompt` and optional `seed`,
`frames`, `height`, `width`, `negative_prompt`, `image`: image-to-video's picture, a path
relative to the JSONL file, and `lora`: a list of `PATH[:SCALE][@COMPONENT]` adapters, paths
relative to the JSONL file, in place of the command line's `--lora` for that line) and an output
folder. Each prompt becomes
`OUTDIR/NNNN-slug.mp4` and its JSON record; both are written atomically (temporary file, then
rename; the JSON last), and a prompt counts as done only when its JSON parses, names this
prompt's settings fingerprint and the mp4's checksum matches. So a job killed at any moment
loses at most the prompts in flight, and a rerun redoes exactly those. `OUTDIR/index.jsonl`
gets one line per finished prompt (prompt, seed, file, timings, which process made it, its
picture if any), appended as one write per line, never duplicated by a rerun. A file has one
writer: a Cloud Storage FUSE mount does not coordinate appends from several hosts (lines are
lost), so in a job each process appends to its own `index.<process>.jsonl` and, when the batch
ends, process 0 writes `index.jsonl` from every process's lines (`gather_manifest`, fed by the
pipelines' batch runner); `manifest` reads them all, merged.

With several processes (`tpupedia launch`, or the hosts of a TPU slice), each process takes
the prompts whose index modulo the process count is its id and runs them on its own devices:
data parallelism over hosts, with no communication between them.

Introduced in notebook `beyond_one_host` (beyond one host).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from tpupedia import files, lora
from tpupedia.errors import TpupediaError

__all__ = ["BatchError", "Item", "read_prompts", "slug", "share", "item_request", "is_done", "record", "relist",
           "manifest", "manifest_file", "gather_manifest"]

_FIELDS = {"prompt": str, "negative_prompt": str, "seed": int, "frames": int, "height": int, "width": int,
           "image": str, "lora": list}
MANIFEST = "index.jsonl"


class BatchError(TpupediaError, ValueError):
    """A prompts file that cannot be read, naming the line and the bad value."""


@dataclass(frozen=True)
class Item:
    """One prompt of a batch and the request fields it overrides."""

    index: int
    prompt: str
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.index:04d}-{slug(self.prompt)}"


def slug(text: str, limit: int = 40) -> str:
    """A file-name-safe ASCII slug of `text` (lower case, dashes, at most `limit` characters)."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return words[:limit].rstrip("-") or "prompt"


def read_prompts(path: str | os.PathLike) -> list[Item]:
    """The prompts of a text or JSONL file (`.jsonl`), in order; blank and `#` lines skipped. An
    `image` is resolved against the JSONL file's folder (an absolute path stays as it is); the
    picture itself is checked with the rest of each request (`tpupedia.pictures.check`)."""
    path = Path(path)
    if not path.is_file():
        raise BatchError(f"prompts file {str(path)!r} not found")
    raw = path.read_bytes()
    try:  # UTF-8 whatever the locale says (a C locale would read it as ASCII), a leading BOM dropped
        content = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise BatchError(f"{path.name} line {line}: byte {raw[err.start]:#04x} is not UTF-8; save the prompts "
                         "file as UTF-8") from None
    items: list[Item] = []
    jsonl = path.suffix == ".jsonl"
    for number, line in enumerate(content.splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not jsonl:
            items.append(Item(len(items), text))
            continue
        try:
            entry = json.loads(text)
        except ValueError as err:
            raise BatchError(f"{path.name} line {number}: not JSON ({err})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise BatchError(f"{path.name} line {number}: needs a non-empty \"prompt\" string")
        for key, value in entry.items():
            if key not in _FIELDS:
                raise BatchError(f"{path.name} line {number}: unknown field {key!r}; allowed: {', '.join(_FIELDS)}")
            if not isinstance(value, _FIELDS[key]) or isinstance(value, bool):
                raise BatchError(f"{path.name} line {number}: {key}={value!r} must be {_FIELDS[key].__name__}")
        if "image" in entry:
            entry["image"] = str(path.parent / entry["image"])
        if "lora" in entry:  # adapters as `tpupedia.lora.Adapter`s, their files relative to this file
            where = f"{path.name} line {number}: lora"
            if not all(isinstance(a, str) for a in entry["lora"]):
                raise BatchError(f"{where} {entry['lora']!r} must be a list of \"{lora.FORMAT}\" strings")
            entry["lora"] = lora.parse_all(entry["lora"], where, base=path.parent)
        overrides = tuple(sorted((k, v) for k, v in entry.items() if k != "prompt"))
        items.append(Item(len(items), entry["prompt"].strip(), overrides))
    if not items:
        raise BatchError(f"{path.name} holds no prompt")
    return items


def share(items: list[Item], process_id: int, num_processes: int) -> list[Item]:
    """The items process `process_id` of `num_processes` generates: every `num_processes`-th."""
    return [item for item in items if item.index % num_processes == process_id]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _paths(outdir: Path, item: Item) -> tuple[Path, Path]:
    return outdir / f"{item.name}.mp4", outdir / f"{item.name}.json"


def is_done(outdir: str | os.PathLike, item: Item, fingerprint: str) -> bool:
    """True when the item's mp4 and JSON exist, the JSON names `fingerprint` and the mp4's
    checksum; anything partial, stale or edited means not done."""
    video, twin = _paths(Path(outdir), item)
    try:
        meta = json.loads(twin.read_text())
        return meta["fingerprint"] == fingerprint and video.is_file() and _sha256(video) == meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def manifest_file(process: int = 0, processes: int = 1) -> str:
    """The manifest file process `process` of `processes` appends to: `index.jsonl` alone,
    `index.<process>.jsonl` in a job (one writer per file)."""
    return MANIFEST if processes == 1 else f"index.{process}.jsonl"


def record(outdir: str | os.PathLike, item: Item, fingerprint: str, write_video: Callable[[Path], Any],
           extra: Mapping[str, Any], *, process: int = 0, processes: int = 1) -> Path:
    """Write the item's mp4 (through `write_video(path)`, which must write atomically), then its
    JSON (atomically), then its manifest line (`manifest_file(process, processes)`). Returns the
    mp4's path."""
    outdir = Path(outdir)
    video, twin = _paths(outdir, item)
    write_video(video)
    meta = {"index": item.index, "prompt": item.prompt, "overrides": dict(item.overrides),
            "fingerprint": fingerprint, "file": video.name, "sha256": _sha256(video), **extra}
    files.write_text_atomic(twin, json.dumps(meta, indent=2, default=str) + "\n")
    _append(outdir / manifest_file(process, processes), meta)
    return video


def _line(meta: Mapping[str, Any]) -> str:
    keys = ("index", "prompt", "file", "seed", "timings", "process") + (("image",) if meta.get("image") else ())
    return json.dumps({k: meta.get(k) for k in keys}, default=str) + "\n"


def _append(path: Path, meta: Mapping[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, _line(meta).encode())  # one write per line, by the file's one writer
    finally:
        os.close(fd)


def relist(outdir: str | os.PathLike, item: Item, *, process: int = 0, processes: int = 1) -> bool:
    """Append a done item's manifest line (to this process's `manifest_file`) if a crash came
    between its JSON and that line. Returns True when it had to."""
    if any(e["index"] == item.index for e in manifest(outdir)):
        return False
    _append(Path(outdir) / manifest_file(process, processes), json.loads(_paths(Path(outdir), item)[1].read_text()))
    return True


def _entries(texts: list[str], entries: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """`entries` updated with the lines of `texts`, in order (a later line for an index wins); a
    line cut short by a crash is skipped (its prompt's record relists it)."""
    for text in texts:
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                entries[entry["index"]] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return entries


def _process_files(outdir: Path) -> list[Path]:
    found = [(int(p.name.split(".")[1]), p) for p in outdir.glob("index.*.jsonl") if p.name.split(".")[1].isdigit()]
    return [p for _, p in sorted(found)]


def manifest(outdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The manifest's entries, one per finished prompt, latest line per index (a prompt redone
    with `--force` appears once, with its latest run): `index.jsonl`, then the lines of a job's
    processes not gathered into it yet (`index.<process>.jsonl`, an interrupted job's)."""
    outdir = Path(outdir)
    paths = [p for p in [outdir / MANIFEST, *_process_files(outdir)] if p.is_file()]
    entries = _entries([p.read_text() for p in paths], {})
    return [entries[k] for k in sorted(entries)]


def gather_manifest(outdir: str | os.PathLike, texts: list[str]) -> list[dict[str, Any]]:
    """Process 0 at the end of a job's batch: rewrite `index.jsonl` (atomically, one line per
    prompt, by index) from its own lines and `texts`, every process's `index.<process>.jsonl` as
    that process read it (they need not share a disk). Returns the entries."""
    path = Path(outdir) / MANIFEST
    entries = _entries(texts, _entries([path.read_text()] if path.is_file() else [], {}))
    files.write_text_atomic(path, "".join(_line(entries[k]) for k in sorted(entries)))
    return [entries[k] for k in sorted(entries)]


def item_request(item: Item, base: Any) -> Any:
    """`base` (a pipeline `Request`) with the item's prompt and overrides."""
    import dataclasses

    return dataclasses.replace(base, prompt=item.prompt, **dict(item.overrides))

