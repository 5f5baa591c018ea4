"""A rehearsal: a full-size run checked against the slice it is meant for, on a host without it.

Every way into a run (`tpupedia.pipelines.common.run`, `run_batch`, the stage methods of a
pipeline built by hand, and so `tpupedia generate` and the notebooks) checks its plan before it
loads a weight. With `TPUPEDIA_REHEARSE=TOPOLOGY` set (`v6e:2x4`, a name `--topology` takes) each
of them does exactly that and no more: the checkpoint's configs are those the family builds in
for its releases (`StagedPipeline.plan_configs`: no download), the plan is checked for the
slice's devices (`tpupedia.devices.tpu_topology`: ahead-of-time compiles, at the plan's reduced
depth and scaled), and then the way in stops with `Rehearsed`, which says who called, what was
planned, and that nothing was loaded. A run that would not fit fails as it would on the slice,
with the plan's own `PlanError` naming the stage and the fix. `tpupedia.rehearse` (`make
rehearse`) drives every `generate` path and the notebooks' full-preset calls this way.

Introduced in notebook `plan_without_tpu` (plan without a TPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from tpupedia.errors import TpupediaError

__all__ = ["ENV", "Rehearsed", "target", "devices", "stop"]

ENV = "TPUPEDIA_REHEARSE"


class Rehearsed(TpupediaError, RuntimeError):
    """A way in checked its plan under a rehearsal and stopped before loading anything. The
    `tpupedia` command prints it as its last line and exits 0; `tpupedia.rehearse` counts it."""

    def __init__(self, caller: str, family: str, topology: str, request: Any):
        self.caller, self.family, self.topology, self.request = caller, family, topology, request
        size = f"{request.width}x{request.height}, {request.frames} frames"
        super().__init__(f"rehearsed {caller}: {family} at {size} planned for {topology}, VAE tiling "
                         f"{'on' if request.vae_tiling else 'off'}; nothing was loaded ({ENV} is set)")


def target() -> str | None:
    """The topology a rehearsal plans for (`$TPUPEDIA_REHEARSE`), or `None` outside one."""
    return os.environ.get(ENV) or None


@functools.lru_cache(maxsize=4)
def _devices(name: str) -> tuple:
    from tpupedia import devices as _dev

    return tuple(_dev.tpu_topology(name))


def devices() -> list:
    """The devices of the rehearsal's slice (ahead-of-time descriptions, nothing runs on them)."""
    return list(_devices(target()))


def stop(caller: str, family: str, request: Any) -> None:
    """Under a rehearsal, end the way in `caller` now that its plan is checked (`Rehearsed`)."""
    if target() is not None:
        raise Rehearsed(caller, family, target(), request)
