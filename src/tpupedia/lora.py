"""LoRA adapters fused into a transformer's weights on the host, before the weights are sharded.

An adapter (`--lora PATH[:SCALE][@COMPONENT]`) is read the way diffusers reads it for the family
(its pipeline's LoRA loader, `family.LORA_LOADER`: `lora_state_dict`, which converts the
community key layouts diffusers knows, then `load_lora_into_transformer`; a family whose pipeline
exposes none loads through its transformer's own `load_lora_adapter`), then fused
(`fuse_lora(lora_scale=SCALE)`: `W += SCALE * B @ A * alpha / r`) and unloaded, all on the host.
What reaches the devices is an ordinary transformer: the original module names (so the family's
sharding rules place it as they place the stock weights), the original shapes, and no cost per
step. The price is that another adapter set is another transformer: a batch groups its lines by
adapter set and reloads between groups (`pipelines.common.run_batch`).

Everything that can be wrong with an adapter is refused in one line before the transformer
loads (`check`): a missing file or one that is not safetensors (a pickle can run code when it
is loaded, so none is ever read), a scale that is not a number, a component the checkpoint does
not have, a key that names no layer of the transformer or lacks its pair, a shape that does not
fit the layer (an adapter for another family or model size). The shapes are read from the
transformer built on PyTorch's `meta` device from its config: no weights.

A stage file records each adapter (`settings`: its file's SHA-256, scale, component) in the
stages it changes, denoise and decode, so a changed adapter reruns them. Introduced in notebook
`fewer_steps`, which writes an adapter, fuses it by hand and through this module, and compares
both with stock diffusers.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from tpupedia.errors import TpupediaError

__all__ = ["LoraError", "Adapter", "parse", "parse_all", "components", "check", "fuse", "settings", "sha256",
           "fuse_bytes", "transformer_bytes", "weights_file", "FORMAT", "SUFFIXES", "WEIGHTS_NAME", "HUB",
           "hub_file"]

FORMAT = "PATH[:SCALE][@COMPONENT]"
"""PATH: a .safetensors file, the folder diffusers' `save_lora_weights` wrote, or a Hub adapter
(`hf:OWNER/NAME[/WEIGHT_NAME]`, `HUB`)."""
SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias")
"""The keys a LoRA layer has in the peft layout diffusers loads (after its conversions)."""
_COMPONENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class LoraError(TpupediaError, ValueError):
    """An adapter that cannot be fused: a bad `--lora` value, a file that is missing or not
    safetensors, keys or shapes that do not fit the checkpoint's transformer."""


class Adapter(NamedTuple):
    """One adapter: its file, the scale its update is fused with, the transformer it goes into
    (`transformer_2`: a two-expert checkpoint's low-noise expert). A tuple, so that a batch
    record writes it as JSON and a set of them is a dictionary key."""

    path: str
    scale: float = 1.0
    component: str = "transformer"


def parse(text: str, where: str = "--lora", base: str | os.PathLike | None = None) -> Adapter:
    """`PATH[:SCALE][@COMPONENT]` as an `Adapter`: `@COMPONENT` is the text after the last `@`
    when it is a name, `:SCALE` the text after the last `:` when it is not part of a path
    (`a.safetensors:0.8`, `a.safetensors@transformer_2`, `a.safetensors:0.5@transformer_2`).
    A relative PATH is taken from `base` when given (a JSONL batch's folder); a folder PATH, as
    diffusers' `save_lora_weights` writes one, names its weights file (`weights_file`)."""
    if not isinstance(text, str) or not text.strip():
        raise LoraError(f"{where} {text!r}: give {FORMAT}, e.g. style.safetensors:0.8")
    rest, component = text.strip(), "transformer"
    head, at, tail = rest.rpartition("@")
    if at and head and _COMPONENT.fullmatch(tail):
        rest, component = head, tail
    scale = 1.0
    head, colon, tail = rest.rpartition(":")
    if colon and head and head + colon != HUB and "/" not in tail and not tail.endswith(".safetensors"):
        try:
            scale = float(tail)
        except ValueError:
            raise LoraError(f"{where} {text}: scale {tail!r} is not a number; give {FORMAT}, "
                            "e.g. style.safetensors:0.8") from None
        if not math.isfinite(scale):
            raise LoraError(f"{where} {text}: scale {tail!r} must be a finite number")
        rest = head
    if rest.startswith(HUB):
        return Adapter(hub_file(rest, where), scale, component)
    if base is not None:
        rest = os.path.join(base, rest)
    return Adapter(weights_file(rest), scale, component)


def parse_all(texts: Iterable[str] | None, where: str = "--lora",
              base: str | os.PathLike | None = None) -> tuple[Adapter, ...]:
    """Every `--lora` value, in order (`None`: no adapter)."""
    return tuple(parse(t, where, base) for t in texts or ())


WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
"""The file diffusers' `save_lora_weights` writes into a folder (`LORA_WEIGHT_NAME_SAFE`)."""


def weights_file(path: str) -> str:
    """The adapter file `path` names: itself, or for a folder the file stock `load_lora_weights`
    reads from it (diffusers 0.42.1 `lora_base._best_guess_weight_name`): its `.safetensors`
    files, those named for a scheduler, optimizer or checkpoint left out, `WEIGHTS_NAME`
    preferred. Where several remain stock takes the first the folder lists, an order the file
    system chooses: we refuse and name them instead."""
    if not os.path.isdir(path):
        return path
    return os.path.join(path, _best_guess(os.listdir(path), f"LoRA {path}: a folder", "give the file"))


def _best_guess(names: Iterable[str], what: str, fix: str) -> str:
    """The adapter file stock `load_lora_weights` picks from `names` (a folder's or a Hub
    repository's files), or a `LoraError` saying `what` holds none or several (then `fix`)."""
    found = sorted(f for f in names if f.endswith(".safetensors")
                   and not any(word in f for word in ("scheduler", "optimizer", "checkpoint")))
    if any(f.endswith(WEIGHTS_NAME) for f in found):
        found = [f for f in found if f.endswith(WEIGHTS_NAME)]
    if not found:
        raise LoraError(f"{what} with no .safetensors adapter in it; give the folder diffusers' "
                        f"save_lora_weights wrote ({WEIGHTS_NAME}) or the adapter file")
    if len(found) > 1:
        raise LoraError(f"{what} with {len(found)} adapters ({', '.join(found)}); {fix}")
    return found[0]


HUB = "hf:"
"""How `--lora` names an adapter on the Hugging Face Hub: `hf:OWNER/NAME` or
`hf:OWNER/NAME/WEIGHT_NAME` (stock: `load_lora_weights("OWNER/NAME", weight_name=...)`)."""


def hub_file(text: str, where: str = "--lora") -> str:
    """The local path of the Hub adapter `text` names (`HUB`): the weight name given, or the one
    stock picks from the repository's files (`_best_guess`); from the Hugging Face cache, else
    downloaded (said in a line first). `LoraError` in one line for a malformed name, a repository
    or file that cannot be had, or a weight name that is not safetensors."""
    parts = text.removeprefix(HUB).strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise LoraError(f"{where} {text}: give {HUB}OWNER/NAME[/WEIGHT_NAME], e.g. {HUB}owner/style-lora/style.safetensors")
    repo, weight = "/".join(parts[:2]), "/".join(parts[2:])
    if weight and not weight.endswith(".safetensors"):
        raise LoraError(f"{where} {text}: {weight} is not a .safetensors file; only safetensors adapters are read")
    from huggingface_hub import hf_hub_download, list_repo_files, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        if not weight:
            weight = _best_guess(list_repo_files(repo), f"LoRA {text}: the repository",
                                 f"name one: {HUB}{repo}/WEIGHT_NAME")
        if not isinstance(try_to_load_from_cache(repo, weight), str):
            print(f"LoRA {text}: fetching {weight} from {repo} on the Hugging Face Hub")
        return hf_hub_download(repo, weight)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LoraError(f"{where} {text}: cannot be had from the Hub ({why}); fetch it with "
                        f"`hf download {repo}{' ' + weight if weight else ''}` and give the file") from None


def components(configs: dict[str, dict]) -> tuple[str, ...]:
    """The transformers of a checkpoint an adapter can go into: `transformer`, and
    `transformer_2` where the checkpoint has a second expert."""
    return tuple(name for name in ("transformer", "transformer_2") if configs.get(name))


_STATS: dict[tuple, str] = {}


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def sha256(path: str) -> str:
    """The SHA-256 of an adapter file, computed once per file version (path, size, mtime): a
    batch builds its lines' settings many times."""
    key = _stat_key(path)
    if key not in _STATS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        _STATS[key] = digest.hexdigest()
    return _STATS[key]


def settings(adapters: Iterable[Adapter]) -> dict[str, Any]:
    """What adapters add to the settings of the stages they change (denoise and decode): each
    file's SHA-256 (not its path: a moved file is the same adapter), its scale and component, in
    order; `{}` without adapters, so that the fingerprints of runs without one do not change."""
    found = [{"sha256": sha256(a.path), "scale": float(a.scale), "component": a.component} for a in adapters]
    return {"lora": found} if found else {}


def _check_file(adapter: Adapter) -> None:
    """The file exists and is safetensors (suffix and a readable header); never unpickled."""
    path = Path(adapter.path)
    if not path.is_file():
        raise LoraError(f"LoRA {adapter.path}: no such file; give {FORMAT} with the path of a .safetensors adapter "
                        "or of the folder diffusers' save_lora_weights wrote")
    if path.suffix != ".safetensors":
        raise LoraError(f"LoRA {adapter.path}: not a .safetensors file; only safetensors adapters are read (a pickled "
                        "checkpoint, .bin .pt .ckpt, can run code when it is loaded: convert it to safetensors)")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError) as err:
        raise LoraError(f"LoRA {adapter.path}: not a readable safetensors file ({str(err).splitlines()[0]})") from None


def _loader(family: Any) -> Any:
    """The family's diffusers LoRA loader (a `*LoraLoaderMixin`), or `None`: its pipeline exposes
    none, and the transformer loads the adapter itself (`PeftAdapterMixin.load_lora_adapter`)."""
    name = getattr(family, "LORA_LOADER", None)
    if name is None:
        return None
    import diffusers.loaders

    return getattr(diffusers.loaders, name)


def _read(adapter: Adapter, family: Any, transformer: Any) -> tuple[dict, Any, str | None]:
    """`(state_dict, metadata, prefix)` as diffusers hands the adapter to `load_lora_adapter`:
    through the family's loader (its key conversions, and, as its `load_lora_weights` does, a
    text-to-video adapter widened for an image-to-video transformer where the loader does that),
    or read from the file, its keys under `transformer.` if any are."""
    loader = _loader(family)
    if loader is None:
        from safetensors import safe_open

        with safe_open(adapter.path, "pt") as f:
            keys = list(f.keys())
        prefix = "transformer" if any(k.startswith("transformer.") for k in keys) else None
        return None, None, prefix  # `load_lora_adapter` reads the file (and its metadata) itself
    state, metadata = loader.lora_state_dict(adapter.path, use_safetensors=True, return_lora_metadata=True)
    _say_dropped(adapter, state)
    expand = getattr(loader, "_maybe_expand_t2v_lora_for_i2v", None)
    if expand is not None:
        state = expand(transformer=transformer, state_dict=state)
    return state, metadata, "transformer"


class DroppedKeysWarning(UserWarning):
    """An adapter holds tensors diffusers' conversion leaves out (lightx2v's `.diff` keys of
    norms and modulations): fused as stock fuses it, without them, and said."""


_SAID: set[tuple] = set()


def _say_dropped(adapter: Adapter, state: dict) -> None:
    """Warn, once per file version, when the family loader's conversion kept fewer tensors than
    the file holds (an `alpha` is folded into its pair, so it counts as kept): stock's
    `load_lora_weights` drops such keys with at most a debug line. Named: the first keys with
    `.diff` in them, the full-weight and modulation differences lightx2v's files carry."""
    from safetensors import safe_open

    with safe_open(adapter.path, "pt") as f:
        keys = list(f.keys())
    dropped = len(keys) - sum(k.endswith(".alpha") for k in keys) - len(state)
    key = (_stat_key(adapter.path), dropped)
    if dropped <= 0 or key in _SAID:
        return
    _SAID.add(key)
    diffs = sorted(k for k in keys if ".diff" in k and not k.endswith(".diff_b"))
    import warnings

    example = f" (such as {', '.join(diffs[:SHOWN])})" if diffs else ""
    warnings.warn(DroppedKeysWarning(
        f"LoRA {adapter.path}: {dropped} of its {len(keys)} tensors are left out by diffusers' conversion{example}, "
        "as stock's load_lora_weights leaves them out: the fused weights are stock's, without those differences"),
        stacklevel=3)


SHOWN = 3
"""How many dropped keys a warning names."""


def _peft_state(adapter: Adapter, family: Any, transformer: Any) -> dict:
    """The adapter's tensors by the names `load_lora_adapter` gives peft: the prefix taken off,
    the old `lora.down/up` layout converted; a key outside the prefix is refused (diffusers
    would drop it silently: a text encoder's, or another loader's layout)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    try:
        state, _, prefix = _read(adapter, family, transformer)
    except (ValueError, KeyError, IndexError, RuntimeError) as err:  # a layout diffusers' conversion cannot take
        first = (str(err).strip().splitlines() or [""])[0]
        raise LoraError(f"LoRA {adapter.path}: diffusers cannot read it as an adapter for this family "
                        f"({type(err).__name__}: {first})") from None
    if state is None:
        from safetensors.torch import load_file

        state = load_file(adapter.path)
    if prefix is not None:
        outside = [k for k in state if not k.startswith(f"{prefix}.")]
        if outside:
            raise LoraError(f"LoRA {adapter.path}: unexpected key {outside[0]!r} ({len(outside)} keys are not the "
                            f"transformer's: they must start with {prefix + '.'!r})")
        state = {k.removeprefix(f"{prefix}."): v for k, v in state.items()}
    if not state:
        raise LoraError(f"LoRA {adapter.path}: holds no weights for the transformer")
    if "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    return state


_CHECKED: dict[tuple, None] = {}


def _meta_transformer(family: Any, configs: dict[str, dict], component: str) -> Any:
    """The checkpoint's `component` (a `family.TRANSFORMER_CLASS`) built on PyTorch's `meta`
    device from its config: every layer's shape, no weights."""
    import diffusers
    import torch

    config = configs[component]
    cls = getattr(diffusers, family.TRANSFORMER_CLASS)
    with torch.device("meta"):
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def _check_shapes(adapter: Adapter, state: dict, transformer: Any) -> None:
    """Every key names a layer of `transformer` with a weight, comes with its pair (`lora_A` and
    `lora_B`), and has the shapes that layer needs: `A` `(r, in, ...)`, `B` `(out, r, 1, ...)`."""
    modules = dict(transformer.named_modules())
    layers: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        suffix = next((s for s in SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise LoraError(f"LoRA {adapter.path}: unexpected key {key!r}; a LoRA layer's keys end in "
                            f"{', '.join(SUFFIXES)}")
        layers.setdefault(key.removesuffix(suffix), {})[suffix] = value
    for name, found in layers.items():
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim < 2:
            raise LoraError(f"LoRA {adapter.path}: unexpected key {name + next(iter(found))!r}: the {adapter.component} "
                            f"has no layer {name!r} with a weight matrix (an adapter for another family?)")
        for pair in (".lora_A.weight", ".lora_B.weight"):
            if pair not in found:
                raise LoraError(f"LoRA {adapter.path}: missing key {name + pair!r} (the other half of {name}'s LoRA pair)")
        a, b = found[".lora_A.weight"], found[".lora_B.weight"]
        rank = a.shape[0]
        want_a = (rank, *weight.shape[1:])
        want_b = (weight.shape[0], rank, *[1] * (weight.ndim - 2))
        bias = found.get(".lora_B.bias")
        for key, got, want in ((".lora_A.weight", a.shape, want_a), (".lora_B.weight", b.shape, want_b),
                               (".lora_B.bias", None if bias is None else bias.shape, (weight.shape[0],))):
            if got is not None and tuple(got) != want:
                raise LoraError(f"LoRA {adapter.path}: {name + key} has shape {tuple(got)}, the {adapter.component}'s "
                                f"{name} (weight {tuple(weight.shape)}) needs {want}: an adapter for another family "
                                "or model size")


def check(adapters: Iterable[Adapter], family: Any, configs: dict[str, dict] | None = None) -> None:
    """Refuse, in one line naming the bad value and what is allowed, an adapter that cannot be
    fused: without the checkpoint's `configs`, a missing or non-safetensors file; with them, also
    a component the checkpoint does not have, keys that do not name the transformer's layers or
    lack their pair, shapes that do not fit. Loads no weights of the checkpoint; each adapter is
    checked once per file version and checkpoint."""
    adapters = tuple(adapters)
    for adapter in adapters:
        if not isinstance(adapter, Adapter):
            raise LoraError(f"LoRA {adapter!r}: expected an Adapter ({FORMAT}, `tpupedia.lora.parse`)")
        if not isinstance(adapter.scale, (int, float)) or isinstance(adapter.scale, bool) or not math.isfinite(adapter.scale):
            raise LoraError(f"LoRA {adapter.path}: scale {adapter.scale!r} must be a finite number")
        _check_file(adapter)
        if configs is None:
            continue
        allowed = components(configs)
        if adapter.component not in allowed:
            raise LoraError(f"LoRA {adapter.path}@{adapter.component}: this checkpoint has no {adapter.component!r}; "
                            f"an adapter goes into {' or '.join(allowed)}")
        key = (_stat_key(adapter.path), adapter.component, _config_key(configs[adapter.component]), getattr(family, "FAMILY", ""))
        if key in _CHECKED:
            continue
        transformer = _meta_transformer(family, configs, adapter.component)
        _check_shapes(adapter, _peft_state(adapter, family, transformer), transformer)
        _CHECKED[key] = None


def _config_key(config: dict) -> str:
    import json

    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def fuse(module: Any, adapters: Iterable[Adapter], family: Any) -> Any:
    """Fuse `adapters` into `module` (a transformer on the host, in the dtype it runs in), in
    order, each as stock diffusers does with `load_lora_weights(path)` then
    `fuse_lora(lora_scale=scale)`, then unload the adapter layers (`unload_lora`): the merged
    weights stay, the module names and shapes are the original ones. Returns `module`."""
    for i, adapter in enumerate(adapters):
        name = f"tpupedia_{i}"
        state, metadata, prefix = _read(adapter, family, module)
        if state is None:  # the transformer's own loader reads the file
            module.load_lora_adapter(adapter.path, prefix=prefix, adapter_name=name, use_safetensors=True)
        else:
            _loader(family).load_lora_into_transformer(state, transformer=module, adapter_name=name, metadata=metadata)
        module.fuse_lora(lora_scale=adapter.scale, adapter_names=[name])
        module.unload_lora()
    return module


_BYTES: dict[tuple, int] = {}


def transformer_bytes(family: Any, configs: dict[str, dict], component: str, dtype: str) -> int:
    """Bytes of the checkpoint's `component` (parameters and buffers) in `dtype`, from its config."""
    import torch

    key = (family.TRANSFORMER_CLASS, _config_key(configs[component]), dtype)
    if key not in _BYTES:
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        module = _meta_transformer(family, configs, component)
        _BYTES[key] = sum(t.numel() for t in module.state_dict().values()) * size
    return _BYTES[key]


def fuse_bytes(adapters: Iterable[Adapter], family: Any, configs: dict[str, dict], dtype: str) -> dict[str, int]:
    """Host bytes fusing `adapters` needs, per component adapted: a stated estimate, the
    component's weights in `dtype` (the dtype it loads in, `transformer_bytes`) plus twice each of
    its adapters' files (the tensors as read, and the adapter layers they are copied into until
    the fuse)."""
    out: dict[str, int] = {}
    for adapter in adapters:
        if adapter.component not in out:
            out[adapter.component] = transformer_bytes(family, configs, adapter.component, dtype)
        out[adapter.component] += 2 * os.path.getsize(adapter.path)
    return out
