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

DeepCache is one of the step caches of `tpupedia.pipelines.stepcache`, which holds the schedule
and serves every family (`--step-cache deepcache:START:END:INTERVAL`, and First-Block-Cache and
MagCache); this module keeps DeepCache's names (`--deepcache`, `tpupedia bench deepcache`).

Quality and time are measured, not assumed: `tpupedia.metrics.compare` gives PSNR and SSIM of a
cached video against the uncached one; `tpupedia bench deepcache` records both with the time per
step.
Introduced in notebook `hunyuan_tuning_and_i2v`.
"""

from __future__ import annotations

from tpupedia.pipelines.stepcache import UPSTREAM_DEFAULT, DeepCacheError, Schedule, parse

__all__ = ["DeepCacheError", "Schedule", "UPSTREAM_DEFAULT", "parse"]
