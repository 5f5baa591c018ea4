"""Tune a run before renting it: the settings a user controls, ranked by predicted time, and the
cheapest slice that meets a deadline.

`tpupedia plan` compiles a run's programs for a slice and predicts each one's time
(`tpupedia.plan`, `tpupedia.predict`). `search` does that for every combination of the settings a
user changes on the command line without changing the video (the `(dp, tp)` mesh, the sharding
table, the splash block sizes, and VAE tiling when the decode is planned) and ranks those that
fit by predicted time. Step caches are not ranked with them: they trade quality for time, which a
ranking by time cannot weigh; `with_step_cache` predicts the best setting with one, to set beside
it (`tpupedia plan --search` prints both). `cheapest` runs the
plan on each single-host slice (`SLICES`) and prices one video at the listed prices
(`hardware.PRICES`): the predicted stage times plus the compile time spread over the videos one
process makes, times the chips, times the price per chip-hour.

Everything here is a prediction (`tpupedia.predict` states its model and checks it against the
step times reported upstream); the compile time is this host's, scaled to full depth. Introduced
in notebook `plan_without_tpu`.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from tpupedia import hardware, plan
from tpupedia.errors import TpupediaError

__all__ = ["Candidate", "settings_grid", "search", "with_step_cache", "STEP_CACHE", "with_quantized", "QUANTIZE", "command_line", "SLICES",
           "SliceCost", "cheapest", "UNLISTED_SLICES", "priced_slices", "parse_prices", "SYMPTOMS", "Symptom", "stage_parts", "diagnose"]

SLICES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v6e:1x1", "v6e:2x2", "v6e:2x4")
"""The single-host slices `cheapest` prices at listed prices (one TPU VM: no multi-host launch needed)."""

UNLISTED_SLICES = {"tpu7x": ("tpu7x:2x2x1",)}
"""Single-host slices of chips with no public list price (`hardware.PRICES`): `cheapest` prices
them only at a price the user gives (`prices`, `tpupedia plan --cheapest --price tpu7x=DOLLARS`).
TPU7x is rented through GKE and a sales contact; Google lists no hourly price for it."""


def priced_slices(prices: dict[str, float] | None = None) -> tuple[str, ...]:
    """The slices `cheapest` prices: `SLICES`, and the `UNLISTED_SLICES` of each chip `prices` names."""
    return SLICES + tuple(t for chip, slices in UNLISTED_SLICES.items() if chip in (prices or {}) for t in slices)


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """`["tpu7x=8.5", "v6e=2.1"]` (`--price CHIP=DOLLARS`, dollars per chip-hour) as a dict; a bad
    item gets an error naming it and what is allowed, before anything compiles."""
    prices = {}
    for item in items:
        name, _, dollars = item.partition("=")
        try:
            chip, value = hardware.chip(name).name, float(dollars)
        except (hardware.HardwareError, ValueError):
            chip, value = None, float("nan")
        if chip is None or not value > 0 or chip not in {t.split(":")[0] for t in SLICES} | set(UNLISTED_SLICES):
            raise plan.PlanError(f"--price {item!r}: give CHIP=DOLLARS per chip-hour, a positive price for one of "
                            f"{', '.join(sorted({t.split(':')[0] for t in SLICES} | set(UNLISTED_SLICES)))}")
        prices[chip] = value
    return prices


@dataclass
class Candidate:
    """One setting of the searched options, and its plan (or why there is none)."""

    settings: dict[str, Any]
    """`mesh` `(dp, tp)`, `sharding`, `block_sizes` (`None`: the family's); with a decode,
    `vae_tiling` (`on` or `off`); from `with_step_cache`, `step_cache` (its command-line value)."""
    plan: plan.Plan | None = None
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits

    @property
    def predicted_s(self) -> float | None:
        return None if self.plan is None else self.plan.predicted_s

    @property
    def why_not(self) -> str:
        """Why it does not fit, in one line (the error, or the plan's advice); `""` when it fits."""
        if self.fits:
            return ""
        return self.error or f"does not fit: {self.plan.advice()}"


def settings_grid(family_blocks: Sequence[int], chips: int, guidance_batch: int, splash: bool,
                  tiling: bool = False) -> list[dict[str, Any]]:
    """The combinations `search` tries on `chips` chips: each `(dp, tp)` mesh whose `dp` divides
    the step's batch (`guidance_batch`: 2 with guidance, 1 without) and the chips; the `tp` and
    `fsdp` sharding tables; with splash, the family's block sizes and 1024/1024/512; with
    `tiling` (a plan with the decode), the VAE untiled and tiled."""
    meshes = [(dp, chips // dp) for dp in (1, 2) if dp <= guidance_batch and chips % dp == 0]
    blocks = [tuple(family_blocks), (1024, 1024, 512)] if splash else [None]
    blocks = list(dict.fromkeys(blocks))
    grid = [{"mesh": m, "sharding": s, "block_sizes": b} for m, s, b in itertools.product(meshes, ("tp", "fsdp"), blocks)]
    return [g | {"vae_tiling": t} for g in grid for t in ("off", "on")] if tiling else grid


def _options(options: Any, settings: dict[str, Any]) -> Any:
    return dataclasses.replace(options, **{k: settings[k] for k in ("mesh", "sharding", "block_sizes") if k in settings})


def _planned(family: str, request: Any, options: Any, settings: dict[str, Any], topology: str,
             **make: Any) -> Candidate:
    """`request` planned on `topology` with `settings` over `options` (none: `options` as given),
    their VAE tiling over `make`'s; a plan that cannot be made is kept with its error, not raised
    (a mesh or table this model cannot take is a candidate that lost, not a failure)."""
    options = _options(options, settings)
    if "vae_tiling" in settings:
        make = make | {"vae_tiling": settings["vae_tiling"]}
    try:
        return Candidate(settings, plan.make(family, request, options, topology=topology, **make))
    except TpupediaError as err:
        return Candidate(settings, error=str(err).splitlines()[0])


def search(family: str, request: Any, options: Any, *, topology: str = "v6e:2x4", grid: list[dict] | None = None,
           **make: Any) -> list[Candidate]:
    """Plan `request` on `topology` at every setting of `grid` (default `settings_grid`) and return
    the candidates, those that fit first, fastest predicted first, then those that do not fit
    (with the plan's advice) or could not be planned (with the error). `make`: the rest of
    `plan.make`'s arguments (`model`, `configs`, `layers`, `stages`, `dtype`)."""
    from tpupedia import attention, families

    if grid is None:
        spec = families.get(family, "video")
        chips = hardware.parse_topology(topology).num_devices  # the meshes span devices (2 per TPU7x chip)
        pipe = plan._pipeline_module(family).PIPELINE
        configs = make.get("configs") or pipe.plan_configs(request, make.get("model") or pipe.release_id(request))
        splash = attention.resolve_backend(options.attention, "tpu") == "splash"  # a slice's chips are TPUs
        tiling = "decode" in make.get("stages", plan.STAGES) and make.get("vae_tiling", "auto") == "auto"
        grid = settings_grid(spec.facts.SPLASH_BLOCK_SIZES, chips, pipe.guidance_batch(request, configs), splash,
                             tiling)
    found = [_planned(family, request, options, settings, topology, **make) for settings in grid]
    return sorted(found, key=lambda c: (not c.fits, c.predicted_s if c.predicted_s is not None else float("inf")))


STEP_CACHE = "deepcache:11:45:4"
"""The step cache `with_step_cache` predicts by default: DeepCache at upstream's HunyuanVideo-1.5
schedule (`pipelines.stepcache.UPSTREAM_DEFAULT`), a static schedule a plan can compile as it
runs, for any family."""


def with_step_cache(family: str, request: Any, options: Any, settings: dict[str, Any], *, topology: str = "v6e:2x4",
                    cache: str = STEP_CACHE, **make: Any) -> Candidate:
    """`settings` planned again with the step cache `cache` (`--step-cache` form) on: the time it
    would save, to set beside a ranking that keeps the video as it is. A cache that decides at
    run time (a threshold) has no schedule to plan: give its replay form (`METHOD:full=...`).
    A shallow plan (`layers`) compiles at least one block more than the cache keeps (its `tail`),
    so that the cached step has blocks to skip; scaling to full depth then leaves the cached
    step's work as it is, since a layer more is a block it skips."""
    from tpupedia.pipelines import stepcache

    step_cache = stepcache.parse_step_cache(cache)
    if make.get("layers") is not None:  # a cached step keeps some blocks and skips others: compile enough of them
        make = make | {"layers": max(make["layers"], getattr(step_cache, "tail", 1) + 1)}
    return _planned(family, dataclasses.replace(request, step_cache=step_cache), options,
                    settings | {"step_cache": cache}, topology, **make)


QUANTIZE = "int8"
"""The weight format `with_quantized` plans by default: weight-only int8 (`tpupedia.quantize`),
half the bytes of bf16 weights on every chip, the FLOPs unchanged."""


def with_quantized(family: str, request: Any, options: Any, settings: dict[str, Any], *, topology: str = "v6e:2x4",
                   fmt: str = QUANTIZE, **make: Any) -> Candidate:
    """`settings` planned again with the transformers' weights in `fmt` (`--quantize`): what a
    smaller weight format buys on `topology`, set beside a ranking that keeps the frames as they
    are (a quantized run changes them, within the bound notebook `fewer_steps` measures), as a step
    cache is (`with_step_cache`). Weight-only: the plan's bytes halve, its FLOPs do not, so the
    predicted time barely moves; what changes is what fits."""
    return _planned(family, dataclasses.replace(request, quantize=fmt), options, settings | {"quantize": fmt},
                    topology, **make)


def command_line(family: str, settings: dict[str, Any], extra: str = "") -> str:
    """The `tpupedia generate` flags that run with `settings` (those it does not name: the defaults)."""
    blocks = settings.get("block_sizes")
    return (f"tpupedia generate {family} --preset full"
            + (" --mesh dp={},tp={}".format(*settings["mesh"]) if settings.get("mesh") else "")
            + (f" --sharding {settings['sharding']}" if settings.get("sharding") else "")
            + (f" --block-sizes {','.join(map(str, blocks))}" if blocks else "")
            + (f" --vae-tiling {settings['vae_tiling']}" if settings.get("vae_tiling") else "")
            + (f" --step-cache {settings['step_cache']}" if settings.get("step_cache") else "")
            + (f" --quantize {settings['quantize']}" if settings.get("quantize") else "")
            + (f" {extra}" if extra else ""))


@dataclass
class SliceCost:
    """One slice priced for one video: the predicted times, and dollars at the listed price."""

    topology: str
    chips: int
    price_per_chip_hour: float
    video_s: float | None
    """The planned stages of one video, predicted (`Plan.predicted_s`)."""
    compile_s: float | None
    """The programs' compile time, at this host's speed, spread over `videos` below."""
    videos: int
    fits: bool
    note: str = ""
    """Why the slice cannot run it (`Candidate.why_not`); `""` when it fits."""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_video(self) -> float | None:
        """What one video holds the slice for: its run plus its share of the compiles."""
        if self.video_s is None or self.compile_s is None:
            return None
        return self.video_s + self.compile_s / self.videos

    @property
    def dollars_per_video(self) -> float | None:
        s = self.seconds_per_video
        return None if s is None else self.chips * self.price_per_chip_hour * s / 3600


def cheapest(family: str, request: Any, options: Any, *, slices: Sequence[str] | None = None, videos: int = 1,
             deadline: float | None = None, kind: str = "on_demand", searched: bool = False,
             prices: dict[str, float] | None = None, grid: list[dict] | None = None, quantize: str | None = None,
             **make: Any) -> list[SliceCost]:
    """Price one video of `request` on each of `slices` and return them cheapest first, those that
    fit and meet `deadline` (seconds per video, predicted, compiles excluded) ahead of the rest.
    Per slice: the plan at `options` (or, with `searched`, the fastest setting `search` finds),
    `videos` videos sharing one process's compiles, at `prices` (chip name to dollars per
    chip-hour) or the listed `kind` price (`hardware.price`); `slices` defaults to `priced_slices`
    (TPU7x only with a price given); `grid`: what `search` tries (default `settings_grid` for each
    slice). With `quantize` (a format of `tpupedia.quantize`), a slice the request does not fit is
    planned again with its transformers in that format (`with_quantized`), and priced so where that
    fits: quantizing changes the frames, so it is the fix for a slice too small, never a setting
    that wins on a slice where the checkpoint's own weights fit."""
    if not isinstance(videos, int) or isinstance(videos, bool) or videos < 1:
        raise plan.PlanError(f"videos={videos!r}: a positive number of videos sharing one process's compiles")
    if deadline is not None and not deadline > 0:
        raise plan.PlanError(f"deadline={deadline!r}: a positive number of seconds per video")
    priced = []
    for topology in priced_slices(prices) if slices is None else slices:
        topo = hardware.parse_topology(topology)
        dollars = (prices or {}).get(topo.chip.name)
        dollars = hardware.price(topo.chip.name, kind) if dollars is None else dollars
        best = (search(family, request, options, topology=topology, grid=grid, **make)[0] if searched
                else _planned(family, request, options, {}, topology, **make))
        if not best.fits and quantize is not None and getattr(request, "quantize", None) is None:
            smaller = with_quantized(family, request, options, best.settings, topology=topology, fmt=quantize, **make)
            best = smaller if smaller.fits else best
        priced.append(SliceCost(topology, topo.num_chips, dollars, best.predicted_s if best.fits else None,
                                best.plan.predicted_compile_s if best.fits else None, videos, best.fits,
                                best.why_not, best.settings))

    def rank(c: SliceCost):
        meets = c.fits and c.video_s is not None and (deadline is None or c.video_s <= deadline)
        return (not meets, c.dollars_per_video if c.dollars_per_video is not None else float("inf"))

    return sorted(priced, key=rank)


SYMPTOMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "communication": ("the collectives, at a ring's bandwidth, are the largest part of the denoising time",
                      ("--mesh dp=2,tp=N/2: the guidance pair on dp, whose halves never talk",
                       "--sharding fsdp: gather each layer's weights instead of reducing its activations",
                       "fewer chips (plan --cheapest): less tp, fewer and larger per-chip pieces")),
    "attention": ("splash attention is the largest part of the denoising time",
                  ("--block-sizes Q,KV,KV_COMPUTE (plan --search tries them)",
                   "--step-cache or a few-step --release: fewer or cheaper steps (notebook fewer_steps)",
                   "fewer --frames or a smaller frame: attention grows with the tokens squared")),
    "compute": ("the compiler's FLOPs and bytes (everything but attention and collectives) are the largest part",
                ("more chips (plan --cheapest weighs the price)",
                 "--step-cache or a few-step --release: fewer or cheaper steps")),
    "memory": ("a stage's peak is within 10% of the chip's HBM",
               ("--sharding fsdp: each chip keeps a slice of every weight",
                "--vae-tiling on, for a decode or image stage", "more chips")),
    "compile": ("compiling takes longer than the video itself",
                ("a batch: --prompts FILE makes many videos in one process, compiled once",
                 "the persistent compilation cache (notebook profiling): a second process loads, not compiles",
                 "fewer distinct programs: an untiled decode is one shape, a tiled one several")),
}
"""From a symptom in a plan to the settings that move it: `diagnose` names the symptoms, each
with the evidence, and these are what to try, in order."""


@dataclass
class Symptom:
    """One symptom `diagnose` found: its name (a key of `SYMPTOMS`), the evidence, what to try."""

    name: str
    evidence: str
    settings: tuple[str, ...]


def stage_parts(found: plan.Plan, stage: str = "denoise") -> dict[str, float]:
    """The predicted seconds of `stage` in one video, in the prediction's three parts (`xla`,
    `attention`, `ici`; `tpupedia.predict.Work.times`), each program's times its calls."""
    from tpupedia import predict

    chip = hardware.parse_topology(found.topology).chip
    total = dict.fromkeys(("xla", "attention", "ici"), 0.0)
    for p in found.stage(stage).programs:
        if p.work is None:
            raise plan.PlanError(f"stage {stage}: program {p.name!r} has no predicted time (plan for a TPU slice)")
        for key, seconds in zip(total, predict.Work(**p.work).times(chip, found.chips)):
            total[key] += p.calls * seconds
    return total


def diagnose(found: plan.Plan) -> list[Symptom]:
    """The symptoms of a plan with predicted times, worst first: which part dominates the
    denoising (`communication`, `attention` or `compute`, by `stage_parts`), whether a stage is
    near the chip's memory (`memory`), whether compiling outlasts the video (`compile`)."""
    found_parts = stage_parts(found)
    name = {"xla": "compute", "attention": "attention", "ici": "communication"}[max(found_parts, key=found_parts.get)]
    total = sum(found_parts.values())
    share = ", ".join(f"{k} {v:.3g} s ({v / total:.0%})" for k, v in found_parts.items())
    out = [Symptom(name, f"denoising, predicted: {share}", SYMPTOMS[name][1])]
    for s in found.stages:
        if s.peak is not None and s.peak > 0.9 * found.hbm:
            out.append(Symptom("memory", f"stage {s.stage} peaks at {s.peak / 2**30:.2f} of {found.hbm / 2**30:.2f} GiB",
                               SYMPTOMS["memory"][1]))
    if found.predicted_compile_s is not None and found.predicted_s and found.predicted_compile_s > found.predicted_s:
        out.append(Symptom("compile", f"compiles {found.predicted_compile_s:.0f} s against a video of "
                                      f"{found.predicted_s:.0f} s, both predicted", SYMPTOMS["compile"][1]))
    return out
