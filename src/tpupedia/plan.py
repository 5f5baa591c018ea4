"""`tpupedia plan`: every program a run will execute, compiled for the target TPU before it runs.

A video run is not one program. The text stage runs each text encoder at its token length, the
denoise stage one step program (two with DeepCache) many times, the decode stage one program per
distinct VAE call shape (first frame batch, later ones, tiles). A run fails at the first of them
that does not fit its chip, possibly an hour in. The plan asks the pipeline itself for those
programs (`StagedPipeline._text_programs`, `_denoise_programs`, `_decode_programs`: the same code
the stages run), with the models built on PyTorch's `meta` device from the checkpoint's configs and
their weights as abstract arguments sharded as a run places them, and compiles each one ahead of
time for the slice (`tpupedia.aot`, `tpupedia.devices.topology_mesh`). Per stage it reports the
per-chip weights, the worst program's temporaries and outputs, what stays resident from other
stages, and the peak; it names the binding stage, and when something does not fit, the option that
would fix it.

Each stage frees its models when it ends (`StagedPipeline.release`), so a one-shot run has
nothing resident but the tensors handed between stages, which are program arguments. A batch
(`resident=True`, `tpupedia batch`) keeps every stage's models: each stage then also holds the
others' weights.

`layers=N` builds transformers and text encoders N layers deep (a cheap compile); the missing
layers' weight shards are added from their shapes, temporaries are taken as compiled (see
`tpupedia.dryrun` for what that can miss). Introduced in notebook `plan_without_tpu` (plan a TPU run without a TPU).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from tpupedia import aot, devices, hardware
from tpupedia.errors import TpupediaError

__all__ = ["PlanError", "recorded_run", "ProgramCost", "StageCost", "Plan", "make", "programs", "preflight", "gpu_attention", "SCORE_BYTES",
           "TILING", "record",
           "DEFAULT_RECORDS", "PREFLIGHT_LAYERS", "memory_budget"]

TILING = ("auto", "on", "off")
STAGES = ("text", "image", "denoise", "decode")  # `image`: image-to-video requests only
DEFAULT_RECORDS = "docs/results/plans.json"
PREFLIGHT_LAYERS = 1
"""Layers per model `preflight` compiles: the weights of all layers are counted, temporaries are a
one-layer model's (a layer's activations are freed before the next one's)."""
_GIB = 2**30


class PlanError(TpupediaError, ValueError):
    """A plan that cannot be made (bad family, topology, mesh or request), or, from `Plan.check`,
    a run that will not fit: the stage and the option that would fix it."""


@dataclass
class ProgramCost:
    """One compiled program: per-chip bytes as the compiler reports them (or its OOM figures)."""

    stage: str
    name: str
    calls: int
    fits: bool
    weights: float
    """Bytes per chip of model weights among the arguments, the missing layers' included."""
    arguments: float | None
    temporaries: float | None
    outputs: float | None
    aliased: float | None
    oom_required: float | None = None
    compile_seconds: float = 0.0
    """The compiler's time for the program as compiled (`aot.AOTResult.compile_seconds`: on the
    host that first compiled it, read back with a kept compile)."""
    component: str = ""
    """The checkpoint component whose weights these are: programs of one component share them."""
    vmem_required: float | None = None
    """A Pallas kernel's scoped VMEM the compiler asked for where it refused the program: the
    kernel's tiles, not the chip's HBM, were too large (`aot.AOTResult.vmem_required_bytes`)."""
    vmem_limit: float | None = None
    """The scoped VMEM the chip's compiler allows a kernel, from the same refusal."""
    work: dict[str, float] | None = None
    """One call's `tpupedia.predict.Work` at full depth (FLOPs, HBM and ICI bytes per chip, splash
    FLOPs over all chips); `None` where nothing is predicted (CPU devices, a program that did not fit)."""
    predicted_s: float | None = None
    """One call's time on the plan's chips, predicted from `work` (`Work.seconds`)."""
    predicted_compile_s: float | None = None
    """The compile time expected at full depth on the planning host: `compile_seconds`, plus each
    missing layer at what one more layer cost the compiler (a prediction, labelled so)."""

    @property
    def peak(self) -> float | None:
        """Arguments + outputs + temporaries - donated buffers, per chip (None: did not compile)."""
        if self.arguments is None:
            return None
        return self.arguments + self.outputs + self.temporaries - self.aliased


@dataclass
class StageCost:
    """One stage: its programs and its per-chip peak with what other stages leave resident."""

    stage: str
    programs: list[ProgramCost]
    resident: float
    """Bytes per chip other stages keep while this one runs (their models, in a batch)."""

    @property
    def weights(self) -> float:
        """The stage's weights per chip: each component's once (a VAE's decode programs share its weights)."""
        return sum({p.component or p.name: p.weights for p in self.programs}.values())

    @property
    def peak(self) -> float | None:
        """The worst program's arguments, temporaries and outputs, plus the weights of the stage's
        other components (they stay loaded while it runs: Wan 2.2's second expert, a second text
        encoder), plus what other stages keep resident."""
        if any(p.peak is None for p in self.programs):
            return None
        weights = {p.component or p.name: p.weights for p in self.programs}
        others = [sum(w for c, w in weights.items() if c != (p.component or p.name)) for p in self.programs]
        return max(p.peak + other for p, other in zip(self.programs, others)) + self.resident

    def fits(self, hbm: float) -> bool:
        """Every program compiled and fits, and the peak with what stays resident is within `hbm`."""
        return all(p.fits for p in self.programs) and self.peak is not None and self.peak <= hbm

    @property
    def predicted_s(self) -> float | None:
        """The stage's predicted time in one video: each program's predicted call times its calls."""
        if not self.programs or any(p.predicted_s is None for p in self.programs):
            return None
        return sum(p.calls * p.predicted_s for p in self.programs)

    @property
    def predicted_compile_s(self) -> float | None:
        """The stage's programs' expected compile time at full depth, on the planning host."""
        if not self.programs or any(p.predicted_compile_s is None for p in self.programs):
            return None
        return sum(p.predicted_compile_s for p in self.programs)


@dataclass
class Plan:
    """What `make` found: per stage, per chip, against the chip's HBM."""

    family: str
    checkpoint: str | None
    """The hub id or folder whose configs were planned (`None`: configs handed to `make`)."""
    topology: str
    chips: int
    mesh: dict[str, int]
    request: dict[str, Any]
    layers: int | None
    resident: bool
    hbm: float
    stages: list[StageCost]
    vae_tiling: bool
    notes: list[str] = field(default_factory=list)
    attention: str = ""
    """The denoise stage's attention: `splash Q/KV/KV_COMPUTE` (its block sizes) or `reference`."""
    memory: str = "HBM per chip"
    """What `hbm` is: a TPU chip's HBM, or (a run on CPU devices) each device's share of the host
    memory available when the plan was made (`memory_budget`)."""
    host_copy: float = 0.0
    """Bytes a run on CPU devices holds on the host besides its devices' share (`memory_budget`)."""
    fuse_host: float = 0.0
    """Host bytes fusing the request's LoRA adapters needs, for the transformer that needs most
    (`tpupedia.lora.fuse_bytes`, an estimate); 0 without adapters."""
    devices: int | None = None
    """Devices the mesh spans where they are not the chips (`None`): two per TPU7x chip, whose
    `hbm` is then one device's budget (`memory` "HBM per device")."""

    def stage(self, name: str) -> StageCost:
        return next(s for s in self.stages if s.stage == name)

    @property
    def predicted_s(self) -> float | None:
        """One video's predicted time on the chips: the planned stages' sum (compiles and loading
        not included; `None` where a stage has no prediction)."""
        times = [s.predicted_s for s in self.stages]
        return None if not times or None in times else sum(times)

    @property
    def predicted_compile_s(self) -> float | None:
        """The compile time the planned stages' programs are expected to take, on the planning host."""
        times = [s.predicted_compile_s for s in self.stages]
        return None if not times or None in times else sum(times)

    def reported(self, stage: str, what: str = "run") -> dict[str, Any] | None:
        """What upstream reported for `stage` of this video on the same slice and mesh, if it did
        (a denoise run: `tpupedia.predict.REPORTED`'s step time times the plan's steps where there
        is one; otherwise `REPORTED_STAGES`), as a dict with `seconds` and `source`: what a
        predicted stage time is checked against."""
        from tpupedia import predict

        r = self.request
        resolution = f"{r['width']}x{r['height']}"
        if self.topology != "v6e:2x4" or r.get("image") or r.get("step_cache"):  # not the run upstream timed
            return None
        step = predict.reported(self.family, resolution) if stage == "denoise" and what == "run" else None
        if step and step["frames"] == r["frames"] and dict(zip(("dp", "tp"), step["mesh"])) == self.mesh:
            return {"seconds": step["step_s"] * r["steps"], "source": step["source"]}
        found = predict.reported_stage(self.family, stage, what, resolution, r["frames"])
        return found if found and self.mesh == {"dp": 2, "tp": 4} else None

    @property
    def fits(self) -> bool:
        return all(s.fits(self.hbm) for s in self.stages)

    @property
    def binding(self) -> str:
        """The stage with the highest peak (a stage that did not compile binds first)."""
        return max(self.stages, key=lambda s: math.inf if s.peak is None else s.peak).stage

    def advice(self) -> str:
        """What to change when the plan does not fit: the first stage over, and the option that fixes it."""
        for s in self.stages:
            if s.fits(self.hbm):
                continue
            vmem = next((p for p in s.programs if p.vmem_required), None)
            if vmem is not None:  # the kernel's tiles, not the chip's memory: smaller splash blocks
                kib = 1024 * math.ceil(vmem.vmem_required / 2**20)
                return (f"stage {s.stage}: a splash kernel's blocks need {vmem.vmem_required / 2**20:.2f} MiB of "
                        f"scoped VMEM, this chip's compiler allows {vmem.vmem_limit / 2**20:.2f} MiB: leave "
                        f"--block-sizes out (the family's blocks are stepped down to fit this chip), pass smaller "
                        f"ones such as 1024,1024,512, or raise the limit with LIBTPU_INIT_ARGS="
                        f"--xla_tpu_scoped_vmem_limit_kib={kib} (the attention is {self.attention})")
            need = "did not compile" if s.peak is None else f"needs {s.peak / _GIB:.2f} GiB"
            head = f"stage {s.stage} {need} per {self.unit} of {self.hbm / _GIB:.2f} GiB ({self.memory})"
            if s.weights > self.hbm:  # no frame size, tiling or kernel helps: the weights must be split
                head += f", of which its weights alone are {s.weights / _GIB:.2f} GiB"
                fix = (f"more chips: one {self.unit} cannot hold them (a slice splits them over tp)" if self.chips == 1
                       else "splitting them over more chips (a larger tp, or --sharding fsdp)")
            else:
                if s.weights and s.peak:
                    head += (f", {s.weights / _GIB:.2f} GiB of it weights, which leave "
                             f"{(self.hbm - s.weights) / _GIB:.2f} GiB for the rest")
                smaller = "a smaller frame (generate: --width/--height; plan: --resolution)"
                vae = smaller if self.vae_tiling else f"--vae-tiling on, or {smaller}"
                splash = "" if self.attention.startswith("splash") else "--attention splash, "
                fsdp = "--sharding fsdp, " if self.chips > 1 else ""
                fix = {"text": "--sharding tp (text encoders split over tp) or a mesh with a larger tp",
                       "denoise": f"{splash}{fsdp}fewer frames or {smaller}, or more chips",
                       "image": vae, "decode": vae}[s.stage]
            if s.stage == "denoise" and not self.request.get("quantize"):
                fix += "; or --quantize int8 (the transformers' linears at a byte a weight: notebook fewer_steps)"
            if self.resident:
                fix += "; or generate one video at a time (a batch keeps every stage's models)"
            if self.on_host and self.chips > 1:
                fix += ("; or fewer simulated CPU devices (--devices 1: they share this host's memory, and each "
                        "holds its own copy of every replicated weight)")
            return f"{head}: try {fix}"
        return ""

    @property
    def on_host(self) -> bool:
        """Whether the plan is for CPU devices, which share the host's memory."""
        return not self.memory.startswith("HBM per ")

    @property
    def unit(self) -> str:
        """What the plan's figures are per: `chip`, or `device` for CPU devices and for a chip of
        two devices (TPU7x)."""
        return "chip" if self.memory == "HBM per chip" else "device"

    def check(self) -> None:
        """Raise `PlanError` naming the stage and the fix unless every stage fits."""
        if not self.fits:
            raise PlanError(f"{self.family} on {self.topology} will not fit: {self.advice()}")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for s, d in zip(self.stages, out["stages"]):
            d |= {"weights": s.weights, "peak": s.peak, "predicted_s": s.predicted_s,
                  "predicted_compile_s": s.predicted_compile_s, "reported": self.reported(s.stage),
                  "reported_compile": self.reported(s.stage, "compile")}
            for p, pd in zip(s.programs, d["programs"]):
                pd["peak"] = p.peak
        return out | {"fits": self.fits, "binding": self.binding, "advice": self.advice(),
                      "predicted_s": self.predicted_s, "predicted_compile_s": self.predicted_compile_s}

    def summary(self) -> str:
        g = _GIB
        r = self.request
        checkpoint = f" ({self.checkpoint})" if self.checkpoint else ""
        unit = self.unit
        head = (f"{self.family}{checkpoint} {r['width']}x{r['height']}, {r['frames']} frames, {r['steps']} steps on "
                + (f"{self.topology} ({self.chips} chip{'s' if self.chips > 1 else ''}, {self.devices} devices)"
                   if self.devices else f"{self.topology} ({self.chips} {unit}{'s' if self.chips > 1 else ''})")
                + f", mesh {self.mesh}"
                + (f", attention {self.attention}" if self.attention else "")
                + (f", {self.layers} layers compiled" if self.layers else "")
                + (", batch (models resident)" if self.resident else "")
                + (f", VAE tiling {'on' if self.vae_tiling else 'off'}" if any(s.stage == "decode" for s in self.stages)
                   else "")
                + (f", VAE in {r['vae_dtype']}" if r.get("vae_dtype") else "")
                + (f", step cache {r['step_cache']}" if r.get("step_cache") else ""))
        lines = [head, f"  {self.memory}: {self.hbm / g:.2f} GiB"]
        for s in self.stages:
            peak = "does not compile" if s.peak is None else f"peak {s.peak / g:.2f} GiB"
            lines.append(f"  {s.stage:8s} {peak} per {unit} (weights {s.weights / g:.2f} GiB, "
                         f"resident from other stages {s.resident / g:.2f} GiB)"
                         + (f"; predicted {_seconds(s.predicted_s)} per video, compile {_seconds(s.predicted_compile_s)}"
                            if s.predicted_s is not None else ""))
            if s.predicted_s is not None:
                for what, predicted in (("run", s.predicted_s), ("compile", s.predicted_compile_s)):
                    found = self.reported(s.stage, what)
                    if found:
                        lines.append(f"    reported upstream ({found['source']}): {what} {_seconds(found['seconds'])}, "
                                     f"predicted {predicted / found['seconds'] - 1:+.0%}")
            for p in s.programs:
                if p.peak is None:
                    need = f" (the compiler asks {p.oom_required / g:.2f} GiB of temporaries)" if p.oom_required else ""
                    if p.vmem_required:
                        need = (f" (a kernel asks {p.vmem_required / 2**20:.2f} MiB of scoped VMEM, the limit is "
                                f"{p.vmem_limit / 2**20:.2f} MiB)")
                    lines.append(f"    {p.name} x{p.calls}: does not fit{need}")
                else:
                    lines.append(f"    {p.name} x{p.calls}: arguments {p.arguments / g:.2f} + temporaries "
                                 f"{p.temporaries / g:.2f} + outputs {p.outputs / g:.2f} GiB"
                                 + (f"; predicted {_seconds(p.predicted_s)} per call" if p.predicted_s is not None
                                    else ""))
        lines.append(f"  binding stage: {self.binding}; " + ("fits" if self.fits else f"does not fit: {self.advice()}"))
        if self.predicted_s is not None:
            lines.append(f"  predicted, not measured: {_seconds(self.predicted_s)} per video on the {self.chips} chips "
                         f"(stages {', '.join(s.stage for s in self.stages)}), after {_seconds(self.predicted_compile_s)}"
                         " of compiles at the planning host's speed (tpupedia.predict: the compiler's counts, splash "
                         "at the MXU's ceiling, collectives at ring bandwidth)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _seconds(s: float) -> str:
    """`0.84 s`, `1.7 min`: a time in the unit that reads."""
    return f"{s:.2f} s" if s < 100 else f"{s / 60:.1f} min"


def _pipeline_module(family: str):
    import importlib

    from tpupedia import families

    try:
        return importlib.import_module(families.get(family, "video").pipeline)
    except families.FamilyError as err:
        raise PlanError(str(err)) from None


def make(family: str, request: Any, options: Any, *, model: str | None = None, configs: dict[str, dict] | None = None,
         topology: str = "v6e:2x4", layers: int | None = None, vae_tiling: str = "auto",
         resident: bool = False, dtype: str = "bfloat16", stages: Sequence[str] = STAGES,
         run_devices: Sequence[Any] | None = None, predict: bool = True) -> Plan:
    """Compile every program of `request` (the family's `Request`) for `topology` and report.

    `model`: the checkpoint planned, a hub id or folder (`StagedPipeline.plan_configs`: the
    releases a family builds in need no download), default the release the full preset loads for
    `request`; or `configs`, component configs already read (`Plan.checkpoint` is then `None`).
    `vae_tiling`: `on`, `off`, or `auto` (untiled if that fits, else tiled: the choice a run
    makes, `Plan.vae_tiling`). `stages`: a subset of `STAGES`
    to plan (the others are left out of the plan, not counted as free). `run_devices`: plan for
    these TPU devices (the run's own, `preflight`) instead of `topology`. `predict`: for a
    `topology`, also predict each program's time per call and its compile time
    (`ProgramCost.predicted_s`, `tpupedia.predict.Work`); with `layers`, each layered component's
    programs are compiled once more at `layers + 1`, and every missing layer adds the difference.
    Bad arguments raise `PlanError` or the pipeline's `PipelineError` before anything is built.
    """
    module = _pipeline_module(family)
    if vae_tiling not in TILING:
        raise PlanError(f"vae_tiling={vae_tiling!r} is not one of {', '.join(TILING)}")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise PlanError(f"layers={layers!r} must be a positive integer")
    if not stages or any(s not in STAGES for s in stages):
        raise PlanError(f"stages={','.join(stages)!r}: choose one or more of {', '.join(STAGES)}")
    pipe_cls = module.PIPELINE
    if configs is None:
        model = str(model) if model is not None else pipe_cls.release_id(request)
        configs = pipe_cls.plan_configs(request, model)
    if run_devices is None:
        try:
            topo = hardware.parse_topology(topology)
            devices.tpu_topology(topo)  # libtpu's own check of the slice's shape
        except hardware.HardwareError as err:  # a malformed name, or a shape libtpu refuses (`devices.tpu_topology`)
            first = str(err).splitlines()[0]
            raise PlanError(first if first.startswith("topology ") else f"topology {topology!r}: {first}") from None
        except Exception as err:  # noqa: BLE001 - anything else libtpu raises
            raise PlanError(f"topology {topology!r}: {str(err).splitlines()[0]}") from None
        name, chips, count = topo.name, topo.num_chips, topo.num_devices  # a mesh counts devices (2 per TPU7x chip)
    else:
        count = len(run_devices)
        kind = hardware.chip_for_device_kind(run_devices[0].device_kind)
        chips = count // kind.devices_per_chip if kind is not None and run_devices[0].platform == "tpu" else count
        name = f"{count} x {run_devices[0].device_kind}"
    pipe_cls.validate(request, options, count, configs)
    shape = pipe_cls.run_mesh_shape(request, options, count, configs)
    mesh = (devices.topology_mesh(topo, shape, ("dp", "tp")) if run_devices is None
            else devices.make_mesh(shape, ("dp", "tp"), devices=list(run_devices)))
    pipe = _abstract_pipeline(pipe_cls, configs, mesh, options, dtype, layers)
    notes: list[str] = []
    timing = topo if predict and run_devices is None else None  # predicted times: for a slice's chips

    def _cost(program: aot.Program, extra: dict[str, float]) -> ProgramCost:
        return _compiled(program, extra, timing)

    request = _resolved(module, request, configs)
    programs = {}
    if "text" in stages:
        programs["text"] = _stage_programs(pipe, "text", request)
    image = "image" in stages and request.image is not None  # image-to-video: the picture's encoder, tiled as the decode
    if image:  # built now, so that its models' missing layers are counted; compiled once the tiling is known
        _stage_programs(pipe, "image", _with_tiling(request, vae_tiling == "on"))
    if "denoise" in stages:
        programs["denoise"] = _stage_programs(pipe, "denoise", request)
    full_depth = _full_depth(pipe, layers)  # the components loaded so far (the decode's VAE is not a torch model)
    extra = {name: full.bytes_per_device - pipe.plans[name].bytes_per_device for name, full in full_depth.items()}
    host_copy, what = 0.0, ""
    if mesh.devices.flat[0].platform == "cpu":
        host_copy, what = max(((p.bytes_total, c) for c, p in full_depth.items()), default=(0.0, ""))
        if chips > 1:
            notes.append(f"the {chips} CPU devices share this host's memory: each one's weights, replicated ones "
                         "included, and temporaries come out of it")
    hbm, memory = memory_budget(list(mesh.devices.flat), host_copy, what)
    if any(extra.values()):
        notes.append(f"compiled {layers} layers per model; the missing layers' weight shards are added from their "
                     f"shapes ({sum(extra.values()) / _GIB:.2f} GiB per chip in all); temporaries are as compiled "
                     "for the shallow models (full depth may need more)")
    if pipe.indivisible_note():
        notes.append(pipe.indivisible_note())
    fuse_host = 0.0
    if getattr(request, "lora", ()):
        from tpupedia import lora

        component, fuse_host = max(lora.fuse_bytes(request.lora, module.PIPELINE.family, configs, dtype).items(), key=lambda kv: kv[1])
        notes.append(f"LoRA: fusing {len(request.lora)} adapter(s) on the host, before the weights are placed, needs "
                     f"about {fuse_host / _GIB:.2f} GiB of host memory (the {component} in {dtype} plus twice its "
                     "adapters' files: an estimate)")
    costs = {s: [_cost(p, extra) for p in ps] for s, ps in programs.items()}

    def vae_stages(request) -> tuple[dict[str, list[ProgramCost]], bool, list[str]]:
        """The image and decode stages' costs for `request`, the tiling `auto` chose, and its note."""
        found, tiling, said = {}, vae_tiling == "on", []
        if "decode" in stages:
            decode = [_cost(p, extra) for p in _stage_programs(pipe, "decode", _with_tiling(request, tiling))]
            if vae_tiling == "auto" and not StageCost("decode", decode, 0.0).fits(hbm):
                untiled = max((p.peak or p.oom_required or 0) for p in decode)
                tiling = True
                decode = [_cost(p, extra) for p in _stage_programs(pipe, "decode", _with_tiling(request, True))]
                said.append(f"VAE tiling: auto turned it on, the untiled decode does not fit "
                            f"({untiled / _GIB:.2f} GiB or more of {hbm / _GIB:.2f} GiB)")
            found["decode"] = decode
        if image:  # the picture's encode is tiled as the decode is
            found["image"] = [_cost(p, extra) for p in _stage_programs(pipe, "image", _with_tiling(request, tiling))]
        return found, tiling, said

    vae, tiling, said = vae_stages(request)
    over = [s for s, c in vae.items() if not StageCost(s, c, 0.0).fits(hbm)]
    lowered = pipe_cls.lowered(request, dtype) if over else None
    if lowered is not None:  # stock keeps the VAE wider than the run: the run's dtype, if that is what fits
        narrow, narrow_tiling, narrow_said = vae_stages(lowered)
        if all(StageCost(s, c, 0.0).fits(hbm) for s, c in narrow.items()):
            need = max(max((p.peak or p.oom_required or 0) for p in vae[s]) for s in over)
            notes.append(f"VAE in {lowered.vae_dtype}, not float32 as stock diffusers loads it: in float32 stage "
                         f"{over[0]} needs {need / _GIB:.2f} GiB or more of {hbm / _GIB:.2f} GiB "
                         f"(--vae-dtype float32 to insist)")
            request, vae, tiling, said = lowered, narrow, narrow_tiling, narrow_said
    notes += said
    costs |= vae
    if timing is not None and layers is not None:  # the programs' work at full depth: one layer more, scaled
        deeper = _abstract_pipeline(pipe_cls, configs, mesh, options, dtype, layers + 1)
        for stage in ("text", "image", "denoise"):
            if stage in costs:
                _deepen(costs[stage], _stage_programs(deeper, stage, _with_tiling(request, tiling)), configs,
                        layers, timing)
    if "decode" not in stages:
        notes.append(f"stages planned: {', '.join(s for s in STAGES if s in stages)} (the others are not in this plan)")
    weights = {s: StageCost(s, c, 0.0).weights for s, c in costs.items()}
    planned = [StageCost(s, costs[s], sum(w for o, w in weights.items() if o != s) if resident else 0.0)
               for s in STAGES if s in costs]
    r = request
    cache = getattr(r, "step_cache", None) or getattr(r, "deepcache", None)  # a family's own DeepCache flag too
    from tpupedia import attention as kernels

    backend = kernels.resolve_backend(options.attention, mesh.devices.flat[0].platform)
    attention = backend + (f" {'/'.join(map(str, pipe.block_sizes))}" if backend == "splash" else "")
    return Plan(family=family, checkpoint=model, topology=name, chips=chips, devices=count if count != chips else None,
                mesh=dict(mesh.shape),
                request={"width": r.width, "height": r.height, "frames": r.frames, "steps": r.steps,
                         "guidance": r.guidance} | ({"image": True} if r.image is not None else {})
                        | ({"vae_dtype": r.vae_dtype} if getattr(r, "vae_dtype", None) else {})
                        | ({"step_cache": str(cache)} if cache is not None else {})
                        | ({"quantize": r.quantize} if getattr(r, "quantize", None) else {}),
                layers=layers, resident=resident, hbm=hbm, stages=planned, vae_tiling=tiling, notes=notes,
                attention=attention, memory=memory, host_copy=host_copy, fuse_host=fuse_host)


def programs(family: str, request: Any, options: Any, configs: dict[str, dict], mesh: Any, stage: str, *,
             dtype: str = "bfloat16", **step: Any) -> list[aot.Program]:
    """The programs `stage` (`text`, `image` or `denoise`) runs for `request` on `mesh`, built as
    `make` builds them (the models on `meta` from `configs`, their weights abstract arguments
    placed as a run places them), not compiled: to compile or count on any devices, a CPU host's
    included. `step`: keyword arguments of the family's denoise programs (HunyuanVideo-1.5's
    `text_tokens`, the text tokens a run keeps; a plan compiles them all). Notebook `hunyuan_tuning_and_i2v` counts
    the FLOPs of a DeepCache step with them."""
    module = _pipeline_module(family)
    pipe = _abstract_pipeline(module.PIPELINE, configs, mesh, options, dtype, None)
    request = _resolved(module, request, configs)
    if stage not in ("text", "image", "denoise"):
        raise PlanError(f"stage {stage!r}: programs are built for text, image, denoise (the decode's: tpupedia.plan.make)")
    return _stage_programs(pipe, stage, request, **step)


def _stage_programs(pipe, stage: str, request: Any, **step: Any) -> list[aot.Program]:
    """The programs the abstract `pipe` runs for `stage` of `request` (`make` and `programs`)."""
    if stage == "denoise":
        pipe.quantized = request.quantize  # the transformers as the run's denoise stage holds them
        return pipe._denoise_programs(request, pipe._denoise_setup(request), **step)
    return {"text": pipe._text_programs, "image": pipe._image_programs, "decode": pipe._decode_programs}[stage](request)


def _abstract_pipeline(pipe_cls, configs, mesh, options, dtype: str, layers: int | None):
    """`pipe_cls` built to describe its programs, not run them: models on `meta`, `layers` deep."""
    import torch

    pipe = pipe_cls("(plan)", "plan", getattr(torch, dtype), mesh, options, configs)
    pipe.abstract, pipe.layers = True, layers
    return pipe


def _resolved(module, request, configs):
    resolve = getattr(module, "resolve", None)  # families whose request takes defaults from the checkpoint
    return resolve(request, configs) if resolve else request


def _with_tiling(request, tiling: bool):
    return dataclasses.replace(request, vae_tiling=tiling)


def _full_depth(pipe, layers: int | None) -> dict[str, Any]:
    """Per torch component (the transformers and text encoders), its `ShardingPlan` at full depth:
    the plan's own when it compiles every layer, else a full-depth copy built on `meta` and planned
    with the same rules (the weight bytes per chip of the layers a shallow plan left out, and each
    component's whole size)."""
    if layers is None:
        return {name: plan for name, plan in pipe.plans.items() if name != "vae"}
    from tpupedia import sharding

    out = {}
    pipe.layers = None
    try:
        for name, shallow in pipe.plans.items():
            if name == "vae":
                continue
            full = pipe._load(pipe.components[name][0], name)
            out[name] = sharding.plan(full, pipe.components[name][1], shallow.mesh)
    finally:
        pipe.layers = layers
    return out


def memory_budget(run_devices: Sequence[Any], host_copy: float = 0.0, what: str = "") -> tuple[float, str]:
    """Bytes one device of `run_devices` may use, and what they are.

    A TPU chip: its HBM as the TPU compiler allows a program (`aot.hbm_budget`). CPU devices (a
    host without accelerators, the tiny preset's simulated devices) all take their memory from
    the host's RAM: each gets an equal share of what is available now
    (`hardware.host_memory_available`), after `host_copy` bytes the host holds itself (the copy
    of the largest model, `what`, a run holds while it places that model's weights on the
    devices). A plan for CPU devices is what stops a run on a CPU host before the kernel kills it
    for memory (`preflight`)."""
    if run_devices[0].platform != "cpu":
        chip = hardware.chip_for_device_kind(run_devices[0].device_kind)
        per = "device" if chip is not None and chip.devices_per_chip > 1 else "chip"  # a TPU7x chip is two devices
        return aot.hbm_budget(run_devices), f"HBM per {per}"
    n, available = len(run_devices), hardware.host_memory_available()
    label = (f"host memory per CPU device: {available / _GIB:.2f} GiB available"
             + (f", less {host_copy / _GIB:.2f} GiB for the host's copy of the {what} while it is placed"
                if host_copy else "")
             + (f", shared by {n} devices" if n > 1 else ""))
    return max(available - host_copy, 0) / n, label


def _compiled(program: aot.Program, extra: dict[str, float], timing: Any = None) -> ProgramCost:
    """Compile `program` and read its costs; with `timing` (a `hardware.Topology`) also its
    predicted time per call, from its work as compiled (its splash calls recorded as it is traced)."""
    from tpupedia import attention, predict

    add = extra.get(program.component, 0.0) if program.component else 0.0
    start = time.perf_counter()
    with attention.recording() as splash_calls:
        result = program.compile()
    seconds = result.compile_seconds if result.compile_seconds is not None else time.perf_counter() - start
    mem = result.memory
    work = (predict.program_work(result, timing.num_devices, splash_calls, timing.chip)
            if timing is not None and result.fits else None)
    return ProgramCost(
        stage=program.stage, name=program.name, calls=program.calls, fits=result.fits,
        weights=program.weights_bytes + add, arguments=mem.arguments + add if mem else None,
        temporaries=mem.temporaries if mem else None, outputs=mem.outputs if mem else None,
        aliased=mem.aliased if mem else None, oom_required=result.oom_required_bytes,
        compile_seconds=round(seconds, 2), component=program.component or "",
        vmem_required=result.vmem_required_bytes, vmem_limit=result.vmem_limit_bytes,
        work=None if work is None else dataclasses.asdict(work),
        predicted_s=None if work is None else work.seconds(timing.chip, timing.num_chips),
        predicted_compile_s=None if work is None else round(seconds, 2))


def _deepen(costs: list[ProgramCost], deeper: list[aot.Program], configs: dict[str, dict], layers: int,
            timing: Any) -> None:
    """Scale the predicted work and compile time of a stage's programs, compiled with `layers`
    layers per model, to each component's full depth (`make`): `deeper` are the same programs
    built `layers + 1` deep; a component with no more layers than `layers` keeps its figures,
    and a program whose deeper twin cannot be matched loses its prediction."""
    from tpupedia import predict
    from tpupedia.models import checkpoints

    matched = len(costs) == len(deeper)
    for cost, program in zip(costs, deeper):
        full = checkpoints.depth(configs.get(cost.component, {})) if cost.component else None
        if cost.work is None or full is None or full <= layers:
            continue
        more = _compiled(program, {}, timing) if matched else None
        if more is None or more.work is None or more.name != cost.name:
            cost.work = cost.predicted_s = cost.predicted_compile_s = None
            continue
        work = predict.Work(**cost.work).deeper(predict.Work(**more.work), full, layers)
        cost.work = dataclasses.asdict(work)
        cost.predicted_s = work.seconds(timing.chip, timing.num_chips)
        cost.predicted_compile_s = round(cost.compile_seconds + (full - layers)
                                         * max(more.compile_seconds - cost.compile_seconds, 0.0), 2)


SCORE_BYTES = 4
"""Bytes of one attention score in the reference attention: its scores and their softmax are
float32, whatever the inputs' dtype."""


def gpu_attention(family: str, request: Any, options: Any, configs: dict[str, dict], run_devices: Sequence[Any], *,
                  log: Any = print) -> float:
    """Refuse, before any weight loads, a run on GPU devices whose attention cannot fit one device.

    On a GPU `auto` attention is the reference (`tpupedia.attention.resolve_backend`: splash is a
    TPU kernel, and no fused GPU kernel is wired into the pipelines yet), which builds each call's
    scores whole: `batch x heads x tokens x tokens` float32 numbers (`SCORE_BYTES`), the batch split
    over `dp` and the heads over `tp`. For the full preset's Wan 2.1 14B at 720p and 81 frames that
    is 2 x 40 x 75,600^2 scores, about 213 GiB per device over eight, more than any GPU holds.
    The tokens and heads are the family's (`attention_call`, from the checkpoint's configs).
    Returns the bytes per device; raises `PlanError` naming them and the device's memory
    (`memory_stats()["bytes_limit"]`) when they do not fit, and says in the log that they fit
    otherwise (the weights and the other programs are not checked on a GPU); a device that
    reports no memory is not checked, and the log says so."""
    from tpupedia import attention as kernels

    module = _pipeline_module(family)
    pipe_cls = module.PIPELINE
    if kernels.resolve_backend(options.attention, "gpu") != "reference":
        return 0.0
    r = _resolved(module, request, configs)
    heads, tokens = pipe_cls.family.attention_call(r.width, r.height, r.frames, configs)
    batch = pipe_cls.guidance_batch(r, configs) or 1
    dp, tp = pipe_cls.run_mesh_shape(r, options, len(run_devices), configs)
    need = float(-(-batch // dp) * -(-heads // tp) * tokens * tokens * SCORE_BYTES)
    stats = run_devices[0].memory_stats() if hasattr(run_devices[0], "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    where = f"{family} on {len(run_devices)} x {run_devices[0].device_kind}"
    if not limit:
        log(f"plan: {where} reports no memory limit: the reference attention's {need / _GIB:.1f} GiB of scores per "
            "device were not checked")
        return need
    if need > limit:
        raise PlanError(f"{where} will not fit: the reference attention (what runs on a GPU here; no fused GPU "
                        f"kernel is wired in yet) builds {batch} x {heads} x {tokens:,} x {tokens:,} float32 scores per "
                        f"call, {need / _GIB:.1f} GiB per device against its {limit / _GIB:.1f} GiB; fewer frames or "
                        "a smaller size (the scores grow with the square of the tokens), or a TPU, where splash "
                        "attention never holds them (nothing was loaded; --no-plan skips this check)")
    log(f"plan: the reference attention's scores, {need / _GIB:.1f} GiB per device, fit {where}'s "
        f"{limit / _GIB:.1f} GiB (on a GPU only the attention is checked before loading)")
    return need


def _preflight_key(family: str, request: Any, options: Any, configs: dict, run_devices: Sequence[Any],
                   tiling: str, resident: bool, dtype: str) -> str:
    """What the plan depends on: shapes, not words (a prompt only matters through quoted glyph text).
    The request as the plan plans it (the family's `resolve`): a family that takes an image-to-video
    video's size from the picture's aspect (HunyuanVideo-1.5) keys on that size."""
    import jax

    from tpupedia import results
    from tpupedia.pipelines import stages

    request = _resolved(_pipeline_module(family), request, configs)
    fields = {k: v for k, v in dataclasses.asdict(request).items()
              if k not in ("prompt", "negative_prompt", "seed", "fps", "vae_tiling", "image")}
    if request.image is not None:  # past `resolve`, the picture matters only through the size: that there is one
        fields["image"] = True
    quotes = any(q in p for p in (request.prompt, request.negative_prompt) for q in "\"'\u201c\u201d\u2018\u2019")
    return stages.fingerprint({
        "family": family, "request": fields, "quotes": quotes, "options": dataclasses.asdict(options) | {"quiet": None},
        "configs": {k: stages.config_fingerprint(c) for k, c in configs.items()},
        "devices": [len(run_devices), run_devices[0].device_kind, jax.process_count()], "tiling": tiling,
        "resident": resident, "dtype": dtype, "layers": PREFLIGHT_LAYERS,
        "versions": [results.version("jax"), results.version("libtpu") if devices.has_libtpu() else None,
                     results.version("diffusers"), results.version("transformers")]})


def preflight(family: str, request: Any, options: Any, configs: dict[str, dict], run_devices: Sequence[Any], *,
              cache_dir: Any, tiling: str = "auto", resident: bool = False, dtype: str = "bfloat16",
              log: Any = print) -> Any:
    """The plan's checks before a full-size run loads any weights: every way in calls it through
    `tpupedia.pipelines.common.check_plan` (`run`, `run_batch`, a hand-built pipeline's stage
    methods, and so `tpupedia generate --preset full`).

    On TPU devices, compile every program of the run for `run_devices` (the run's own chips) with
    `PREFLIGHT_LAYERS` layers per model (`make`), and raise `PlanError` naming the stage and the
    fix when a stage will not fit; otherwise return `request` with `vae_tiling` resolved (`tiling`
    `auto`: on only when the untiled decode does not fit) and, for a family whose stock VAE is
    float32 beside a narrower run (Wan), `vae_dtype` set to the run's dtype only when the float32
    VAE stages do not fit (`StagedPipeline.lowered`; said each run). The answer is cached as JSON in
    `cache_dir`, keyed by everything it depends on (`_preflight_key`), so a second run with the
    same shapes compiles nothing; an unreadable cache file is planned again.

    On CPU devices the same programs are compiled by the CPU compiler and held against the host's
    memory (`memory_budget`: simulated devices share it), so a run a CPU host cannot hold stops
    here with the stage, its need and the fix, not in the middle of a stage at the kernel's hand.
    The memory available changes between runs: a cached answer is planned again when the verdict
    could change (it fit and now would not, or it did not and there is more memory now). On a GPU
    the programs are not compiled: the attention is checked against the device's memory
    (`gpu_attention`, a refusal in one line) and `auto` means untiled.
    """
    import json
    from pathlib import Path

    from tpupedia import results

    if tiling not in TILING:
        raise PlanError(f"vae_tiling={tiling!r} is not one of {', '.join(TILING)}")
    if run_devices[0].platform not in ("tpu", "cpu"):
        gpu_attention(family, request, options, configs, run_devices, log=log)
        return dataclasses.replace(request, vae_tiling=tiling == "on")
    key = _preflight_key(family, request, options, configs, run_devices, tiling, resident, dtype)
    path = Path(cache_dir) / f"{family}-{key[:16]}.json"
    try:
        answer = json.loads(path.read_text())
        if answer.get("key") != key or not isinstance(answer.get("fits"), bool):
            raise ValueError(path)
        if run_devices[0].platform == "cpu":  # the host's memory now, against what the run needs
            budget = memory_budget(run_devices, answer["host_copy"])[0]
            if budget < answer["peak"] if answer["fits"] else budget > answer["budget"]:
                raise ValueError(path)  # less memory than the run needs, or more than when it did not fit
    except (OSError, ValueError, KeyError, TypeError):
        log(f"plan: compiling the run's programs for {len(run_devices)} x {run_devices[0].device_kind} "
            f"({PREFLIGHT_LAYERS} layer per model) before loading weights; cached for the next run")
        found = make(family, request, options, configs=configs, layers=PREFLIGHT_LAYERS, vae_tiling=tiling,
                     resident=resident, dtype=dtype, run_devices=run_devices)
        peaks = [st.peak for st in found.stages]
        answer = {"key": key, "fits": found.fits, "vae_tiling": found.vae_tiling, "advice": found.advice(),
                  "vae_dtype": found.request.get("vae_dtype"),
                  "precision": next((n for n in found.notes if n.startswith("VAE in ")), ""),
                  "summary": found.summary(), "budget": found.hbm, "host_copy": found.host_copy,
                  "peak": None if None in peaks else max(peaks, default=0.0)}
        results.write_json_atomic(path, answer)
        log(found.summary())
    if not answer["fits"]:
        raise PlanError(f"{family} on {len(run_devices)} x {run_devices[0].device_kind} will not fit: "
                        f"{answer['advice']} (nothing was loaded; `tpupedia plan {family}` shows the whole plan, "
                        "--no-plan skips this check)")
    if answer.get("precision"):  # said on every run, cached or not: the video differs from stock here
        log(f"plan: {answer['precision']}")
    if answer.get("vae_dtype"):
        request = dataclasses.replace(request, vae_dtype=answer["vae_dtype"])
    return dataclasses.replace(request, vae_tiling=bool(answer["vae_tiling"]))


def record(plan: Plan, path: str = DEFAULT_RECORDS, command: str = "") -> Any:
    """Merge `plan` into the plans file the docs' results page renders."""
    import datetime as _dt

    from tpupedia import results

    data = plan.as_dict() | {"compiled_at": _dt.date.today().isoformat(), "command": command,
                             "libtpu": results.version("libtpu") if devices.has_libtpu() else None}

    def key(r):
        return (r["family"], r.get("checkpoint"), r["topology"], tuple(sorted(r["mesh"].items())), tuple(sorted(r["request"].items())),
                r["layers"], r["resident"], tuple(s["stage"] for s in r["stages"]), r.get("attention", ""),
                bool(r.get("vae_tiling")))

    return results.merge(data, path, key=key)



def recorded_run(records: Sequence[dict], checkpoint: str, topology: str, width: int, height: int, frames: int,
                 steps: int, *, image: bool = False, quantize: str | None = None) -> dict[str, Any] | None:
    """One video's predicted time from plans recorded with `record` (`DEFAULT_RECORDS`): each of
    its stages from a plan of `checkpoint` on `topology` at that size and frame count that fits
    (the text and denoise stages are often one `--layers 1` record, the decode another), the
    denoise stage at `steps` steps, its transformers in the `quantize` format (`None`: the
    checkpoint's); a video's stages run one after another, so the times add.
    `{"stages": {stage: seconds}, "seconds": total, "commands": [...]}`, or `None` where a stage
    has no fitting record with a predicted time. Predicted, never measured: the notebook
    `plan_without_tpu` says how far such a prediction is from a run."""
    wanted = ("text", "image", "denoise", "decode") if image else ("text", "denoise", "decode")
    found: dict[str, tuple[float, str]] = {}
    for r in records:
        q = r["request"]
        if (r.get("checkpoint"), r["topology"], q["width"], q["height"], q["frames"]) != \
                (checkpoint, topology, width, height, frames) or r["resident"] or bool(q.get("image")) != image \
                or q.get("quantize") != quantize:
            continue
        for s in r["stages"]:
            fits = s["peak"] is not None and s["peak"] <= r["hbm"]
            if (s["stage"] in wanted and fits and s.get("predicted_s") is not None
                    and (s["stage"] != "denoise" or q["steps"] == steps)):
                found[s["stage"]] = (s["predicted_s"], r["command"])
    if set(found) != set(wanted):
        return None
    stages = {stage: found[stage][0] for stage in wanted}
    return {"stages": stages, "seconds": sum(stages.values()),
            "commands": list(dict.fromkeys(found[stage][1] for stage in wanted))}
