"""Where code runs: platform detection, simulated CPU devices, meshes, and TPU topologies for AOT.

Three facts shape this module:

* JAX reads its device set-up once, when the first backend initialises. Simulating 8 CPU
  devices therefore has to happen *before* anything touches `jax.devices()`;
  `simulate_cpu_devices` checks this and fails loudly instead of silently giving 1 device.
* `jax.make_mesh` defaults to explicit axis types in jax 0.10, which torchax's op lowerings do
  not handle; `make_mesh` always builds `AxisType.Auto` meshes (GSPMD propagation).
* With `libtpu` installed (`pip install 'jax[tpu]'`) a CPU-only host can describe a TPU slice
  and compile programs for it ahead of time. `tpu_topology` returns such a slice's devices,
  keeping libtpu's start-up warnings off stderr on hosts that have no TPU.

Introduced in notebook `start_here` (start here).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tpupedia.errors import TpupediaError
from tpupedia.hardware import HardwareError, Topology, parse_topology

if TYPE_CHECKING:  # pragma: no cover
    import jax

__all__ = [
    "DeviceSetupError",
    "MeshShapeError",
    "AOTUnavailableError",
    "has_libtpu",
    "tpu_present",
    "quiet_libtpu",
    "simulate_cpu_devices",
    "tiny_platforms",
    "kernel_chip",
    "chip_error",
    "platform",
    "make_mesh",
    "default_mesh_shape",
    "interpret_kernels",
    "tpu_topology",
    "host_bounds",
    "topology_mesh",
    "live_bytes",
]


class DeviceSetupError(TpupediaError, RuntimeError):
    """Devices were requested after JAX had already fixed its device set."""


class MeshShapeError(TpupediaError, ValueError):
    """A mesh shape whose product does not match the number of devices."""


class AOTUnavailableError(TpupediaError, RuntimeError):
    """TPU ahead-of-time compilation needs libtpu, which is not installed."""


def has_libtpu() -> bool:
    """Whether the `libtpu` package (shipped by `jax[tpu]`) is importable."""
    return importlib.util.find_spec("libtpu") is not None


def tpu_present() -> bool:
    """Whether this host has TPU chips attached (device nodes of a TPU VM)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _backends_initialized() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover
        return False
    return bool(xla_bridge.backends_are_initialized())


def quiet_libtpu() -> None:
    """On a host with libtpu but no TPU, stop libtpu from probing for one.

    Without this, the first use of libtpu prints warnings with timestamps and process ids to
    stderr ("could not determine TPU accelerator type" and friends), which is noise for a reader
    and poison for notebook output comparison. On a TPU VM this does nothing.
    """
    if tpu_present() or not has_libtpu():
        return
    # libtpu takes /tmp/libtpu_lockfile so two processes cannot share a chip; with no chip
    # attached there is nothing to protect, and AOT compiles in parallel processes must coexist.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v6e-8")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if "JAX_PLATFORMS" not in os.environ and not _backends_initialized():
        # Let JAX pick a GPU if one is installed; never the (absent) TPU.
        gpu = importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec(
            "jax_cuda13_plugin"
        )
        os.environ["JAX_PLATFORMS"] = "cuda,cpu" if gpu else "cpu"


def simulate_cpu_devices(n: int = 8, chip: bool = False) -> list[jax.Device]:
    """Make JAX see `n` CPU devices, so sharded programs run on a laptop or in CI.

    Must run before JAX initialises a backend (before the first `jax.devices()`, array or jit).
    Returns the CPU devices. Raises `DeviceSetupError` if JAX has already chosen its devices
    and they are not `n` CPU devices.

    `chip`: on a host with TPU chips attached (Colab's v5e-1, Kaggle's v5e-8, a one-chip VM), keep them as a
    second backend beside the CPU devices. CPU stays the default backend (listed first in
    `jax_platforms`), so `jax.devices()`, meshes and models are the `n` CPU devices as on a laptop,
    while `kernel_chip()` returns the (first) chip for the Pallas kernels notebook `splash_attention` compiles
    on it. If JAX cannot open the chip (another process holds it, say), this warns once, says why,
    and goes on with the CPU devices alone; `chip_error()` keeps the reason.
    """
    if n < 1:
        raise ValueError(f"simulate_cpu_devices needs n >= 1, got {n}")
    import jax

    if _backends_initialized():
        devices = jax.devices()
        if len(devices) == n and devices[0].platform == "cpu":
            return devices
        raise DeviceSetupError(
            f"JAX already initialised with {len(devices)} {devices[0].platform} device(s); "
            f"call simulate_cpu_devices({n}) before any JAX computation (restart the kernel)"
        )
    quiet_libtpu()
    platforms = tiny_platforms(chip)
    os.environ["JAX_PLATFORMS"] = platforms
    jax.config.update("jax_platforms", platforms)
    jax.config.update("jax_num_cpu_devices", n)
    _CHIP_ERROR.clear()
    try:
        devices = jax.devices()
    except RuntimeError as err:  # the chip would not open: JAX has the CPU backend, not the TPU
        if platforms == "cpu":
            raise
        _CHIP_ERROR.append(str(err).splitlines()[0])
        import warnings

        warnings.warn(f"a TPU chip is attached but JAX could not open it ({_CHIP_ERROR[0]}); "
                      f"going on with {n} CPU devices and Pallas kernels in interpret mode", RuntimeWarning,
                      stacklevel=2)
        import jax.extend.backend

        jax.extend.backend.clear_backends()
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")
        devices = jax.devices()
    if len(devices) != n or devices[0].platform != "cpu":  # pragma: no cover - defensive
        raise DeviceSetupError(f"asked for {n} simulated CPU devices, JAX made {len(devices)} {devices[0].platform}")
    return devices


_CHIP_ERROR: list[str] = []


def tiny_platforms(chip: bool) -> str:
    """The `jax_platforms` the simulated devices ask for: `"cpu"`, or `"cpu,tpu"` when `chip` is
    asked for and this host has a TPU chip and libtpu. The first platform listed is JAX's default,
    so the CPU devices stay where arrays, meshes and models go."""
    return "cpu,tpu" if chip and tpu_present() and has_libtpu() else "cpu"


def kernel_chip() -> jax.Device | None:
    """The TPU chip Pallas kernels can compile on: the default device on a TPU, the chip kept
    beside simulated CPU devices (`simulate_cpu_devices(chip=True)`), or `None` where there is
    no TPU (kernels then run in interpret mode). Introduced in notebook `splash_attention`."""
    import jax

    try:
        return jax.local_devices(backend="tpu")[0]
    except RuntimeError:  # "Unknown backend tpu": JAX was not asked for one, or could not open it
        return None


def chip_error() -> str | None:
    """Why JAX could not open the TPU chip `simulate_cpu_devices(chip=True)` found, or `None`."""
    return _CHIP_ERROR[0] if _CHIP_ERROR else None


def platform() -> str:
    """`"tpu"`, `"gpu"` or `"cpu"`: the platform JAX computes on by default."""
    import jax

    return jax.default_backend()


def default_mesh_shape(device_count: int) -> tuple[int, int]:
    """`(dp, tp)` for the devices present: dp=2 (a batch of two, such as a guidance pair) when
    they split evenly, tp the rest. Eight TPU chips or eight simulated CPU devices give (2, 4);
    one GPU gives (1, 1), four give (2, 2). Notebooks and pipelines build their meshes from this,
    so the same cell runs on any device count."""
    return (2, device_count // 2) if device_count >= 2 and device_count % 2 == 0 else (1, device_count)


def live_bytes() -> dict[str, int]:
    """Bytes of live JAX arrays on each of this process's devices, by `str(device)`, from
    `jax.live_arrays()`: what a device holds now, counted shard by shard. Devices that hold
    nothing are listed with 0. The pipelines' memory tests read it before and after a stage."""
    import jax

    held, seen = {str(d): 0 for d in jax.local_devices()}, set()
    for array in jax.live_arrays():
        if array.is_deleted():
            continue
        for shard in array.addressable_shards:
            data = shard.data
            key = (str(shard.device), data.unsafe_buffer_pointer())
            if key not in seen:  # an array assembled from single-device arrays shares their buffers
                seen.add(key)
                held[key[0]] = held.get(key[0], 0) + data.nbytes
    return held


def interpret_kernels() -> bool:
    """Whether Pallas TPU kernels must run in interpret mode here: everywhere but on a TPU (a
    GPU cannot run Mosaic TPU kernels either). Introduced in notebook `splash_attention`."""
    return platform() != "tpu"


def make_mesh(
    shape: Sequence[int],
    axis_names: Sequence[str],
    devices: Sequence[jax.Device] | None = None,
) -> jax.sharding.Mesh:
    """A device mesh with `AxisType.Auto` axes (what torchax needs), over `devices`.

    `devices` defaults to all of `jax.devices()`. A shape whose product differs from the
    number of devices raises `MeshShapeError` naming both.
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    shape = tuple(int(s) for s in shape)
    axis_names = tuple(axis_names)
    if len(shape) != len(axis_names):
        raise MeshShapeError(
            f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names {axis_names}"
        )
    devices = list(jax.devices() if devices is None else devices)
    if math.prod(shape) != len(devices):
        raise MeshShapeError(
            f"mesh shape {shape} needs {math.prod(shape)} devices, but {len(devices)} are "
            f"available ({devices[0].platform} x{len(devices)}); choose a shape whose product "
            f"is {len(devices)}"
        )
    auto = (AxisType.Auto,) * len(shape)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, axis_names, axis_types=auto)
    try:  # topology-aware order (neighbouring chips along each mesh axis) where JAX knows one
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, axis_names, axis_types=auto)


def tpu_topology(name: str | Topology = "v6e:2x4") -> list[jax.Device]:
    """The devices of a TPU slice such as `"v6e:2x4"`, for ahead-of-time compilation.

    Works on any host with libtpu installed, TPU or not: the devices are descriptions that
    `jax.jit(f).lower(...).compile()` can target, not chips you can run on. Raises
    `AOTUnavailableError` (with the install command) when libtpu is missing, and
    `tpupedia.hardware.HardwareError` for a malformed name. Takes the name or a parsed
    `tpupedia.hardware.Topology`.
    """
    topo = name if isinstance(name, Topology) else parse_topology(name)  # validate before touching libtpu
    if not has_libtpu():
        raise AOTUnavailableError(
            "TPU ahead-of-time compilation needs libtpu: pip install 'jax[tpu]==0.10.2' "
            "(it also runs on CPU-only hosts)"
        )
    quiet_libtpu()
    from jax.experimental import topologies

    bounds = host_bounds(topo)
    extra = {} if bounds is None else {"chips_per_host_bounds": bounds}
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=topo.name, **extra).devices)
    except Exception as err:  # noqa: BLE001 - libtpu refuses a shape with a JaxRuntimeError (INVALID_ARGUMENT)
        raise HardwareError(
            f"topology {topo.name!r}: libtpu refuses it ({str(err).splitlines()[0]}); a slice is one chip "
            f"({topo.chip.name}:1x1), a 1x2 pair, or whole 2x2 hosts ({topo.chip.name}:2x2, "
            f"{topo.chip.name}:2x4, {topo.chip.name}:4x4, ...)"
        ) from None


def host_bounds(topo: Topology) -> tuple[int, ...] | None:
    """The `chips_per_host_bounds` libtpu needs to lay `topo` out in the VMs it really has, or
    `None` for libtpu's default.

    libtpu's default host is 2x2 chips (2x2x1 on v5p and TPU7x). That is right for a multi-host
    slice, whose VMs hold 4 chips each, but not for a one-VM slice of another size: by default
    libtpu refuses a single chip ("v5e:1x1 is not divisible by ... 2x2x1") and describes a
    v6e-8 or a v5e-8, one 8-chip VM (`Topology.hosts`), as two processes of 4 chips. A slice on
    one VM gets its own shape as its bounds, so its devices are one process, as on the VM.
    Used by notebook `plan_without_tpu`'s compiles and every plan."""
    if topo.hosts != 1:
        return None
    bounds = tuple(topo.shape) + (1,) * (3 - len(topo.shape))
    return None if bounds == (2, 2, 1) else bounds


def topology_mesh(
    name: str | Topology, shape: Sequence[int] | None, axis_names: Sequence[str]
) -> jax.sharding.Mesh:
    """An Auto-axis mesh over the devices of TPU slice `name` (default shape: the slice's)."""
    topo = name if isinstance(name, Topology) else parse_topology(name)
    return make_mesh(topo.shape if shape is None else shape, axis_names, devices=tpu_topology(topo))
