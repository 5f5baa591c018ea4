"""Ahead-of-time compilation: compile for a TPU you do not have, and read what it would cost.

`jax.jit(f).lower(*abstract_args).compile()` needs only shapes, dtypes and shardings, never
data. Pointed at the devices of a TPU slice (`tpupedia.devices.tpu_topology`) it runs the
real TPU compiler on a CPU host and reports per-chip memory; a program too big for the chip
comes back as the compiler's own out-of-memory figures instead of an exception.

A compile for a topology cannot be stored by JAX's persistent compilation cache (there is no
TPU client on a CPU host to load it back), and the TPU compiler takes tens of seconds for one
layer of a video transformer. So `compile_aot` keeps what it read of each compile (the memory
per chip, the compiled HLO text, the compiler's cost analysis, or the out-of-memory figures) in
`$TPUPEDIA_AOT_CACHE` (default: `aot/` in the package's cache folder, `tpupedia.files.cache_dir`;
`off` keeps nothing), under a key made of the lowered program's text (`program_text`: the values of its
floating-point array constants, tables the host computed, left out), the devices it is
compiled for (kind, id, coordinates), the compiler options and flags, and the versions of jax,
jaxlib and libtpu: the same program for the same slice with the same compiler gives the same
answer, and any change to the program is a new key. A second `tpupedia plan` of the same run,
or a notebook's dry-run a test already compiled, reads the answer back in milliseconds. Programs
are lowered without source locations, so the key does not depend on where the project is checked
out (a Pallas kernel would otherwise name its file's path), and `make test` keeps every one a run used in
the repository (`tests/aot-kept`, trimmed to what a run used by `prune`).

Introduced in notebook `start_here` (start here); the dry-run planner of notebook `plan_without_tpu` builds on it.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from tpupedia import files

__all__ = [
    "hbm_budget",
    "MemoryPerChip",
    "AOTResult",
    "abstract",
    "compile_aot",
    "collective_counts",
    "collective_traffic",
    "CollectiveOp",
    "collective_ops",
    "format_bytes",
    "Program",
    "lowered_flops",
    "compiled_cost",
    "CACHE_ENV",
    "CachedCompile",
    "prune",
    "program_text",
]

CACHE_ENV = "TPUPEDIA_AOT_CACHE"
"""The environment variable naming the folder of `compile_aot`'s kept results (unset: `aot/` in
`tpupedia.files.cache_dir()`; `off`: none kept)."""

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OOM = re.compile(r"required for ([\w ]+?) \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")
_OOM_USED = re.compile(r"memory space hbm\. Used ([\d.]+)([KMG]) of ([\d.]+)([KMG]) hbm")  # libtpu's other wording
_VMEM = re.compile(r"Scoped allocation with size ([\d.]+)([KMG]) and limit ([\d.]+)([KMG])")
_GIB = 1024**3
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30}


def format_bytes(n: float) -> str:
    """Human-readable binary size: `format_bytes(3 * 2**30) == '3.00 GiB'`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class MemoryPerChip:
    """What one chip holds while the compiled program runs (bytes)."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int = 0
    code: int = 0

    @property
    def peak(self) -> int:
        """Arguments + outputs + temporaries - buffers donated to outputs (an upper estimate)."""
        return self.arguments + self.outputs + self.temporaries - self.aliased

    @classmethod
    def from_compiled(cls, compiled: Any) -> MemoryPerChip:
        m = compiled.memory_analysis()
        return cls(
            arguments=int(m.argument_size_in_bytes),
            outputs=int(m.output_size_in_bytes),
            temporaries=int(m.temp_size_in_bytes),
            aliased=int(m.alias_size_in_bytes),
            code=int(m.generated_code_size_in_bytes),
        )


@dataclass(frozen=True)
class AOTResult:
    """The outcome of one ahead-of-time compile: memory and collectives, or the OOM figures."""

    fits: bool
    memory: MemoryPerChip | None
    collectives: dict[str, int]
    oom_required_bytes: float | None = None
    oom_available_bytes: float | None = None
    oom_message: str = ""
    compiled: Any = None
    vmem_required_bytes: float | None = None
    vmem_limit_bytes: float | None = None
    compile_seconds: float | None = None
    """How long the compiler took for this program on the host that compiled it (kept with a
    cached compile, so a plan read back from the cache still knows it); `None` where unknown."""

    def summary(self) -> str:
        if self.fits and self.memory is not None:
            m = self.memory
            return (
                f"fits: arguments {format_bytes(m.arguments)}, outputs {format_bytes(m.outputs)}, "
                f"temporaries {format_bytes(m.temporaries)} per chip"
            )
        if self.vmem_required_bytes is not None and self.vmem_limit_bytes is not None:
            return (
                f"does not fit: a kernel needs {format_bytes(self.vmem_required_bytes)} of scoped "
                f"VMEM, the compiler's limit is {format_bytes(self.vmem_limit_bytes)}"
            )
        if self.oom_required_bytes is None or self.oom_available_bytes is None:
            return f"does not fit: {self.oom_message}"
        return (
            f"does not fit: needs {format_bytes(self.oom_required_bytes)} of temporaries, "
            f"{format_bytes(self.oom_available_bytes)} of HBM available per chip"
        )


@dataclass
class Program:
    """One program a run will execute, ready to compile ahead of time: `fn(*args)` where `args`
    are abstract (`abstract`, pytrees of them) and sharded over the target devices.

    The pipelines build these from the code they run (`tpupedia.plan` compiles them):
    `weights_bytes` is how much of the per-chip arguments are the stage's model weights (what
    stays resident if the pipeline keeps its models), `calls` how often one run calls it.
    """

    stage: str
    name: str
    fn: Callable[..., Any]
    args: tuple
    jit_kwargs: dict = field(default_factory=dict)
    weights_bytes: int = 0
    calls: int = 1
    component: str | None = None
    """The checkpoint component whose weights these are (`transformer`, `text_encoder`, ...)."""
    context: Callable[[], Any] | None = None
    """What must be in effect while `fn` is traced (e.g. the attention kernel a torchax
    environment routes SDPA to), as a context-manager factory."""

    def compile(self) -> "AOTResult":
        import contextlib

        with (self.context or contextlib.nullcontext)():
            return compile_aot(self.fn, *self.args, **self.jit_kwargs)

    def flops(self) -> float:
        """XLA's FLOP count of one call: the whole program, lowered, before it is split over
        devices (no compile). Notebook `hunyuan_tuning_and_i2v` compares a DeepCache step's two programs with it."""
        import contextlib

        import jax

        with (self.context or contextlib.nullcontext)():
            return lowered_flops(jax.jit(self.fn, **self.jit_kwargs).lower(*self.args))


def compiled_cost(result: AOTResult) -> dict[str, float] | None:
    """What the compiler's cost analysis says of one call of a compiled program, per chip (the
    program as partitioned and fused for the slice): `flops`, `bytes` (HBM bytes accessed) and
    `seconds`, the compiler's own time estimate (`optimal_seconds`); `None` where there is none (a
    program that did not compile, a compile not for a TPU). `seconds` is right for programs whose
    time is known (an elementwise op: its bytes over the HBM bandwidth) but comes out negative for
    a whole video-transformer layer, so `tpupedia.predict` times the counts instead. Notebook
    `plan_without_tpu` checks both."""
    cost = result.compiled.cost_analysis() if result.compiled is not None else None
    cost = cost[0] if isinstance(cost, list) and cost else cost
    if not cost or "optimal_seconds" not in cost:
        return None
    return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0)),
            "seconds": float(cost["optimal_seconds"])}


def lowered_flops(lowered: Any) -> float:
    """The FLOPs XLA's cost analysis counts in a lowered program (`jax.jit(f).lower(...)`)."""
    cost = lowered.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def abstract(shape: tuple[int, ...], dtype: Any, sharding: Any = None) -> Any:
    """A `jax.ShapeDtypeStruct`: an argument with a shape, a dtype and a sharding, and no data."""
    import jax

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Count collective operations (all-reduce, all-gather, ...) in compiled HLO text."""
    counts: Counter[str] = Counter()
    for name in _COLLECTIVES:
        # an instruction looks like `%x = bf16[..] all-reduce(...)` or `all-reduce-start(`
        counts[name] = len(re.findall(rf"\s{name}(?:-start)?\(", hlo_text))
    return {k: v for k, v in counts.items() if v}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=(?:\{\{([\d,]+)\}|\[\d+,(\d+)\]<=)")
# newer XLA prints mesh-axis groups: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")


def _group_size(line: str, devices: int) -> int:
    groups = _GROUPS.search(line)
    if groups:
        return len(groups.group(1).split(",")) if groups.group(1) else int(groups.group(2))
    mesh = _MESH_GROUPS.search(line)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(name, 1) for name in re.findall(r"'([^']+)'", mesh.group(2)))
    return devices


@dataclass(frozen=True)
class CollectiveOp:
    """One collective in a compiled program: its kind, result shapes, group size and bytes sent."""

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    group_size: int
    bytes_sent: float


def collective_ops(hlo_text: str, devices: int) -> list[CollectiveOp]:
    """Every collective in compiled HLO text, in program order, with what one chip sends.

    `shapes` are the result shapes (several when the compiler combined collectives into one);
    `bytes_sent` follows the ring estimates of `collective_traffic`. Reading shapes, not only
    counts, is what makes a check structural: "an all-reduce of the activations after every
    row-parallel layer" holds on every backend, an exact count does not (compilers combine and
    split collectives differently).
    """
    ops = []
    for line in hlo_text.splitlines():
        op = _OP.search(line)
        if not op or "=" not in line[: op.start()]:
            continue
        shape_text = line[line.index("=") + 1: op.start()]
        arrays = _ARRAY.findall(shape_text)
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        size = sum(_DTYPE_BYTES.get(dt, 4) * math.prod(shape) for (dt, _), shape in zip(arrays, shapes))
        n = _group_size(line, devices)
        kind = op.group(1)
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
                  "reduce-scatter": n - 1, "collective-permute": 1.0}[kind] if n > 1 else 0.0
        ops.append(CollectiveOp(kind, shapes, n, factor * size))
    return ops


def collective_traffic(hlo_text: str, devices: int) -> dict[str, float]:
    """Bytes one chip sends per call of the compiled program, per collective kind.

    Read from each collective's result shape in the compiled HLO and its replica-group size `n`
    (all devices when the groups are not spelled out), with the ring algorithm's traffic (the
    estimates of "How to Scale Your Model"): an all-reduce of `B` bytes sends `2 (n-1)/n B`, an
    all-gather or all-to-all `(n-1)/n B`, a reduce-scatter to `B` bytes `(n-1) B`, a
    collective-permute `B`. Group sizes are read from both of XLA's spellings of replica groups
    (explicit lists and mesh axes). Introduced in notebook `sharding` (sharding); notebook `beyond_one_host` uses it.
    """
    traffic: dict[str, float] = {}
    for op in collective_ops(hlo_text, devices):
        traffic[op.kind] = traffic.get(op.kind, 0.0) + op.bytes_sent
    return traffic


def compile_aot(fn: Callable[..., Any], *args: Any, **jit_kwargs: Any) -> AOTResult:
    """Lower and compile `fn` for the devices its abstract `args` are sharded over.

    Out-of-memory is a result (`fits=False` with the compiler's figures), not an exception:
    HBM (`oom_required_bytes`, `oom_available_bytes`) or a Pallas kernel's scoped VMEM
    (`vmem_required_bytes`, `vmem_limit_bytes`). Any other compile error propagates. A compile
    for TPU devices is read back from `$TPUPEDIA_AOT_CACHE` when the same program was compiled
    for the same devices before (the module docstring); `compiled` is then a `CachedCompile`.
    """
    import time

    import jax
    from jax._src import config

    # No source locations in the program: a Pallas kernel carries its Mosaic body as bytecode that
    # would name the file it was traced from (the virtual environment's path), and the key of a
    # kept compile must not depend on where the project is checked out. Codegen is unchanged.
    with config.traceback_in_locations_limit(0):
        lowered = jax.jit(fn, **jit_kwargs).lower(*args)
    key = _cache_key(lowered)
    kept = _cache_read(key)
    if kept is not None:
        return kept
    start = time.perf_counter()
    try:
        compiled = _compile_uncached(lowered)
    except Exception as err:  # jax raises JaxRuntimeError; match on the status text
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        m = _OOM.search(text)
        u = None if m else _OOM_USED.search(text)
        v = _VMEM.search(text)  # a Pallas kernel's tiles overflowing VMEM (CompileTimeScopedVmemOom)
        result = AOTResult(
            fits=False,
            memory=None,
            collectives={},
            oom_required_bytes=float(m.group(2)) * _GIB if m else float(u.group(1)) * _UNIT[u.group(2)] if u else None,
            oom_available_bytes=float(m.group(3)) * _GIB if m else float(u.group(3)) * _UNIT[u.group(4)] if u else None,
            oom_message=" ".join(line.strip() for line in text.strip().splitlines()[:2]),
            vmem_required_bytes=float(v.group(1)) * _UNIT[v.group(2)] if v else None,
            vmem_limit_bytes=float(v.group(3)) * _UNIT[v.group(4)] if v else None,
            compile_seconds=round(time.perf_counter() - start, 3),
        )
        _cache_write(key, result)
        return result
    seconds = round(time.perf_counter() - start, 3)
    result = AOTResult(
        fits=True,
        memory=MemoryPerChip.from_compiled(compiled),
        collectives=collective_counts(compiled.as_text()),
        compiled=compiled,
        compile_seconds=seconds,
    )
    _cache_write(key, result)
    return result


class CachedCompile:
    """What `compile_aot` kept of a compile (`$TPUPEDIA_AOT_CACHE`), standing in for the
    compiled executable where only its text and cost analysis are read."""

    def __init__(self, hlo_text: str, cost: dict[str, float] | None):
        self._text, self._cost = hlo_text, cost

    def as_text(self) -> str:
        return self._text

    def cost_analysis(self) -> dict[str, float] | None:
        return self._cost


def _compile_uncached(lowered: Any) -> Any:
    """`lowered.compile()` without JAX's persistent compilation cache: it cannot load a program
    compiled for a topology on a host without its chips, so writing one there costs time for
    nothing and reading it back warns."""
    import jax

    if _tpu_devices(lowered) and jax.config.jax_compilation_cache_dir:
        from jax._src import config

        with config.enable_compilation_cache(False):
            return lowered.compile()
    return lowered.compile()


def _tpu_devices(lowered: Any) -> list:
    """The TPU devices a lowered program is compiled for, in its device assignment's order."""
    lowering = getattr(lowered, "_lowering", None)  # jax 0.10: a MeshComputation
    found = getattr(lowering, "_device_list", None)
    if found is None:  # pragma: no cover - another jax's internals: the argument shardings' devices
        shardings = (getattr(lowering, "compile_args", None) or {}).get("in_shardings", ())
        found = [d for s in shardings for d in getattr(s, "_device_assignment", ())]
    return [d for d in found if getattr(d, "platform", "") == "tpu"]


def _versions() -> str:
    from importlib import metadata

    found = []
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            found.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name}=none")
    return " ".join(found)


def _cache_folder() -> str | None:
    folder = os.environ.get(CACHE_ENV, "")
    if folder.lower() in ("off", "0", "none"):
        return None
    return folder or str(files.cache_dir() / "aot")


# A floating-point array constant in a lowered program: `dense<[...]>` or hex `dense<"0x...">`
# followed by its type, whose element type is a float (f16, bf16, f32, f64). Scalars and splats
# (`dense<1.000000e+00>`) are not matched.
_FLOAT_ARRAY = re.compile(r'dense<(?:\[[^<>]*\]|"0x[0-9A-Fa-f]+")>(\s*:\s*tensor<[^<>]*x(?:bf16|f\d+\w*)>)')


def program_text(text: str) -> str:
    """A lowered program's text as the kept results' key reads it: each floating-point array
    constant's values replaced by `ARRAY`, its shape and dtype kept.

    Such constants are tables the host computed while tracing (a scheduler's sigmas and
    coefficients, RoPE frequencies), and their last bits depend on the host's vector kernels:
    the same Wan step traced with PyTorch's and NumPy's AVX2 kernels and again with their
    portable ones differs in a few ulp of its UniPC tables (-0.00722592743 against
    -0.00722592836), which made the key of every such compile differ between two hosts of one
    kind, so a fresh clone recompiled them. Their values change neither the memory a program
    needs nor how it is sharded, which is what a kept compile answers; a scalar constant, a shape
    or a dtype still changes the key."""
    return _FLOAT_ARRAY.sub(r"dense<ARRAY>\1", text)


def _cache_key(lowered: Any) -> str | None:
    """The key of a compile in the kept results (`_cache_folder`): the lowered program with its
    floating-point array constants' values left out (`program_text`), the TPU devices it is
    compiled for (kind, id, coordinates, process), the compiler options, the flags that reach the
    TPU compiler (`_tpu_flags`), and the compiler's versions; None when nothing is kept or the
    program is not for TPU devices."""
    if _cache_folder() is None:
        return None
    chips = _tpu_devices(lowered)
    if not chips:
        return None
    where = [f"{d.device_kind}|{d.id}|{getattr(d, 'coords', '')}|{getattr(d, 'core_on_chip', '')}|{d.process_index}"
             for d in chips]
    options = repr(getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", ()))
    flags = " ".join(f"{k}={_tpu_flags(os.environ.get(k, ''))}" for k in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"))
    digest = hashlib.sha256()
    for part in (_versions(), "\n".join(where), options, flags, program_text(lowered.as_text())):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _tpu_flags(flags: str) -> str:
    """The flags of `flags` that can change a TPU compile: all but XLA's CPU backend's
    (`--xla_cpu_*`, `--xla_force_host_platform_device_count`), which only the host's programs read."""
    return " ".join(f for f in flags.split()
                    if not f.startswith(("--xla_cpu_", "--xla_force_host_platform_device_count")))


def _cache_path(key: str) -> str:
    return os.path.join(_cache_folder(), key[:2], f"{key}.json.gz")


def _cache_read(key: str | None) -> AOTResult | None:
    """The kept result of compile `key`, or None (none kept, or an entry that does not parse)."""
    if key is None:
        return None
    try:
        path = _cache_path(key)
        with gzip.open(path, "rt") as f:
            kept = json.load(f)
        memory = MemoryPerChip(**kept["memory"]) if kept["memory"] else None
        compiled = CachedCompile(kept["hlo"], kept["cost"]) if kept["hlo"] is not None else None
        rest = {k: v for k, v in kept.items() if k not in ("memory", "hlo", "cost", "seconds")}
        result = AOTResult(memory=memory, compiled=compiled, compile_seconds=kept.get("seconds"), **rest)
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # read now: `prune` keeps what a run used
    return result


def _cache_write(key: str | None, result: AOTResult) -> None:
    if key is None:
        return
    cost = None
    if result.compiled is not None:
        try:
            raw = result.compiled.cost_analysis()
            raw = raw[0] if isinstance(raw, list) else raw
            cost = {k: float(v) for k, v in (raw or {}).items()}
        except Exception:  # noqa: BLE001 - a cost analysis the compiler cannot give is not kept
            cost = None
    kept = {f.name: getattr(result, f.name) for f in fields(result)
            if f.name not in ("memory", "compiled", "compile_seconds")}
    kept |= {"memory": asdict(result.memory) if result.memory else None,
             "hlo": result.compiled.as_text() if result.compiled is not None else None, "cost": cost,
             "seconds": result.compile_seconds or 0.0}
    path = _cache_path(key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    files.write_atomic(path, lambda tmp: tmp.write_bytes(gzip.compress(json.dumps(kept).encode(), 1)))


def prune(folder: str | os.PathLike, since: float, min_seconds: float = 0.0) -> int:
    """Remove from the kept compiles in `folder` those not read or written since `since` (a
    `time.time()`), those that do not parse, and those that took the compiler less than
    `min_seconds`; returns how many were removed. `make test` keeps the project's compiles in the
    repository this way (`tests/aot-kept`): what its last run used, however cheap."""
    removed = 0
    for path in sorted(glob.glob(os.path.join(folder, "??", "*.json.gz"))):
        try:
            stale = os.path.getmtime(path) < since
            if not stale:  # read it: an entry that does not parse goes too
                with gzip.open(path, "rt") as f:
                    stale = json.load(f).get("seconds", 0.0) < min_seconds
        except (OSError, ValueError, EOFError):
            stale = True
        if stale:
            os.unlink(path)
            removed += 1
    for sub in glob.glob(os.path.join(folder, "??")):
        with contextlib.suppress(OSError):
            os.rmdir(sub)  # only if empty
    return removed


_BUDGETS: dict[str, float] = {}


def hbm_budget(devices) -> float:
    """Bytes of HBM the TPU compiler lets one program use per chip of `devices` (a topology).

    Measured, not looked up: compile a program that cannot fit (the float32 softmax of a
    131,072 x 131,072 score matrix, 64 GiB) and read the compiler's "available HBM" figure.
    Cached per device kind.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    device = list(devices)[0]
    key = device.device_kind
    if key not in _BUDGETS:
        mesh = Mesh([device], ("x",))
        q = abstract((131_072, 128), jnp.bfloat16, NamedSharding(mesh, P()))
        result = compile_aot(lambda a, b: jax.nn.softmax((a @ b.T).astype(jnp.float32), axis=-1), q, q)
        if result.fits or result.oom_available_bytes is None:  # pragma: no cover - defensive
            raise RuntimeError(f"could not measure the HBM budget of {device.device_kind}")
        _BUDGETS[key] = result.oom_available_bytes
    return _BUDGETS[key]
