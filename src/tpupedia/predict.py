"""Predicted step time on a TPU slice you do not have: the TPU compiler's own counts for what XLA
compiles, and a stated model for what it cannot see.

libtpu's compiled executables carry a cost analysis (`aot.compiled_cost`): per chip, the FLOPs
and HBM bytes of the program as partitioned and fused for the slice, and the compiler's own time
estimate (`optimal_seconds`). Checked on programs whose time is known (tests/test_predict.py,
notebook `plan_without_tpu`): for an elementwise op the estimate is the bytes over the chip's HBM
bandwidth exactly, for a bf16 matmul it sits between its FLOPs at the peak and FLOPs plus bytes.
But for a whole video-transformer layer it comes out **negative** (CogVideoX1.5-5B at 720p: about
-8 s for one layer compiled for a v6e-8, attention stood in, measured here), so the estimate is
not used; the counts are. And the counts miss two things:

* a **Pallas kernel** is a custom call the compiler cannot see into: a splash attention call
  counts as next to nothing;
* a **collective** counts as its HBM traffic, not its time on the ICI links: an all-reduce of
  64 MiB per chip over 4 chips comes out several times under what a ring along one torus axis
  needs.

So a step is predicted in three parts, each reported (`StepPrediction`):

1. `xla_s`: the step compiled with attention replaced by a stand-in of the same inputs and
   output (`tpupedia.dryrun`, `attention="standin"`), at 1 and at 2 layers; the difference is
   one layer, scaled to the full depth as the dry-run scales the weights. Its time is the
   compiler's FLOPs at the bf16 peak plus its bytes at the HBM bandwidth: a layer's work splits
   into matmuls bound by the MXU and elementwise fusions bound by HBM, and the sum adds the two
   kinds (a single fusion that is both is counted twice: an upper estimate);
2. `attention_s`: each attention call the stand-in recorded, as splash runs it: queries padded
   to the kernel's `block_q`, keys to `block_kv`, 4 FLOPs per query-key pair and head dimension,
   the head dimension padded to the MXU's width (`mxu_fill`: QK^T contracts over it and PV's
   output is that wide, so a 64-wide head fills a quarter of a v6e's 256 x 256 array), spread
   over the chips at the bf16 peak. That is the MXU's ceiling for the call's shape, a floor on
   the kernel's time (the softmax's exponentials on the vector unit are not counted). Until
   2026-12-02 the rate came from upstream's profile of one HunyuanVideo-1.5 block
   (`SPLASH_REPORT`): at the shape that report was taken to have, it implies 83% of the peak
   (`profile_rate`), more than the 50% a 128-wide head can keep a v6e MXU busy, so the report
   cannot be of that program (it names a script not in upstream's repository at that commit)
   and no longer sets the rate;
3. `ici_s`: the bytes each chip sends in the compiled program's collectives
   (`aot.collective_traffic`, full depth) at what a ring along one torus axis gets
   (`hardware.Chip.ring_bytes_per_s`), counted as not hidden behind compute: an upper estimate.

The prediction is their sum. It is a prediction wherever it appears, and the results page sets
it beside the four step times reported upstream on a v6e-8 (`REPORTED`). The same three parts
time every program `tpupedia plan` compiles (`Work`, `program_work`): the plan's step programs
record their splash calls as they are traced (`attention.recording`). Introduced in notebook
`plan_without_tpu`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any

from tpupedia import aot, attention, devices, dryrun, families, hardware, results
from tpupedia.errors import TpupediaError

__all__ = ["PredictError", "SPLASH_FAMILY", "SPLASH_REPORT", "mxu_fill", "splash_flops", "profile_rate", "REPORTED",
           "REPORTED_STAGES", "reported_stage", "Work", "program_work", "StepPrediction", "predict_step", "DEFAULT_RECORDS", "record"]

DEFAULT_RECORDS = "docs/results/predictions.json"


class PredictError(TpupediaError, ValueError):
    """A prediction that cannot be made (a model without attention layers to scale, a compile that failed)."""


def _profile() -> tuple[str, dict[str, Any]]:
    """The family whose module holds the splash profile (`SPLASH_PROFILE`), and the profile."""
    for spec in families.video():
        profile = getattr(spec.facts, "SPLASH_PROFILE", None)
        if profile is not None:
            return spec.name, profile
    raise PredictError("no family module holds a SPLASH_PROFILE for the kernel model")


SPLASH_FAMILY, SPLASH_REPORT = _profile()
"""Upstream's profile of one block's splash attention and the family it was taken on (the family
module says where it is from): kept as the check that retired it (`profile_rate`)."""


def mxu_fill(head_dim: int, chip: hardware.Chip) -> float:
    """The share of an MXU pass a splash call's matmuls fill: QK^T contracts over `head_dim` and
    PV's output is `head_dim` wide, so a head narrower than the chip's systolic array
    (`hardware.Chip.mxu_width`) leaves the rest of each pass idle: 64 of 256 on a v6e (a quarter),
    128 of 256 (a half), 128 of 128 on a v5e (all of it). 1 for a chip with no MXU figure."""
    width = chip.mxu_width
    return 1.0 if not width else head_dim / (math.ceil(head_dim / width) * width)


def splash_flops(call: list[int] | tuple[int, ...], block_sizes: tuple[int, int, int],
                 chip: hardware.Chip | None = None) -> float:
    """FLOPs a splash call computes: `[batch, heads, q, kv, head_dim]` with the queries padded to a
    multiple of `block_q` and the keys to one of `block_kv`, each capped to its own 128-padded
    length as `tpupedia.attention` caps them (QK^T and PV: 4 FLOPs per query, key and head
    dimension). With `chip`, the FLOPs its MXU passes take: the head dimension counted at the
    width it occupies (over `mxu_fill`)."""
    b, h, sq, skv, d = call
    bq, bkv, _ = attention.capped_block_sizes(block_sizes, sq, skv)
    flops = 4.0 * b * h * math.ceil(sq / bq) * bq * math.ceil(skv / bkv) * bkv * d
    return flops if chip is None else flops / mxu_fill(d, chip)


def profile_rate(report: dict[str, Any] = SPLASH_REPORT, family: str = SPLASH_FAMILY) -> float:
    """The share of the chips' bf16 peak the report's splash call would have run at, were it the
    shape `report["assumed"]` takes: its FLOPs over the padded blocks at the family's block sizes,
    over `chips x peak x seconds` (about 0.83 for upstream's HunyuanVideo-1.5 profile, against a
    ceiling of `mxu_fill(128, v6e)` = 0.5: the check that retired it as the kernel's rate)."""
    facts = families.get(family, "video").facts
    tokens = facts.video_tokens(report["width"], report["height"], report["frames"]) + report["text_tokens"]
    call = [report["batch"], report["heads"], tokens, tokens, report["head_dim"]]
    chip = hardware.chip(report["chip"])
    return splash_flops(call, tuple(facts.SPLASH_BLOCK_SIZES)) / (report["chips"] * chip.bf16_flops * report["seconds"])


@dataclass(frozen=True)
class Work:
    """What one call of a program does, in the units the prediction times: per chip, the compiled
    program's FLOPs and HBM bytes (`aot.compiled_cost`) and the bytes it sends in collectives
    (`aot.collective_traffic`); over all chips, the FLOPs of its splash calls' MXU passes
    (`splash_flops` for the chip: the blocks padded, the head at the MXU's width). Work adds,
    subtracts and scales, so a program compiled at `n` and `n + 1` layers gives its work at full
    depth (`deeper`)."""

    flops: float = 0.0
    bytes: float = 0.0
    ici_bytes: float = 0.0
    attention_flops: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __sub__(self, other: "Work") -> "Work":
        return self + -1 * other

    def __rmul__(self, k: float) -> "Work":
        return Work(*(k * a for a in astuple(self)))

    def deeper(self, next_layer: "Work", layers: int, compiled: int) -> "Work":
        """The work at `layers` layers, from this program's at `compiled` layers and `next_layer`,
        the same program's at `compiled + 1`: each layer past the first compiled ones adds the
        difference (the dry-run scales the weights by depth the same way)."""
        return self + max(layers - compiled, 0) * (next_layer - self)

    def times(self, chip: hardware.Chip, chips: int) -> tuple[float, float, float]:
        """`(xla, attention, ici)` seconds: the compiler's FLOPs (one device's) at one device's
        share of the chip's bf16 peak plus its bytes at its share of the HBM bandwidth; splash's
        MXU passes at the `chips`' peak (chips, not devices: a TPU7x chip's two devices share
        its peak); the collectives' bytes at a device's share of a one-axis ring's
        bandwidth, not overlapped (the module docstring). One device per chip (v5e, v6e): the
        chip's own figures."""
        return (self.flops / chip.device_bf16_flops + self.bytes / chip.device_hbm_bytes_per_s,
                self.attention_flops / (chips * chip.bf16_flops),
                self.ici_bytes / chip.device_ring_bytes_per_s)

    def seconds(self, chip: hardware.Chip, chips: int) -> float:
        """The predicted time of one call: the sum of `times`."""
        return sum(self.times(chip, chips))


def program_work(result: aot.AOTResult, devices: int, splash_calls: list[list[int]] = (),
                 chip: hardware.Chip | None = None) -> Work | None:
    """The `Work` of one call of a compiled program over `devices` devices (`None`: no cost
    analysis, a compile that did not fit or was not for a TPU). `splash_calls`: its splash calls
    as `attention.recording` records them, shapes then blocks; `chip`: the chip whose MXU they
    fill (`splash_flops`; `None` counts the useful FLOPs alone)."""
    cost = aot.compiled_cost(result)
    if cost is None:
        return None
    sent = sum(aot.collective_traffic(result.compiled.as_text(), devices).values())
    return Work(cost["flops"], cost["bytes"], sent, sum(splash_flops(c[:5], tuple(c[5:8]), chip) for c in splash_calls))


REPORTED = tuple(dict(model=spec.name, **r) for spec in families.video() for r in getattr(spec.facts, "REPORTED_STEPS", ()))
"""The step times reported upstream on a TPU v6e-8, from each family module's `REPORTED_STEPS`,
with the mesh and sharding table each run used, as this project's dry-run names them."""


@dataclass
class StepPrediction:
    """A predicted denoising step (seconds), its three parts, and what they came from."""

    model: str
    topology: str
    chips: int
    mesh: dict[str, int]
    sharding: str
    width: int
    height: int
    frames: int
    layers: int
    block_sizes: list[int]
    xla_s: float
    """The compiler's FLOPs and bytes, attention stood in, timed at the peak and the HBM bandwidth,
    scaled to `layers` (`xla_layer_s` per layer)."""
    xla_layer_s: float
    compiler_estimate_s: float
    """The compiler's own time estimate for the 1-layer program (`optimal_seconds`), kept to show
    why it is not used (negative for these programs)."""
    attention_s: float
    """Splash's MXU passes (`splash_flops` for the chip) at the bf16 peak: every call's padded
    blocks, the head at the MXU's width."""
    attention_flops: float
    splash_efficiency: float
    """The share of the bf16 peak splash runs at: the MXU's fill for the calls' head width
    (`mxu_fill`)."""
    ici_s: float
    """The collectives' bytes per chip at a one-axis ring's bandwidth, not overlapped."""
    ici_bytes: float
    step_s: float
    """The prediction: `xla_s + attention_s + ici_s`."""
    reported_step_s: float | None = None
    reported_source: str = ""
    notes: list[str] = field(default_factory=list)
    batch: int = 2
    """The step's batch: 2, the guidance pair; 1, guidance off."""
    steps: int | None = None
    """Steps in a video, where known: `video_s` is `steps` predicted steps."""

    @property
    def video_s(self) -> float | None:
        """The denoising of one video, predicted: `steps` steps."""
        return None if self.steps is None else self.steps * self.step_s

    @property
    def error(self) -> float | None:
        """`predicted / reported - 1` (positive: predicted slower)."""
        return None if not self.reported_step_s else self.step_s / self.reported_step_s - 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"error": self.error, "video_s": self.video_s}

    def summary(self) -> str:
        head = (f"{self.model} {self.width}x{self.height}, {self.frames} frames on {self.topology}, mesh {self.mesh}, "
                f"sharding {self.sharding}, splash blocks {'/'.join(map(str, self.block_sizes))}"
                + (", guidance off (batch 1)" if self.batch == 1 else ""))
        lines = [head, f"  predicted step: {self.step_s:.2f} s = XLA {self.xla_s:.2f} s (the compiler's counts, "
                       f"{self.layers} layers of {self.xla_layer_s * 1e3:.1f} ms) + splash {self.attention_s:.2f} s "
                       f"({self.attention_flops:.3g} FLOPs of MXU passes at the peak, {self.splash_efficiency:.0%} of them the "
                       f"head's) + ICI "
                       f"{self.ici_s:.2f} s ({self.ici_bytes / 2**30:.2f} GiB sent per chip, not overlapped)"]
        if self.steps:
            lines.append(f"  predicted denoising of a video: {self.steps} steps, {self.video_s:.1f} s")
        if self.reported_step_s:
            lines.append(f"  reported upstream: {self.reported_step_s:.2f} s/step; predicted {self.error:+.0%}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def predict_step(model: str, topology: str = "v6e:2x4", resolution: str | None = None, frames: int | None = None, *,
                 sharding: str = "tp", mesh_shape: tuple[int, int] | None = None,
                 block_sizes: tuple[int, int, int] | None = None, reported_step_s: float | None = None,
                 reported_source: str = "", batch: int = 2, steps: int | None = None) -> StepPrediction:
    """Predict one denoising step of video `model` on `topology` (the module docstring): two
    AOT compiles with attention stood in (1 and 2 layers, `tpupedia.dryrun`), the splash model
    for the attention calls they record at `block_sizes` (default the family's), the compiled
    collectives at ring bandwidth. `batch`: 2 for the guidance pair, 1 with guidance off (a
    few-step release); `steps`: how many a video takes, for `video_s`. Bad arguments raise
    `DryRunError` before anything compiles."""
    spec = families.get(model)
    if spec.kind != "video":
        raise PredictError(f"model {model!r}: a step time is predicted for the video families "
                           f"({', '.join(families.names('video'))})")
    reports = [dryrun.run(model, topology, resolution, frames, sharding=sharding, attention="standin", layers=n,
                          mesh_shape=mesh_shape, batch=batch) for n in (1, 2)]
    one, two = reports
    if one.compiled_cost is None or two.compiled_cost is None or not one.fits or not two.fits:
        raise PredictError(f"{model} on {topology}: the step with attention stood in did not compile to a program "
                           "the compiler costed (" + "; ".join(r.summary().splitlines()[1] for r in reports) + ")")
    topo = hardware.parse_topology(topology)
    chip, n_chips = topo.chip, topo.num_chips
    blocks = tuple(block_sizes or attention.chip_block_sizes(devices.tpu_topology(topo)[0], spec.facts.SPLASH_BLOCK_SIZES))

    def work(report) -> Work:  # the dry-run scaled its traffic to full depth as if every byte were per layer
        sent = sum(report.collective_bytes.values()) * report.layers_compiled / report.layers_full
        attend = sum(splash_flops(c, blocks, chip) for c in report.attention_calls)
        return Work(report.compiled_cost["flops"], report.compiled_cost["bytes"], sent, attend)

    if not Counter(map(tuple, two.attention_calls)) - Counter(map(tuple, one.attention_calls)):
        raise PredictError(f"{model}: a second layer made no attention call to scale")
    shallow, deeper = work(one), work(two)
    full = shallow.deeper(deeper, one.layers_full, 1)
    xla, attention_s, ici = full.times(chip, n_chips)
    layer = (deeper - shallow).times(chip, n_chips)[0]
    head_dims = {c[4] for c in one.attention_calls}
    efficiency = min(mxu_fill(d, chip) for d in head_dims)
    notes = [f"splash at the MXU's ceiling for {'/'.join(map(str, sorted(head_dims)))}-wide heads on {chip.name} "
             f"({efficiency:.0%} of the bf16 peak): a floor on the kernel's time, the softmax's exponentials not counted"]
    return StepPrediction(
        model=model, topology=topo.name, chips=n_chips, mesh=one.mesh, sharding=sharding, width=one.width,
        height=one.height, frames=one.frames, layers=one.layers_full, block_sizes=list(blocks), xla_s=xla,
        xla_layer_s=layer, compiler_estimate_s=one.compiled_cost["seconds"], attention_s=attention_s,
        attention_flops=full.attention_flops, splash_efficiency=efficiency, ici_s=ici, ici_bytes=full.ici_bytes,
        step_s=xla + attention_s + ici, reported_step_s=reported_step_s, reported_source=reported_source,
        notes=notes, batch=batch, steps=steps)


REPORTED_STAGES = tuple(dict(model=spec.name, **r) for spec in families.video()
                        for r in getattr(spec.facts, "REPORTED_STAGES", ()))
"""Stage run and compile times reported upstream on a TPU v6e-8 (mesh dp=2, tp=4), from each
family module's `REPORTED_STAGES`: what `tpupedia plan` sets its predicted stage times against."""


def reported_stage(model: str, stage: str, what: str, resolution: str, frames: int) -> dict[str, Any] | None:
    """The upstream report (`REPORTED_STAGES`) of `stage`'s `what` (`run` or `compile`) for
    `model` at `resolution` (`WIDTHxHEIGHT`) and `frames`, if any."""
    return next((r for r in REPORTED_STAGES if (r["model"], r["stage"], r["what"], r["resolution"], r["frames"])
                 == (model, stage, what, resolution, frames)), None)


def reported(model: str, resolution: str) -> dict[str, Any] | None:
    """The upstream report (`REPORTED`) for `model` at `resolution` (`WIDTHxHEIGHT`), if any."""
    return next((r for r in REPORTED if r["model"] == model and r["resolution"] == resolution), None)


def record(prediction: StepPrediction, path: str | Path = DEFAULT_RECORDS, command: str = "") -> Any:
    """Merge `prediction` into the results file the results page renders."""
    import datetime as _dt

    from tpupedia import devices

    data = prediction.as_dict() | {"predicted_at": _dt.date.today().isoformat(), "command": command,
                                   "libtpu": results.version("libtpu") if devices.has_libtpu() else None}

    def key(r):
        return (r["model"], r["topology"], r["width"], r["height"], r["frames"], r["sharding"],
                tuple(sorted(r["mesh"].items())), tuple(r["block_sizes"]), r.get("batch", 2))

    return results.merge(data, Path(path), key=key)
