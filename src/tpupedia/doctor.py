"""`tpupedia doctor`: what this machine is, what is installed, and what it can do.

Every probe is isolated: a missing or broken optional piece becomes a line that says what is
missing and how to install it, never a crash. Introduced in notebook `start_here` (start here).
"""

from __future__ import annotations

import json
import os
import platform as _platform
import shutil
from dataclasses import dataclass, field

from tpupedia import devices, presets, results

__all__ = ["PACKAGES", "Check", "Report", "run", "format_report"]

# distribution name -> install hint shown when it is missing
PACKAGES: dict[str, str] = {
    "torch": "pip install 'torch==2.13.0'  (CPU wheel; do not let pip pick a CUDA build by accident)",
    "jax": "pip install 'jax==0.10.2'",
    "jaxlib": "pip install 'jaxlib==0.10.2'",
    "libtpu": "pip install 'jax[tpu]==0.10.2'  (also enables AOT compiles for TPUs on CPU hosts)",
    "torchax": "pip install 'torchax==0.0.13'",
    "flax": "pip install 'flax==0.12.8'",
    "transformers": "pip install 'transformers==5.23.0'",
    "diffusers": "pip install 'diffusers==0.42.1'",
    "peft": "pip install 'peft==0.21.2'  (diffusers' LoRA loading: generate --lora)",
}


@dataclass
class Check:
    name: str
    ok: bool
    value: str
    hint: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, value: str, hint: str = "") -> None:
        self.checks.append(Check(name, ok, value, hint))

    def as_dict(self) -> dict[str, dict[str, object]]:
        return {c.name: {"ok": c.ok, "value": c.value, "hint": c.hint} for c in self.checks}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)


def _probe_preset(report: Report) -> None:
    try:
        p = presets.current()
        report.add("preset", True, f"{p.name}: {p.description}")
    except presets.PresetError as err:
        report.add("preset", False, str(err), f"unset {presets.ENV_VAR} or set it to tiny or full")


def _probe_versions(report: Report) -> None:
    for dist, hint in PACKAGES.items():
        v = results.version(dist)
        optional = dist == "libtpu"
        report.add(dist, v is not None or optional, v or "not installed", "" if v else hint)


def _probe_torchax(report: Report) -> None:
    if results.version("torchax") is None or results.version("torch") is None:
        return
    try:
        from tpupedia import compat

        compat.import_torchax()
        missing = compat.missing_overloads()
        shim = f"import shim covers {len(missing)} removed overloads" if missing else "no shim needed"
        report.add("torchax import", True, shim)
    except Exception as err:  # noqa: BLE001 - doctor must report, not crash
        report.add("torchax import", False, f"{type(err).__name__}: {err}", "see tpupedia.compat")


def _probe_devices(report: Report) -> None:
    if results.version("jax") is None or results.version("jaxlib") is None:
        report.add("devices", False, "jax is not installed", PACKAGES["jax"])
        return
    try:
        devices.quiet_libtpu()
        import jax

        devs = jax.devices()
        kinds = sorted({d.device_kind for d in devs})
        report.add("platform", True, jax.default_backend())
        report.add("devices", True, f"{len(devs)} x {', '.join(kinds)}")
    except Exception as err:  # noqa: BLE001
        report.add("devices", False, f"{type(err).__name__}: {err}", "check the jax/jaxlib install")


def _probe_aot(report: Report, topology: str) -> None:
    if not devices.has_libtpu():
        report.add(
            "TPU AOT compile",
            False,
            "unavailable: libtpu is not installed",
            PACKAGES["libtpu"],
        )
        return
    try:
        devs = devices.tpu_topology(topology)
        report.add("TPU AOT compile", True, f"available ({topology}: {len(devs)} x {devs[0].device_kind})")
    except Exception as err:  # noqa: BLE001
        report.add("TPU AOT compile", False, f"{type(err).__name__}: {err}", PACKAGES["libtpu"])


def _probe_video(report: Report) -> None:
    from tpupedia import video

    try:
        video.check_encoder()
        report.add("video encoder", True, f"{video.ENCODER} {results.version(video.ENCODER)}")
    except video.VideoError as err:
        report.add("video encoder", False, str(err), f"pip install {video.ENCODER}  (or pip install -e '.[video]')")


def _probe_disk(report: Report, folder: str = ".") -> None:
    """Free space where a run writes (`--workdir` and `--out` default to this folder) against
    what one full-size video writes (`video.output_bytes`), for the family whose default full
    request is largest."""
    try:
        from tpupedia import families, video

        full = presets.get("full")
        sizes = {}
        for spec in families.video():
            r = spec.facts.default_request(full)
            sizes[spec.name] = (video.output_bytes(r["frames"], r["height"], r["width"]), r)
        name, (need, r) = max(sizes.items(), key=lambda item: item[1][0])
        free = shutil.disk_usage(folder).free
        report.add("disk space", free >= need,
                   f"{free / 2**30:.1f} GiB free in {os.path.abspath(folder)}; one full-size video writes up to "
                   f"{need / 2**30:.1f} GiB ({name}, {r['frames']} frames at {r['width']}x{r['height']}: "
                   "its decode file and mp4)",
                   "" if free >= need else "free some space, or give --workdir and --out on a larger disk")
    except Exception as err:  # noqa: BLE001 - doctor must report, not crash
        report.add("disk space", False, f"{type(err).__name__}: {err}", "check the install (tpupedia.families)")


def _probe_hub_cache(report: Report) -> None:
    """Free space on the Hugging Face cache's disk, where a full-size checkpoint downloads; a
    full-size run holds each checkpoint's files against it before downloading
    (`tpupedia.models.checkpoints.check_disk`). A row to read, not a verdict: the sizes are the
    Hub's, known only when a run asks it."""
    try:
        from tpupedia.models import checkpoints

        cache, free = checkpoints.hub_cache_space()
        report.add("Hub cache", True, f"{free / 2**30:.1f} GiB free for {cache}; a full-size run "
                   "checks a checkpoint's files against it before downloading them (HF_HUB_CACHE moves it)")
    except Exception as err:  # noqa: BLE001 - doctor must report, not crash
        report.add("Hub cache", False, f"{type(err).__name__}: {err}", PACKAGES.get("huggingface_hub", ""))


def _probe_lora_host(report: Report) -> None:
    """Host memory now against what fusing a LoRA adapter into each family's full-size
    transformer holds on the host (`tpupedia.lora.fuse_bytes`: the transformer in bfloat16, plus
    the adapter, not counted here). Fine if at least one family's fits; the rest are named."""
    try:
        from tpupedia import families, hardware, lora

        need = {}
        for spec in families.video():
            configs = spec.facts.full_configs()
            need[spec.name] = max(lora.transformer_bytes(spec.facts, configs, c, "bfloat16") for c in lora.components(configs))
        available = hardware.host_memory_available()
        short = [n for n, b in need.items() if b > available]
        report.add("LoRA fuse (host)", len(short) < len(need),
                   f"{available / 2**30:.1f} GiB of host memory available; --lora fuses on the host, holding the "
                   "full-size transformer in bfloat16 ("
                   + ", ".join(f"{n} {b / 2**30:.1f} GiB" for n, b in need.items()) + ") plus twice the adapter's file",
                   f"--lora with {', '.join(short)} needs a host with more memory (a TPU VM's)" if short else "")
    except Exception as err:  # noqa: BLE001 - doctor must report, not crash
        report.add("LoRA fuse (host)", False, f"{type(err).__name__}: {err}", PACKAGES["diffusers"])


def run(topology: str = "v6e:2x4") -> Report:
    """Probe this machine. Never raises for a missing optional piece."""
    report = Report()
    report.add("python", True, _platform.python_version())
    _probe_preset(report)
    _probe_versions(report)
    _probe_devices(report)
    _probe_torchax(report)
    _probe_aot(report, topology)
    _probe_video(report)
    _probe_disk(report)
    _probe_hub_cache(report)
    _probe_lora_host(report)
    if os.environ.get("JAX_PLATFORMS"):
        report.add("JAX_PLATFORMS", True, os.environ["JAX_PLATFORMS"])
    return report


def format_report(report: Report) -> str:
    width = max(len(c.name) for c in report.checks)
    lines = []
    for c in report.checks:
        mark = "ok " if c.ok else "-- "
        lines.append(f"{mark}{c.name:<{width}}  {c.value}")
        if c.hint:
            lines.append(f"   {'':<{width}}  -> {c.hint}")
    return "\n".join(lines)
