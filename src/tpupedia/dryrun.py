"""Plan a TPU run without a TPU: compile one full-size step for a TPU slice on a CPU host.

The model is built on PyTorch's `meta` device (shapes only: no weights, no download), every
parameter becomes an abstract, sharded `jax.ShapeDtypeStruct`, and one step (a denoising step
with its classifier-free-guidance batch of 2, or an LLM forward) is traced through torchax and
compiled by the real TPU compiler for the slice (`tpupedia.devices.topology_mesh`). The report
gives per-chip memory against the chip's HBM (or the compiler's out-of-memory figures), the
collectives in the compiled program, the step's analytic FLOPs, the roofline lower bound on its
time, and, given a measured step time, the implied MFU.

The roofline is the largest of three floors (`step_floors`): the FLOPs at the chips' bf16 peak,
each chip's weight shards read once at its HBM bandwidth, and the bytes each chip sends in
collectives at the bandwidth a ring along **one torus axis** gets: that axis's two ICI ports,
one direction each (`hardware.Chip.ring_bytes_per_s`; on a v6e 2 x 100 GB/s = 200 GB/s, a
quarter of its 800 GB/s bidirectional total over four ports).

`layers=N` compiles a shallower copy. Weights are arguments, so their per-chip bytes are known
per layer: the report adds the missing layers' shards from their shapes. Temporaries are
taken as compiled: layers run one after another and reuse most of their working set, so one
layer gives the order of magnitude, but the full program can need more (for CogVideoX at 720p
and 81 frames with reference attention, 35.96 GiB at one layer and 39.84 GiB at 42, both
measured here). Confirm a shallow "fits" near the limit with a full-depth compile. The report
says when it scaled.

Introduced in notebook `plan_without_tpu` (plan a TPU run without a TPU).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpupedia import aot, devices, families, hardware, results
from tpupedia import sharding as sharding_rules
from tpupedia.errors import TpupediaError

__all__ = [
    "compiled_or_recorded",
    "DryRunError",
    "ATTENTIONS",
    "step_floors",
    "RESOLUTIONS",
    "parse_resolution",
    "DryRunReport",
    "run",
    "DEFAULT_RECORDS",
    "record",
]

DEFAULT_RECORDS = "docs/results/dryruns.json"

RESOLUTIONS = {"720p": (1280, 720), "480p": (848, 480)}

ATTENTIONS = ("reference", "splash", "standin")
"""What a dry-run's attention compiles to: the reference, the splash kernel, or (planning only,
never a run) `standin`: a stand-in with attention's inputs and output and none of its work,
whose calls are recorded, for `tpupedia.predict`."""


class DryRunError(TpupediaError, ValueError):
    """A dry-run request that cannot describe a valid step (bad model, size, frames, mesh)."""


def parse_resolution(value: str, multiple: int) -> tuple[int, int]:
    """`"720p"`, `"480p"` or `"WxH"` → `(width, height)`, each a multiple of `multiple`."""
    key = value.strip().lower()
    if key in RESOLUTIONS:
        width, height = RESOLUTIONS[key]
    else:
        m = re.fullmatch(r"(\d+)x(\d+)", key)
        if not m:
            raise DryRunError(f"resolution {value!r} is not one of {', '.join(RESOLUTIONS)} or WIDTHxHEIGHT")
        width, height = int(m.group(1)), int(m.group(2))
    if width % multiple or height % multiple or width <= 0 or height <= 0:
        raise DryRunError(f"resolution {width}x{height}: width and height must be positive multiples of {multiple}")
    return width, height


# --- the report --------------------------------------------------------------------------------

@dataclass
class DryRunReport:
    """What one AOT dry-run found. Bytes are per chip."""

    model: str
    topology: str
    chip: str
    num_chips: int
    mesh: dict[str, int]
    sharding: str
    attention: str
    width: int | None
    height: int | None
    frames: int | None
    tokens: int
    layers_full: int
    layers_compiled: int
    hbm_bytes: float
    """HBM the TPU compiler makes available to a program per chip (measured, `aot.hbm_budget`)."""
    fits: bool
    arguments_bytes: float | None
    temporaries_bytes: float | None
    outputs_bytes: float | None
    oom_required_bytes: float | None
    oom_available_bytes: float | None
    collectives: dict[str, int]
    flops: dict[str, float]
    roofline_seconds: float
    measured_step_seconds: float | None = None
    mfu: float | None = None
    notes: list[str] = field(default_factory=list)
    collective_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes one chip sends per step, per collective kind (`aot.collective_traffic`), full depth."""
    block_sizes: list[int] | None = None
    """The splash kernel's `[block_q, block_kv, block_kv_compute]` (upper bounds, capped per call);
    `None` with the reference attention."""
    mask: str | None = None
    """A family whose stock attention processor builds a mask matrix (`FamilySpec.dryrun_masks`):
    `vector` (the pipeline's (B, S) padding, the family's `padded_forward`) or `matrix`
    (diffusers' processor, which builds a (B, 1, S, S) mask in every block); otherwise `None`."""
    floors: dict[str, float] = field(default_factory=dict)
    """Lower bounds on the step time, seconds (`step_floors`): `compute` (FLOPs at the chips' bf16
    peak), `memory` (the chip's weight shards read once from HBM), `communication` (the bytes
    the chip sends, at what a ring along one torus axis gets). `roofline_seconds` is the
    largest; `bound` names it."""
    bound: str = ""
    floor_basis: dict[str, float] = field(default_factory=dict)
    """The bandwidths the floors divided by, bytes/s: `hbm` (`Chip.hbm_bytes_per_s`) and `ici`
    (`Chip.ring_bytes_per_s`). Kept in the record, so that a corrected figure can be applied to
    its stored bytes without compiling again."""
    compiled_cost: dict[str, float] | None = None
    """The compiler's cost analysis of the program compiled (the layers compiled, per chip):
    `flops`, HBM `bytes` and its own time estimate `seconds` (`aot.compiled_cost`). It cannot see
    into a Pallas kernel and counts a collective as memory traffic; `tpupedia.predict` models
    both (`attention="standin"`)."""
    batch: int = 2
    """A video model's step batch: 2, the guidance pair; 1, guidance off."""
    attention_calls: list[list[int]] = field(default_factory=list)
    """With `attention="standin"`: each attention call the compiled layers make, as
    `[batch, heads, query tokens, key tokens, head_dim]` (what `tpupedia.predict` models)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        g = 2**30
        size = f"{self.width}x{self.height}, {self.frames} frames" if self.width else f"{self.tokens} tokens"
        lines = [f"{self.model} {size} on {self.topology} ({self.num_chips} x {self.chip}), "
                 f"mesh {self.mesh}, sharding {self.sharding}, attention {self.attention}"
                 + (f" (blocks {'/'.join(map(str, self.block_sizes))})" if self.block_sizes else "")
                 + (f", text mask as a {self.mask}" if self.mask else "")]
        if self.fits:
            lines.append(f"  fits: arguments {self.arguments_bytes / g:.2f} GiB + temporaries "
                         f"{self.temporaries_bytes / g:.2f} GiB + outputs {self.outputs_bytes / g:.2f} GiB "
                         f"per chip, of {self.hbm_bytes / g:.2f} GiB HBM")
        else:
            lines.append(f"  does not fit: the compiler needs {self.oom_required_bytes / g:.2f} GiB of "
                         f"temporaries and has {self.oom_available_bytes / g:.2f} GiB per chip")
        lines.append(f"  collectives: {self.collectives or 'none'}")
        lines.append(f"  step FLOPs {self.flops['total']:.3e} (attention {self.flops['attention'] / self.flops['total']:.0%}); "
                     f"roofline lower bound {self.roofline_seconds:.3f} s")
        if self.floors:
            sent = sum(self.collective_bytes.values())
            ici = f" at {self.floor_basis['ici'] / 1e9:.0f} GB/s, a one-axis ring" if self.floor_basis else ""
            lines.append(f"  floors: compute {self.floors['compute']:.3f} s, HBM {self.floors['memory']:.3f} s, "
                         f"ICI {self.floors['communication']:.3f} s ({sent / 2**30:.2f} GiB sent per chip{ici}): "
                         f"{self.bound}-bound")
        if self.mfu is not None:
            lines.append(f"  measured {self.measured_step_seconds:.2f} s/step -> MFU {self.mfu:.1%}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def step_floors(flops: float, num_chips: int, chip: hardware.Chip, weight_bytes: float,
                sent_bytes: float) -> dict[str, float]:
    """Three lower bounds on one step's time, in seconds, from per-chip figures.

    - `compute`: the step's FLOPs spread evenly over `num_chips` chips at their bf16 peak.
    - `memory`: one device's `weight_bytes` read once from HBM at its share of `chip.hbm_bytes_per_s`
      (a chip's; half of a TPU7x chip's, whose two devices each have their own HBM).
    - `communication`: the bytes one chip sends in collectives (`aot.collective_traffic`, the
      ring algorithm's traffic) at `chip.ring_bytes_per_s`: a bidirectional ring along one
      torus axis, two of the chip's ports at one direction each (v6e: 2 x 100 GB/s = 200 GB/s,
      not the 800 GB/s bidirectional total of four ports). Along a v6e axis shorter than 16
      chips there is no wraparound link and the ring is a line: slower, so still a floor. A
      collective spread over both axes of a full 16x16 pod could use all four ports: up to
      twice as fast as this floor.
    """
    return {"compute": flops / (num_chips * chip.bf16_flops),
            "memory": weight_bytes / chip.device_hbm_bytes_per_s,
            "communication": sent_bytes / chip.device_ring_bytes_per_s}


def _validate(spec: families.FamilySpec, frames: int | None, sharding: str, attention: str,
              layers: int | None) -> None:
    if spec.kind != "vae" and sharding not in spec.strategies:  # a VAE runs whole on one chip
        raise DryRunError(f"sharding {sharding!r} is not one of {', '.join(spec.strategies)} for {spec.name}")
    if attention not in ATTENTIONS:
        raise DryRunError(f"attention {attention!r} is not one of {', '.join(ATTENTIONS)}")
    if spec.kind != "llm":
        rule = families.get(spec.defaults_from or spec.name).facts.DEFAULT_SHAPES.temporal
        if frames is None or frames < 1 or (frames - 1) % rule:
            raise DryRunError(f"frames={frames}: {spec.name} needs {rule}n+1 frames (the VAE compresses time by "
                              f"{rule}), e.g. {', '.join(str(rule * n + 1) for n in (12, 20, 30))}")
    if layers is not None and layers < 1:
        raise DryRunError(f"layers={layers} must be a positive integer")


def run(model: str, topology: str = "v6e:2x4", resolution: str | None = None,
        frames: int | None = None, sharding: str = "tp", attention: str = "reference",
        layers: int | None = None, mesh_shape: tuple[int, int] | None = None, seq: int = 2048,
        measured_step_seconds: float | None = None, mask: str = "vector",
        block_sizes: tuple[int, int, int] | None = None, batch: int = 2) -> DryRunReport:
    """Compile one full-size step of `model` for `topology` and report what it costs per chip.
    `batch`: a video model's step batch, 2 for the guidance pair, 1 with guidance off (a
    few-step release; the mesh then needs `dp=1`).

    The mesh is `("dp", "tp")`; by default `dp=2` (the guidance batch) and `tp` the rest of the
    chips, for LLMs `dp=1`. A family whose stock attention builds a (B, 1, S, S) mask compiles the
    pipeline's forward with the padding as a vector (`mask="vector"`, its `padded_forward`) or the
    stock processor (`mask="matrix"`, notebook `hunyuan_video` compares them).
    Splash runs at `block_sizes`, by default the family's `SPLASH_BLOCK_SIZES` as the slice's chip
    fits them in its scoped VMEM (what the pipeline runs: `attention.chip_block_sizes`). `resolution` and `frames` default to the family's full-preset request (`generate`'s).
    Bad arguments raise `DryRunError` before anything is built.
    """
    try:
        spec = families.get(model)
    except families.FamilyError as err:
        raise DryRunError(str(err).replace("family", "model", 1)) from None
    if spec.kind != "llm":
        from tpupedia import presets

        default = families.get(spec.defaults_from or spec.name).facts.default_request(presets.get("full"))
        resolution = resolution or f"{default['width']}x{default['height']}"
        frames = default["frames"] if frames is None else frames
    _validate(spec, frames, sharding, attention, layers)
    if mask not in spec.dryrun_masks:
        raise DryRunError(f"mask={mask!r} is not one of {', '.join(spec.dryrun_masks)} for {model}")
    if block_sizes is not None:  # splash's rules (AttentionError names the value)
        from tpupedia import attention as kernel

        kernel.check_block_rules(block_sizes)
    topo = hardware.parse_topology(topology)  # parsed once; the parsed slice is passed on
    n = topo.num_devices  # what the mesh spans: devices (2 per TPU7x chip); peaks count chips
    if mesh_shape is None:
        mesh_shape = (1, n) if spec.kind == "llm" or n == 1 else (2, n // 2)
    if math.prod(mesh_shape) != n:
        raise DryRunError(f"mesh {mesh_shape} needs {math.prod(mesh_shape)} devices; {topology} has {n}"
                          + (f" ({topo.num_chips} chips of {topo.chip.devices_per_chip})" if n != topo.num_chips else ""))
    width = height = None
    if spec.kind != "llm":
        width, height = parse_resolution(resolution, 16)
    if spec.kind == "vae":
        return _vae_report(spec, topo, width, height, frames)

    from tpupedia import torchax_utils

    env = torchax_utils.default_env()
    torchax_utils.register_common_outputs()
    mesh = devices.topology_mesh(topo, mesh_shape, ("dp", "tp"))
    family = spec.facts
    full_layers = family.FULL_LAYERS
    blocks = None
    if attention == "splash":  # the family's as this chip fits them, like a pipeline's
        from tpupedia import attention as kernel

        blocks = tuple(block_sizes or kernel.chip_block_sizes(mesh.devices.flat[0], family.SPLASH_BLOCK_SIZES))
    module = family.build(layers)
    if spec.kind == "llm":
        specs, call = family.step_inputs(seq)
        flops = family.forward_flops(seq)
    else:
        if batch not in (1, 2) or mesh_shape[0] > batch:
            raise DryRunError(f"batch={batch} on mesh dp={mesh_shape[0]}: a step's batch is 2 (the guidance pair) "
                              "or 1 (guidance off), and dp splits it")
        specs, call = family.step_inputs(width, height, frames, batch=batch)
        flops = family.step_flops(width, height, frames, batch=batch)
    inputs = _abstract_inputs(mesh, specs)

    axis = "tp" if sharding.startswith("tp") else ("dp", "tp")  # FSDP shards over every chip
    table = sharding_rules.rules(spec, sharding, axis=axis)
    try:
        the_plan = sharding_rules.plan(module, table, mesh)
    except sharding_rules.ShardingError as err:
        raise DryRunError(str(err)) from None
    method = "forward"
    standin = _StandIn() if attention == "standin" else None
    if mask == "vector" and "matrix" in spec.dryrun_masks:  # the pipeline's forward, padding as a vector
        from tpupedia import attention as kernel

        attend = standin.attend if standin else kernel.padded_attend(attention, mesh=mesh, interpret=False,
                                                                      block_sizes=blocks)
        method = family.padded_forward(module, attend)
    functional = torchax_utils.FunctionalModule(module, method)
    weights, buffers = functional.abstract_state(the_plan)
    notes = []

    def step(w, b, *args):
        return call(functional, w, b, *args)

    with torchax_utils.restoring_ops(env):  # the environment is shared: leave it as found
        if attention == "splash":
            _install_splash(env, mesh, spec.mask, blocks)
        elif standin:
            standin.install(env)
        else:
            torchax_utils.stock_ops(env)  # torchax's reference SDPA, whatever was installed before
        result = aot.compile_aot(step, weights, buffers, *inputs)

    compiled_layers = full_layers if layers is None else min(layers, full_layers)
    per_layer = sum(p.bytes_per_device for p in the_plan.placements if p.name.startswith(spec.layer_prefix))
    extra = (full_layers - compiled_layers) * per_layer
    if extra:
        notes.append(f"compiled {compiled_layers} of {full_layers} layers; arguments include "
                     f"{full_layers - compiled_layers} more layers' weight shards ({extra / 2**30:.2f} GiB per chip, "
                     "from their shapes); temporaries are as compiled for the shallow copy (full depth may need more)")
    chip = topo.chip
    hbm = aot.hbm_budget(mesh.devices.flat)  # what the compiler lets a program use per chip
    mem = result.memory
    args_bytes = mem.arguments + extra if mem else None
    fits = result.fits
    if fits and mem.arguments + extra + mem.temporaries + mem.outputs > hbm:
        fits = False
        notes.append("the compiled shallow copy fits, but the full depth's weights do not")
    weight_bytes_per_chip = (mem.arguments + extra) if mem else the_plan.bytes_per_device + extra
    traffic = {}
    if result.compiled is not None:  # per-layer collectives, scaled to the full depth
        traffic = {k: v * full_layers / compiled_layers
                   for k, v in aot.collective_traffic(result.compiled.as_text(), n).items()}
    floors = step_floors(flops["total"], topo.num_chips, chip, weight_bytes_per_chip, sum(traffic.values()))
    bound = max(floors, key=floors.get)
    roofline = floors[bound]
    mfu = None
    if measured_step_seconds:
        mfu = flops["total"] / (measured_step_seconds * topo.num_chips * chip.bf16_flops)
    return DryRunReport(
        model=model, topology=topo.name, chip=chip.name, num_chips=topo.num_chips, mesh=dict(mesh.shape),
        sharding=sharding, attention=attention, width=width, height=height,
        frames=frames if spec.kind != "llm" else None, tokens=int(flops["tokens"]),
        layers_full=full_layers, layers_compiled=compiled_layers, hbm_bytes=hbm, fits=fits,
        arguments_bytes=args_bytes, temporaries_bytes=mem.temporaries if mem else None,
        outputs_bytes=mem.outputs if mem else None,
        oom_required_bytes=result.oom_required_bytes, oom_available_bytes=result.oom_available_bytes,
        collectives=result.collectives, flops=flops, roofline_seconds=roofline,
        measured_step_seconds=measured_step_seconds, mfu=mfu, notes=notes,
        collective_bytes=traffic, floors=floors, bound=bound, mask=mask if "matrix" in spec.dryrun_masks else None,
        floor_basis={"hbm": chip.hbm_bytes_per_s, "ici": chip.ring_bytes_per_s},
        block_sizes=list(blocks) if blocks else None,
        compiled_cost=aot.compiled_cost(result), batch=batch if spec.kind != "llm" else 1,
        attention_calls=standin.calls if standin else [],
    )


def compiled_or_recorded(compile_now: bool, model: str, topology: str, resolution: str, frames: int, *,
                         records: str | Path = DEFAULT_RECORDS, sharding: str = "tp", attention: str = "splash",
                         layers: int | None = None, mesh_shape: tuple[int, int] = (2, 4),
                         mask: str = "vector") -> dict[str, Any]:
    """One full-size dry-run as a dict: compiled now (`run`) when `compile_now` (a preset that
    compiles full size: minutes to tens of minutes on a CPU host), otherwise its record in
    `records` (what `tpupedia dryrun --record` wrote for the same model, slice, size, table,
    attention, mask, mesh and layers compiled). Raises `LookupError` naming the dry-run when none
    is recorded. Introduced in notebook `hunyuan_video`; notebook `hunyuan_tuning_and_i2v` reads
    its tables the same way."""
    if compile_now:
        return run(model, topology, resolution, frames, sharding=sharding, attention=attention, layers=layers,
                   mesh_shape=mesh_shape, mask=mask).as_dict()
    width, height = parse_resolution(resolution, 16)
    want = {"model": model, "topology": topology, "width": width, "height": height, "frames": frames,
            "sharding": sharding, "attention": attention, "mask": mask, "mesh": dict(zip(("dp", "tp"), mesh_shape))}
    for r in results.load(Path(records)):
        if all(r.get(k) == v for k, v in want.items()) \
                and r.get("layers_compiled") == (r.get("layers_full") if layers is None else layers):
            return r
    raise LookupError(f"no recorded dry-run of {want} with {layers or 'all'} layers compiled in {records}")


class _StandIn:
    """Attention replaced, for the compiler's estimate of everything else (`attention="standin"`):
    the output is the query plus the mean key and value, so the program still reads q, k and v
    and writes an output of the query's shape (the projections around attention stay in the
    program), without attention's FLOPs; each call's shape is recorded."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def _fn(self, q, k, v):
        import jax.numpy as jnp

        b, h, sq, d = q.shape
        self.calls.append([int(b), int(h), int(sq), int(k.shape[2]), int(d)])
        mean = jnp.mean(k, axis=(1, 2), keepdims=True) + jnp.mean(v, axis=(1, 2), keepdims=True)
        return (q + mean).astype(q.dtype)

    def attend(self, q, k, v, valid):  # noqa: ARG002 - a family's padded forward's signature
        from torchax.interop import call_jax

        return call_jax(self._fn, q, k, v)

    def install(self, env) -> None:
        from torchax.interop import call_jax

        from tpupedia.torchax_utils import SDPA_OPS

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,  # noqa: ARG001
                 enable_gqa=False):  # noqa: ARG001 - torch's signature
            return call_jax(self._fn, query, key, value)

        for op in SDPA_OPS:
            env.override_op_definition(op, sdpa)


def _install_splash(env, mesh, mask: str, block_sizes) -> None:
    """Route SDPA to the compiled (not interpreted) splash kernel, heads split over `tp`. `mask`
    is the family's mask structure (`FamilySpec.mask`), declared so that the splash path does
    not also compile a full-size reference branch for the run-time check (`tpupedia.attention`)."""
    from tpupedia import attention

    attention.install_attention(env, mesh=mesh, backend="splash", interpret=False, block_sizes=block_sizes,
                                mask_structure=mask, batch_axis="dp", head_axis="tp")


def _abstract_inputs(mesh, specs):
    from jax.sharding import NamedSharding

    return [aot.abstract(shape, dtype, NamedSharding(mesh, spec)) for shape, dtype, spec in specs]


def _record_key(r: dict[str, Any]) -> tuple:
    return (r["model"], r["topology"], r["width"], r["height"], r["frames"], r["tokens"], r["sharding"],
            r["attention"], r["layers_compiled"], tuple(sorted(r["mesh"].items())), r.get("mask"),
            tuple(r.get("block_sizes") or ()))


def record(report: DryRunReport, path: str = DEFAULT_RECORDS, command: str = "") -> Any:
    """Merge `report` into the dry-run results file the docs' results page renders."""
    import datetime as _dt

    data = report.as_dict() | {
        "compiled_at": _dt.date.today().isoformat(),
        "libtpu": results.version("libtpu") if devices.has_libtpu() else None,
        "command": command,
    }
    return results.merge(data, path, key=_record_key)


def _vae_report(spec: families.FamilySpec, topo, width: int, height: int, frames: int) -> DryRunReport:
    """One frame batch of a VAE decoder target (`spec.facts.dryrun_decoder`) on one chip."""
    import jax
    from jax.sharding import SingleDeviceSharding

    device = devices.tpu_topology(topo)[0]
    decode, args, tokens, note = spec.facts.dryrun_decoder(width, height, SingleDeviceSharding(device))
    # XLA's FLOP count of the same program lowered for the host (no compile, no data)
    host = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    total = aot.lowered_flops(jax.jit(decode).lower(*host))
    result = aot.compile_aot(decode, *args)
    flops = {"tokens": tokens, "linear": total, "attention": 0.0, "total": total}
    chip = topo.chip
    hbm = aot.hbm_budget([device])
    mem = result.memory
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args[0]))
    return DryRunReport(
        model=spec.name, topology=topo.name, chip=chip.name, num_chips=1, mesh={"chip": 1},
        sharding="replicated", attention="none", width=width, height=height, frames=frames,
        tokens=int(flops["tokens"]), layers_full=1, layers_compiled=1, hbm_bytes=hbm, fits=result.fits,
        arguments_bytes=mem.arguments if mem else None, temporaries_bytes=mem.temporaries if mem else None,
        outputs_bytes=mem.outputs if mem else None, oom_required_bytes=result.oom_required_bytes,
        oom_available_bytes=result.oom_available_bytes, collectives=result.collectives, flops=flops,
        roofline_seconds=max(flops["total"] / chip.bf16_flops, weights / chip.hbm_bytes_per_s),
        notes=[note],
    )
