"""DeepCache for a diffusion transformer: which steps run in full, which reuse a cached state.

Adjacent denoising steps produce similar deep features, so a step can start from the state a
previous full step computed just before its last blocks and run only those blocks (the "tail").
A schedule `(start, end, interval)` is decided on the host, before anything is compiled: every
step before `start` and from `end` on runs in full, and between them one step in `interval` does
(`range(start, end, interval)`); the others are cached. That is the schedule the upstream project
uses on TPU (yangwhale/gpu-tpu-pedia, commit 3fa9ce1, its HunyuanVideo-1.5 DeepCache helper:
defaults 11, 45, 4 over 50 steps, 25 full steps), and the reason it needs no branch inside jit:
the pipeline compiles two programs, full and cached, and the Python loop picks one per step
(`tpupedia.pipelines.hunyuan`).

Quality and time are measured, not assumed: `tpupedia.metrics.compare` gives PSNR and SSIM of a
cached video against the uncached one; `tpupedia bench deepcache` records both with the time per
step.
Introduced in notebook `hunyuan_tuning_and_i2v`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpupedia.errors import TpupediaError

__all__ = ["DeepCacheError", "Schedule", "UPSTREAM_DEFAULT", "parse"]


class DeepCacheError(TpupediaError, ValueError):
    """A DeepCache schedule that does not fit the run: bounds outside the steps, interval < 1."""


@dataclass(frozen=True)
class Schedule:
    """Full steps: `[0, start)`, `range(start, end, interval)`, `[end, steps)`; the rest cached."""

    start: int
    end: int
    interval: int
    tail: int = 1
    """Blocks a cached step recomputes (upstream: the last dual-stream block)."""

    def check(self, steps: int, layers: int | None = None) -> None:
        """Refuse a schedule that cannot apply to `steps` steps (and `layers` blocks)."""
        for name in ("start", "end", "interval", "tail"):
            if not isinstance(getattr(self, name), int):
                raise DeepCacheError(f"deepcache {name}={getattr(self, name)!r} must be an integer")
        if self.interval < 1:
            raise DeepCacheError(f"deepcache interval={self.interval} must be >= 1 (1 recomputes every step)")
        if not 0 <= self.start < self.end <= steps:
            raise DeepCacheError(f"deepcache {self.start}:{self.end}:{self.interval} must satisfy "
                                 f"0 <= start < end <= steps={steps}")
        if self.tail < 1 or (layers is not None and self.tail >= layers):
            raise DeepCacheError(f"deepcache tail={self.tail} blocks must be >= 1 and fewer than the "
                                 f"model's {layers} blocks")

    def full_steps(self, steps: int) -> list[int]:
        """The steps that run every block, in order; the first is always step 0."""
        self.check(steps)
        inside = set(range(self.start, self.end, self.interval))
        return [i for i in range(steps) if i < self.start or i >= self.end or i in inside]

    def __str__(self) -> str:
        return f"{self.start}:{self.end}:{self.interval}"


UPSTREAM_DEFAULT = Schedule(11, 45, 4)
"""The upstream TPU defaults (`--cache_start_step 11 --cache_end_step 45 --cache_step_interval 4`)."""


def parse(text: str) -> Schedule:
    """`"START:END:INTERVAL"` -> `Schedule`, e.g. `"11:45:4"`."""
    parts = text.split(":")
    try:
        start, end, interval = (int(p) for p in parts)
    except ValueError:
        raise DeepCacheError(f"deepcache {text!r}: expected START:END:INTERVAL, three integers (e.g. 11:45:4)") from None
    return Schedule(start, end, interval)
