"""Presets: one switch, `TPUPEDIA_PRESET`, decides how big everything is.

`tiny`
    Random weights from configs written in code, tokenizers built offline, 8 simulated CPU
    devices. Seconds per cell on a 2-core CPU; this is what CI runs.
`full`
    The real model ids through `from_pretrained`, real devices (a TPU VM, or a GPU). The same
    code path as `tiny`; only the sizes and the weight source change.

Introduced in notebook `start_here` (start here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tpupedia.errors import TpupediaError

__all__ = ["Preset", "PRESETS", "PresetError", "ENV_VAR", "DEFAULT", "get", "current"]

ENV_VAR = "TPUPEDIA_PRESET"
DEFAULT = "tiny"


class PresetError(TpupediaError, ValueError):
    """An unknown preset name."""


@dataclass(frozen=True)
class Preset:
    """What a preset means for the notebooks and the CLI."""

    name: str
    description: str
    simulated_devices: int | None
    """Number of simulated CPU devices to create, or `None` to use the machine's real devices."""
    pretrained: bool
    """Load real checkpoints with `from_pretrained` (`True`) or build random tiny models."""
    dtype: str
    """The dtype models run in: `float32` on the tiny preset (exact parity checks), `bfloat16`
    on the full one (how the checkpoints are released and TPUs run them)."""
    compile_full_size: bool
    """Compile full-size programs for a TPU slice live (minutes on a CPU host), or read the
    recorded dry-runs (`tpupedia dryrun ... --record`) instead."""
    frame_size: tuple[int, int]
    """(height, width) of the video frames the image lessons process."""

    @property
    def host_runs_whole_models(self) -> bool:
        """Whether the host can run this preset's models whole: stock diffusers pipelines end to
        end on the CPU as parity references, a whole transformer on one device, the CLI in local
        CPU processes that stand in for the hosts of a slice. True for random tiny models
        (seconds); False for the released checkpoints, where that takes hours to days of CPU time
        and more than one chip's memory. There notebooks `cogvideox_pipeline` and `hunyuan_video` compare one denoising step at
        a small size, or the checkpoint's first blocks, and notebook `beyond_one_host` prints its multi-process
        commands instead of running them; `tests/test_full_preset_gates.py` checks that such code
        sits under a preset gate. A property, not a field: it follows from `pretrained`."""
        return not self.pretrained


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description="random tiny models, offline tokenizers, 8 simulated CPU devices (CI, laptops)",
        simulated_devices=8,
        pretrained=False,
        dtype="float32",
        compile_full_size=False,
        frame_size=(360, 640),
    ),
    "full": Preset(
        name="full",
        description="real checkpoints via from_pretrained on the machine's real devices (TPU VM, GPU)",
        simulated_devices=None,
        pretrained=True,
        dtype="bfloat16",
        compile_full_size=True,
        frame_size=(1080, 1920),
    ),
}


def get(name: str) -> Preset:
    """Return the preset called `name`; raise `PresetError` naming the allowed ones."""
    key = name.strip().lower()
    if key not in PRESETS:
        allowed = ", ".join(PRESETS)
        raise PresetError(f"{ENV_VAR}={name!r} is not a preset; choose one of: {allowed}")
    return PRESETS[key]


def current() -> Preset:
    """The preset in force: `$TPUPEDIA_PRESET`, or `tiny` when it is unset or empty."""
    return get(os.environ.get(ENV_VAR) or DEFAULT)
