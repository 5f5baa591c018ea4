"""Checkpoints on disk, the same way for every family.

One loading path for both presets: `from_pretrained(..., use_safetensors=True)` on a diffusers
directory or hub id. The tiny preset first writes a random pipeline with `save_pretrained`
(safetensors) into a cache folder named by everything that shapes it, so a changed config never
reuses a stale checkpoint. Introduced with the CogVideoX pipeline (notebook `cogvideox_pipeline`); HunyuanVideo-1.5
(notebook `hunyuan_video`) uses the same functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

from tpupedia import files
from tpupedia.errors import TpupediaError
from tpupedia.files import cache_dir

__all__ = ["CheckpointError", "IgnoredWeightsWarning", "cache_dir", "cached_pipeline", "clean_config", "choose_source", "named_source", "check_source",
           "source_label", "hub_revision", "download_bytes", "check_disk", "hub_cache_space", "SKIPPED_FILES", "read_configs", "config_file", "hub_unreachable", "load_component", "check_loading_info",
           "DEPTH_FIELDS", "depth"]


DEPTH_FIELDS = ("num_layers", "num_hidden_layers")
"""The config fields that give a component's depth (diffusers', transformers'): a plan's shallow
model sets them to its `layers`."""


def depth(config: dict) -> int | None:
    """A component's number of layers from its config (`DEPTH_FIELDS`), `None` for one without
    (a VAE)."""
    return next((int(config[k]) for k in DEPTH_FIELDS if isinstance(config.get(k), int)), None)


class CheckpointError(TpupediaError, ValueError):
    """A checkpoint that cannot be used: no such folder, not a diffusers checkpoint, a hub id not
    downloaded while offline, a component config that is missing or unreadable."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a Hugging Face hub id looks like: OWNER/NAME."""

VOLATILE = {"_diffusers_version", "transformers_version", "_name_or_path", "_commit_hash", "_use_default_values"}
"""Config entries that record where or with which version a component was saved, not what it is."""


SPEC_STAMP = "tpupedia-checkpoint.txt"
"""The file in a written tiny checkpoint naming what it was built from (`cached_pipeline`): a folder
asked for another checkpoint is refused, not silently reused."""


def cached_pipeline(prefix: str, spec: Any, build: Callable[[], Any], directory: str | os.PathLike | None = None,
                    finish: Callable[[Path], None] | None = None) -> Path:
    """The directory of a pipeline written by `build().save_pretrained(...)`, reused when complete.

    Default directory: `cache_dir()/<prefix>-<sha256 of spec>`. Written to a temporary folder and
    renamed, so a crash leaves nothing half-written; a concurrent writer that wins the race is fine.
    `finish(folder)` runs on the written folder before the rename (e.g. to lay a tokenizer out in
    the files the real checkpoint ships, `tpupedia.models.tokenizer_files`).
    """
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    if directory is None:
        directory = cache_dir() / f"{prefix}-{digest}"
    path = Path(directory)
    if (path / "model_index.json").is_file():
        stamp = path / SPEC_STAMP
        if stamp.is_file() and stamp.read_text().strip() != f"{prefix}-{digest}":
            raise CheckpointError(f"{path} holds another tiny checkpoint ({stamp.read_text().strip()}), not "
                                  f"{prefix}-{digest}: give each checkpoint its own folder")
        return path
    pipe = build()

    def fill(tmp: Path) -> None:
        pipe.save_pretrained(tmp, safe_serialization=True)
        if finish is not None:
            finish(tmp)
        (tmp / SPEC_STAMP).write_text(f"{prefix}-{digest}\n")

    return files.directory_atomic(path, fill)


def clean_config(config: Any) -> dict:
    """A component config as a plain dict, without `VOLATILE` entries."""
    return {k: v for k, v in dict(config).items() if k not in VOLATILE}


def choose_source(preset: Any, model: str | os.PathLike | None, env_var: str, full_id: str,
                  tiny: Callable[[], Path]) -> tuple[str, str]:
    """`(where to load from, label for stage files)`: `model` if given, else `$<env_var>`, else the
    preset's (`full_id` for full; the tiny checkpoint, labelled `preset:<name>`). A chosen folder or
    hub id is checked first (`check_source`), so a wrong one is one clear error, not a download."""
    if model:
        check_source(str(model), "--model", full_id)
        return str(model), source_label(model)
    if os.environ.get(env_var):
        check_source(os.environ[env_var], f"${env_var}", full_id)
        return os.environ[env_var], source_label(os.environ[env_var])
    if preset.pretrained:
        check_source(full_id, f"the {preset.name} preset's checkpoint", full_id)
        return full_id, source_label(full_id)
    return str(tiny()), f"preset:{preset.name}"


def source_label(source: str | os.PathLike) -> str:
    """How stage files name a checkpoint: a local folder by its resolved absolute path (so
    `DIR//ckpt`, `DIR/ckpt/` and a relative path to the same folder are one checkpoint), a hub
    id (`OWNER/NAME`, no such folder here) as given, with the revision of its snapshot in the
    local Hugging Face cache once there is one (`OWNER/NAME@COMMIT`, `hub_revision`): a
    checkpoint updated on the Hub is another checkpoint, and the stage files made from the old
    one are stale. A folder wins over a hub id of the same spelling, as it does for
    `from_pretrained`."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path.resolve())
    revision = hub_revision(str(source))
    return f"{source}@{revision}" if revision else str(source)


SKIPPED_FILES = (".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".onnx", ".gguf", ".h5", ".mp4", ".gif", ".png", ".jpg",
                 ".jpeg", ".webp")
"""File endings a diffusers checkpoint's download leaves out of `download_bytes`: weights in other
formats than safetensors (the only ones loaded here) and the pictures and videos of a model card."""


def download_bytes(source: str) -> int | None:
    """Bytes a first load of hub id `source` still has to download: the sizes the Hub lists for
    its files (`HfApi.model_info(files_metadata=True)`), the safetensors weights and the configs
    and tokenizer files beside them (`SKIPPED_FILES` left out), less the files already in the
    local Hugging Face cache. `None` for a folder, with `HF_HUB_OFFLINE=1`, or where the Hub does
    not answer (the download itself then says why)."""
    if Path(source).expanduser().is_dir() or not HUB_ID.match(source) or _offline():
        return None
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        siblings = HfApi().model_info(source, files_metadata=True).siblings or []
    except Exception:  # noqa: BLE001 - no route to the Hub, no such repository, a rate limit: not ours to judge here
        return None
    return sum(int(f.size or 0) for f in siblings
               if not f.rfilename.lower().endswith(SKIPPED_FILES)
               and not isinstance(try_to_load_from_cache(source, f.rfilename), str))


def hub_cache_space() -> tuple[str, int]:
    """`(HF_HUB_CACHE, free bytes on its disk)`: where a hub checkpoint downloads, measured at
    its nearest folder that exists (the first download makes the cache)."""
    import shutil

    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return constants.HF_HUB_CACHE, shutil.disk_usage(folder).free


def check_disk(source: str, what: str = "--model") -> int | None:
    """Refuse, before any weight is downloaded, a hub checkpoint whose files do not fit the disk
    of the Hugging Face cache (`download_bytes` against `hub_cache_space`), naming both and the
    fix; returns the bytes still to download (`None`: not checked)."""
    need = download_bytes(source)
    if not need:
        return need
    cache, free = hub_cache_space()
    if need > free:
        raise CheckpointError(f"{what} {source}: its files need {need / 2**30:.1f} GiB and the Hugging Face cache's disk "
                              f"({cache}) has {free / 2**30:.1f} GiB free; free some space there, or "
                              "set HF_HUB_CACHE to a folder on a larger disk (nothing was downloaded)")
    return need


def hub_revision(source: str) -> str | None:
    """The commit of hub id `source`'s snapshot in the local Hugging Face cache, the one
    `from_pretrained` loads (its `main`), read from where its `model_index.json` lies
    (`snapshots/COMMIT/`); `None` for a checkpoint not cached, or not a hub id."""
    if not HUB_ID.match(source):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(source, "model_index.json")
    return Path(found).parent.name if isinstance(found, str) else None


def named_source(model: str | os.PathLike | None, env_var: str) -> str | None:
    """The checkpoint the user named (`model`, else `$<env_var>`), or `None` for the preset's."""
    return str(model) if model else os.environ.get(env_var) or None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_source(source: str, what: str = "--model", example: str = "zai-org/CogVideoX1.5-5B") -> None:
    """Refuse, naming `source`, a checkpoint that cannot load: a folder without `model_index.json`,
    a file, a path that does not exist and is no hub id, or (with `HF_HUB_OFFLINE=1`) a hub id
    that is not in the local cache. Reads no weights."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise CheckpointError(f"{what} {source}: the folder has no model_index.json, so it is not a diffusers "
                                  f"pipeline checkpoint (write one with pipeline.save_pretrained(DIR), or give a hub "
                                  f"id such as {example})")
        return
    if path.exists():
        raise CheckpointError(f"{what} {source}: a file, not a checkpoint folder; give the folder that holds "
                              "model_index.json, or a hub id")
    if not HUB_ID.match(source):
        raise CheckpointError(f"{what} {source}: no such folder, and not a hub id (OWNER/NAME, e.g. {example})")
    from tpupedia import rehearsal

    if _offline() and rehearsal.target() is None:  # a rehearsal plans a release from the family's own configs
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(source, "model_index.json"), str):
            raise CheckpointError(f"{what} {source}: no such folder here, and with HF_HUB_OFFLINE=1 the hub id must be "
                                  f"in the local Hugging Face cache, which has no model_index.json for it (download "
                                  f"it first, e.g. hf download {source} --local-dir DIR, then --model DIR)")


CONFIG_FILES = {"pipeline": "model_index.json", "scheduler": "scheduler/scheduler_config.json",
                "guider": "guider/guider_config.json"}
"""The file `read_configs` reads for a component whose file is not `<component>/config.json`."""


def config_file(name: str) -> str:
    """The file in a checkpoint that holds component `name`'s config (`pipeline`: `model_index.json`)."""
    return CONFIG_FILES.get(name, f"{name}/config.json")


def _connection_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "no route to the Hub" in the HTTP clients huggingface_hub uses."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]  # OfflineModeIsEnabled is a ConnectionError
    for module, names in (("requests", ("ConnectionError", "Timeout")), ("httpx", ("TransportError",)),
                          ("httpx2", ("TransportError",))):
        try:
            imported = __import__(module)
        except ImportError:
            continue
        found += [getattr(imported, n) for n in names if isinstance(getattr(imported, n, None), type)]
    return tuple(found)


def hub_unreachable(err: BaseException) -> str | None:
    """Why `err` (or an exception it was raised from or while handling: diffusers and transformers
    re-raise the Hub's errors as `OSError`s saying a file is missing) is the Hub not answering:
    `"offline"` (`HF_HUB_OFFLINE=1`, and the file not in the local cache), `"unreachable"` (no route
    to the Hub, and the file not cached), or `None` for any other error."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    connection = _connection_errors()
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OfflineModeIsEnabled):
            return "offline"
        if isinstance(err, LocalEntryNotFoundError):
            return "offline" if _offline() else "unreachable"
        if isinstance(err, connection):
            return "unreachable"
        err = err.__cause__ or err.__context__
    return None


def _unreachable_message(source: str, file: str, why: str) -> str:
    if why == "offline":
        return (f"checkpoint {source}: {file} is not in the local Hugging Face cache, and with HF_HUB_OFFLINE=1 the "
                f"Hub is not asked (download it first, e.g. hf download {source}, or unset HF_HUB_OFFLINE)")
    return (f"checkpoint {source}: could not reach the Hugging Face Hub for {file}, and the local cache does not hold "
            "it (check the network or HF_ENDPOINT; on a host without one, download the checkpoint elsewhere and "
            "give --model DIR)")


def read_configs(source: str, loaders: dict[str, Callable[[str], Any]]) -> dict[str, dict]:
    """`{component: config}` from `loaders[component](source)` (config files only, no weights),
    cleaned (`clean_config`); a missing or unreadable config is a `CheckpointError` naming its file
    (`config_file`), and so is a Hub that cannot be reached or, offline, a file not cached
    (`hub_unreachable`), said as such rather than as a missing file. A component already
    quantized (a `quantization_config`: bitsandbytes, torchao, GGUF) is refused in one line:
    `tpupedia.quantize` quantizes the bf16 weights itself, after any LoRA fuse."""
    configs = {}
    for name, load in loaders.items():
        try:
            configs[name] = clean_config(load(source))
        except Exception as err:  # sorted below: the Hub's errors, a bad file, or not ours
            why = hub_unreachable(err)
            if why is not None:
                raise CheckpointError(_unreachable_message(source, config_file(name), why)) from None
            if not isinstance(err, (OSError, ValueError, KeyError)):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"checkpoint {source}: cannot read the {name} config ({config_file(name)}): "
                                  f"{first}") from None
        if "quantization_config" in configs[name]:
            method = dict(configs[name]["quantization_config"] or {}).get("quant_method", "unnamed")
            raise CheckpointError(f"checkpoint {source}: its {name} is already quantized ({method}, "
                                  f"{config_file(name)}'s quantization_config); give the bf16 checkpoint and "
                                  "--quantize int8 or fp8, which quantizes it on the host")
    return configs


SHOWN_KEYS = 3
"""How many weight names a refused component's error quotes."""


class IgnoredWeightsWarning(UserWarning):
    """A checkpoint holds weights its class does not use: loaded, as stock loads it, and said."""


def check_loading_info(source: str, component: str, info: Any) -> None:
    """Refuse, in one line naming `component` and its first `SHOWN_KEYS` weight names, a component
    whose checkpoint weights do not match its class: weights the class has but the checkpoint lacks
    (left randomly initialised: "newly initialized") or weights of another shape, what stock
    refuses or runs wrong. Weights the checkpoint has that the class does not use ("not used"),
    and nothing missing, load as stock loads them, with an `IgnoredWeightsWarning` naming what was
    ignored. `info` is what
    `from_pretrained(..., output_loading_info=True)` returns with the model (diffusers and
    transformers), after each library has dropped what it expects to differ (tied weights,
    non-persistent buffers, its class's `_keys_to_ignore_on_load_*` patterns): what stock diffusers
    loads silently passes. Introduced with the CogVideoX pipeline (notebook `cogvideox_pipeline`)."""
    if hasattr(info, "to_dict"):
        info = info.to_dict()
    info = dict(info or {})
    problems = {}
    for key, what in (("missing_keys", "missing from the checkpoint"),
                      ("unexpected_keys", "in the checkpoint but not in the model"),
                      ("mismatched_keys", "of another shape in the checkpoint")):
        keys = sorted(k[0] if isinstance(k, (tuple, list)) else str(k) for k in (info.get(key) or ()))
        if keys:
            more = f" and {len(keys) - SHOWN_KEYS} more" if len(keys) > SHOWN_KEYS else ""
            problems[key] = f"{len(keys)} weight(s) {what} ({', '.join(keys[:SHOWN_KEYS])}{more})"
    if set(problems) == {"unexpected_keys"}:  # stock loads it and ignores them, with a warning: so do we
        import warnings

        warnings.warn(IgnoredWeightsWarning(
            f"checkpoint {source}: the {component} weights load as stock diffusers loads them, ignoring "
            f"{problems['unexpected_keys']}"), stacklevel=2)
    elif problems:
        raise CheckpointError(f"checkpoint {source}: the {component} weights do not match its "
                              f"{info.get('class', 'model')} class: {'; '.join(problems.values())}; refusing to run "
                              "with randomly initialised or ignored weights (is it the checkpoint this family loads?)")


def load_component(cls: Any, source: str, subfolder: str, **kwargs: Any) -> Any:
    """`cls.from_pretrained(source, subfolder=subfolder, use_safetensors=True, **kwargs)`, in eval
    mode, refused (`check_loading_info`) when the checkpoint's weights do not match `cls`. The
    one way the pipelines load a model component from a checkpoint."""
    try:
        model, info = cls.from_pretrained(source, subfolder=subfolder, use_safetensors=True,
                                          output_loading_info=True, **kwargs)
    except Exception as err:  # only the Hub not answering is reworded
        why = hub_unreachable(err)
        if why is None:
            raise
        raise CheckpointError(_unreachable_message(source, f"the {subfolder} weights", why)) from None
    info = info.to_dict() if hasattr(info, "to_dict") else dict(info)
    check_loading_info(source, subfolder, info | {"class": cls.__name__})
    return model.eval()
