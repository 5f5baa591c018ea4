"""Beyond one host: JAX's multi-controller runtime, and a local launcher that imitates a slice.

A multi-host TPU slice (v6e-16 and up) runs one copy of the same program on every host; each
process sees its own chips (`jax.local_devices()`) and, after `jax.distributed.initialize()`,
all of them (`jax.devices()`), so a mesh built from `jax.devices()` spans the slice and a jitted
function runs as one SPMD program with collectives between hosts. This module is that set-up,
and nothing hand-made on top of it:

* `initialize()`: on a TPU host, `jax.distributed.initialize()` with no arguments (the TPU
  environment, its variables or a queued-resource VM's metadata, supplies coordinator, count and
  rank; a host on its own is one process); locally, from `TPUPEDIA_COORDINATOR`,
  `TPUPEDIA_NUM_PROCESSES`, `TPUPEDIA_PROCESS_ID` and `TPUPEDIA_DEVICES_PER_PROCESS`, with
  CPU collectives over gloo; otherwise a no-op describing one process.
* `launch(...)`: `tpupedia launch --local-processes N --devices-per-process D -- COMMAND`
  starts N local processes with those variables, so one CPU host runs a real multi-controller
  job (each process's output prefixed with its id); a failing process stops the others.
* `is_leader()`, `barrier(name)`: process 0 writes shared outputs; everyone waits for it.
* `leader_decides(values)`, `on_leader(fn)`, `broadcast_tensors(tensors)`, `gather_bytes(data)`: the hosts of a slice
  share no disk, so process 0 decides, every process gets the tensors. Only process 0 looks at
  files (is a stage done? read it; write it); what it decides and reads is broadcast, and what
  fails there fails on every process, instead of each host deciding from its own disk (the
  others crash on files they do not have, or run a collective process 0 skipped, and hang).

Introduced in notebook `beyond_one_host` (beyond one host); `tpupedia generate` calls `initialize()`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

from tpupedia.errors import TpupediaError

__all__ = [
    "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_DEVICES_PER_PROCESS",
    "DistributedError", "Processes", "requested", "initialize", "is_leader", "barrier", "leader_decides", "on_leader",
    "broadcast_tensors", "gather_bytes", "free_port", "stop", "launch", "check",
]

ENV_COORDINATOR = "TPUPEDIA_COORDINATOR"
ENV_NUM_PROCESSES = "TPUPEDIA_NUM_PROCESSES"
ENV_PROCESS_ID = "TPUPEDIA_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "TPUPEDIA_DEVICES_PER_PROCESS"
T = TypeVar("T")


class DistributedError(TpupediaError, RuntimeError):
    """A multi-process set-up that cannot start (bad variables, JAX already running, a failed process)."""


@dataclass(frozen=True)
class Processes:
    """What this process sees after `initialize()`."""

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int


def requested() -> bool:
    """Whether the local multi-process variables are set (by `launch` or by hand)."""
    return ENV_COORDINATOR in os.environ


def _on_multihost_tpu() -> bool:
    """Whether the environment variables name several TPU hosts (or a multislice coordinator)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def _on_tpu_host() -> bool:
    """Whether JAX should be asked to join a TPU slice: the variables say so, or this host has TPU
    chips (and `JAX_PLATFORMS`, if set, allows the TPU). A queued-resource TPU VM names its workers
    in the VM's metadata, not in variables: `jax.distributed.initialize()` reads either."""
    from tpupedia import devices

    if _on_multihost_tpu():
        return True
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms and "tpu" not in platforms.split(","):
        return False
    return devices.tpu_present()


def _describe() -> Processes:
    import jax

    return Processes(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def initialize() -> Processes:
    """Join the multi-controller job this process belongs to (see the module docstring).

    Must run before JAX starts a backend; raises `DistributedError` naming what is wrong.
    """
    import jax

    from tpupedia import devices

    if not requested() and not _on_tpu_host():
        return _describe()
    tpu = not requested()
    if tpu and jax.distributed.is_initialized():  # joined already (a second call)
        return _describe()
    if devices._backends_initialized():
        if tpu and not _on_multihost_tpu():
            return _describe()  # JAX already runs on this host's chips, and no variable names other hosts
        raise DistributedError("JAX already started its devices; call distributed.initialize() first "
                               "(before any array, jit or jax.devices())")
    if tpu:  # the TPU environment (variables or the VM's metadata) names the coordinator, count and rank
        try:
            jax.distributed.initialize()
        except ValueError as err:  # JAX found no cluster to join: a TPU host on its own
            if _on_multihost_tpu():
                raise DistributedError(f"the TPU variables name several hosts, but JAX cannot join them: {err}") from None
        except RuntimeError as err:  # the metadata server did not answer, or the coordinator did not start
            raise DistributedError(f"joining the TPU slice failed: {err}") from None
        return _describe()
    try:
        count = int(os.environ[ENV_NUM_PROCESSES])
        rank = int(os.environ[ENV_PROCESS_ID])
        per_process = int(os.environ.get(ENV_DEVICES_PER_PROCESS, "1"))
    except (KeyError, ValueError) as err:
        raise DistributedError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be "
                               f"integers ({type(err).__name__}: {err})") from None
    if not (count >= 1 and 0 <= rank < count and per_process >= 1):
        raise DistributedError(f"process {rank} of {count} with {per_process} devices each: need 0 <= id < count")
    devices.quiet_libtpu()
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", per_process)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=os.environ[ENV_COORDINATOR], num_processes=count, process_id=rank)
    return _describe()


def is_leader() -> bool:
    """True in process 0, the one that writes shared outputs (stage files, videos, manifests)."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches `barrier(name)` (a no-op in a one-process job)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def leader_decides(values: Sequence[int]) -> list[int]:
    """Process 0's `values` (small integers, int32) on every process; the identity with one process.

    Every process passes a list of the same length; only process 0's entries count. What process
    0 alone can know (which stage files on its disk are up to date) must be what every process
    acts on: processes deciding each from its own disk run different collectives and wait for
    each other forever."""
    import jax
    import numpy as np

    values = [int(v) for v in values]
    if jax.process_count() == 1 or not values:
        return values
    from jax.experimental import multihost_utils

    return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))]


def on_leader(fn: Callable[[], T]) -> T | None:
    """`fn()` run by process 0 alone (the others get None); if it raises, every process raises.

    Process 0 re-raises its error, the others a `DistributedError` quoting it: without this, an
    error on process 0 (a damaged stage file, a full disk) leaves the others waiting in their next
    collective until a timeout. Also a barrier. With one process, just `fn()`."""
    import jax

    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if is_leader():
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others heard of it
            error = err
    if leader_decides([error is not None])[0]:
        text = _broadcast_bytes(f"{type(error).__name__}: {error}".encode() if is_leader() else None).decode()
        if error is not None:
            raise error
        raise DistributedError(f"process 0 failed, so process {jax.process_index()} stops too: {text}")
    return result


def broadcast_tensors(tensors: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """Process 0's dict of torch CPU tensors on every process (the others pass None), with the same
    names, shapes, dtypes and bits (bf16 included): it travels as its safetensors bytes. With one
    process, `tensors` itself."""
    import jax

    if jax.process_count() == 1:
        if tensors is None:
            raise DistributedError("broadcast_tensors: process 0 has no tensors to send (None)")
        return tensors
    from safetensors.torch import load, save

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}) if is_leader() else None
    return load(_broadcast_bytes(data))


def gather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data` on every process, in process order (`[data]` with one process): the
    lengths first, then the bytes as zero-padded 32-bit words, one row per process. For small
    things every process made (a batch's manifest lines), which process 0 alone then writes."""
    import jax

    if jax.process_count() == 1:
        return [data]
    import numpy as np
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
    words = max(1, -(-int(sizes.max()) // 4))
    rows = np.asarray(multihost_utils.process_allgather(np.frombuffer(data.ljust(4 * words, b"\0"), np.uint32)))
    return [rows[i].tobytes()[:int(size)] for i, size in enumerate(sizes)]


_CHUNK = 1 << 26  # bytes per collective (a multiple of 4): bounded device memory, one compiled broadcast per size


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass None): its length first, so that every
    process offers arrays of the same shapes, then the bytes, a chunk at a time, as 32-bit words
    (zero-padded): the broadcast is a sum in which only process 0 adds anything but zeros, and a
    32-bit integer sum is one every backend's collectives have."""
    import numpy as np
    from jax.experimental import multihost_utils

    full, rest = leader_decides(divmod(len(data), _CHUNK) if is_leader() else (0, 0))
    parts, start = [], 0
    for size in [_CHUNK] * full + ([rest] if rest else []):
        words = -(-size // 4)
        if is_leader():
            mine = np.frombuffer(data[start:start + size].ljust(4 * words, b"\0"), np.uint32)
        else:
            mine = np.zeros(words, np.uint32)
        parts.append(np.asarray(multihost_utils.broadcast_one_to_all(mine)).tobytes()[:size])
        start += size
    return b"".join(parts)


def check() -> list[str]:
    """What this process sees of one global array: the job, its devices, the shards it holds,
    and a jitted sum over every process's data. The lines `tpupedia distributed-check` prints on
    each host (or local process); every process prints the same total."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpupedia import devices

    me = initialize()
    mesh = devices.make_mesh((me.num_processes, me.global_devices // me.num_processes), ("hosts", "chips"))
    full = np.arange(me.global_devices * 2, dtype=np.float32).reshape(me.global_devices, 2)
    array = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P(("hosts", "chips"))), lambda i: full[i])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(array)
    rows = sorted(int(s.index[0].start) for s in array.addressable_shards)
    return [f"process {me.process_id} of {me.num_processes}: {me.local_devices} local of {me.global_devices} devices",
            f"  global array {array.shape}, fully addressable here: {array.is_fully_addressable}; rows held here: {rows}",
            f"  jitted sum over all processes: {float(total):.0f} (expected {float(full.sum()):.0f})"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        # gloo's start-up chatter ("[Gloo] Rank 3 is connected to 7 peer ranks ..."), written to
        # the process's stdout by several threads at once, so it can arrive cut into pieces
        if "[Gloo]" in line or "peer ranks" in line or line.strip().isdigit():
            continue
        out.write(f"{prefix}{line}")
        out.flush()


def stop(children: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every child still running, then SIGKILL whichever still runs `grace_s` later.

    The escalation is needed: a process that has joined `jax.distributed` does not end on
    SIGTERM, because JAX's preemption notifier catches it (it logs "SIGTERM caught") and the
    process goes on until a collective with its dead peer times out (gloo's 30 s key-value
    timeout, then more), which left a job running about 90 s after one of its processes died."""
    running = [c for c in children if c.poll() is None]
    for child in running:
        child.terminate()
    deadline = time.monotonic() + grace_s
    while any(c.poll() is None for c in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in running:
        if child.poll() is None:
            child.kill()
            child.wait()


_RUNS_MODELS = (("generate",), ("bench", "generate"), ("bench", "deepcache"), ("bench", "stepcache"))


def flag_value(command: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in `command` (`--flag VALUE` or `--flag=VALUE`; the last one wins)."""
    found = None
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            found = command[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def runs_models(command: Sequence[str]) -> tuple[str, ...] | None:
    """The words of `_RUNS_MODELS` that `command` starts with (a command that runs a family's
    models, whose family name follows them), or `None`."""
    return next((w for w in _RUNS_MODELS if tuple(command[:len(w)]) == w), None)


def check_launched(command: Sequence[str], hub_checkpoint: str | None = None) -> None:
    """Refuse a launched command that would run released models on the host CPU, which cannot run
    them whole: the full preset's (`Preset.host_runs_whole_models`), or `hub_checkpoint`, a hub
    checkpoint the command names (`tpupedia launch` finds it with the family's `named_source`: a
    tiny checkpoint is a folder, and `generate` runs a hub id with the full preset's request).
    Every launched process runs on simulated CPU devices (`initialize`), on a TPU VM too, so the
    released checkpoints would quietly take hours to days of CPU time. The preset is
    `--preset NAME` in the command, else `$TPUPEDIA_PRESET`, which the processes inherit."""
    from tpupedia import devices, presets

    if runs_models(command) is None:
        return
    name = flag_value(command, "--preset")
    preset = presets.get(name) if name else presets.current()
    if preset.host_runs_whole_models and not hub_checkpoint:
        return
    what = f"the hub checkpoint {hub_checkpoint}'s" if hub_checkpoint else f"the {preset.name} preset's"
    where = ("on this TPU VM run the command itself, without launch (on every host of a multi-host slice: "
             "it joins the slice)" if devices.tpu_present() else
             "this host has no TPU: run it on a TPU VM, without launch")
    raise DistributedError(f"launch runs every process on simulated CPU devices, so {what} "
                           f"models would run on the host CPU (hours to days); use --preset tiny, or {where}")


def launch(command: Sequence[str], processes: int, devices_per_process: int, grace_s: float = 5.0,
           out=None, err=None, cwds: Sequence[str | os.PathLike] | None = None,
           timeout_s: float | None = None, hub_checkpoint: str | None = None) -> int:
    """Run `python -m tpupedia.cli COMMAND` as `processes` local processes of one JAX job.

    Each line a process writes to stdout (stderr) goes to `out` (`err`), prefixed with `[pN] `,
    whole lines only. Returns 0 when every process succeeds;
    otherwise stops the others at once (a multi-controller job cannot finish without all of them;
    `stop`: SIGTERM, then SIGKILL after `grace_s`) and raises `DistributedError` naming the first
    process that failed and its exit status.

    `cwds`, one folder per process (default: this one's), runs each process in its own folder,
    so a relative path (`--workdir runs`) names a different folder in each, as on hosts that
    share no disk. A job still running after `timeout_s` is stopped the same way, and named.
    A command that would run the full preset's models, or `hub_checkpoint`'s, is refused before
    any process starts: the processes run on CPU devices (`check_launched`).
    """
    if processes < 1 or devices_per_process < 1:
        raise DistributedError(f"--local-processes {processes} and --devices-per-process {devices_per_process} "
                               "must be positive")
    if not command:
        raise DistributedError("nothing to launch: give the tpupedia command after --")
    if cwds is not None and len(cwds) != processes:
        raise DistributedError(f"{len(cwds)} working folders for {processes} processes: give one per process")
    check_launched(command, hub_checkpoint)
    out, err = out or sys.stdout, err or sys.stderr
    port = free_port()
    children, relays = [], []
    for rank in range(processes):
        env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                                  ENV_PROCESS_ID: str(rank), ENV_DEVICES_PER_PROCESS: str(devices_per_process)})
        child = subprocess.Popen([sys.executable, "-m", "tpupedia.cli", *command], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=1,
                                 cwd=None if cwds is None else cwds[rank])
        for stream, sink in ((child.stdout, out), (child.stderr, err)):
            relay = threading.Thread(target=_relay, args=(stream, f"[p{rank}] ", sink), daemon=True)
            relay.start()
            relays.append(relay)
        children.append(child)
    failed, timed_out, deadline = None, False, None if timeout_s is None else time.monotonic() + timeout_s
    while any(c.poll() is None for c in children):
        if deadline is not None and time.monotonic() > deadline:
            stop(children, grace_s)
            timed_out = True
            break
        if failed is None:
            failed = next(((rank, c.returncode) for rank, c in enumerate(children) if c.poll() not in (None, 0)), None)
            if failed is not None:  # the others cannot finish without it: stop them now
                stop(children, grace_s)
        time.sleep(0.1)
    for relay in relays:
        relay.join(timeout=5)
    if timed_out:
        raise DistributedError(f"the job of {processes} processes still ran after {timeout_s} s; it was stopped")
    if failed is None:
        failed = next(((r, c.returncode) for r, c in enumerate(children) if c.returncode), None)
    if failed is not None:
        raise DistributedError(f"process {failed[0]} of {processes} exited with status {failed[1]}; "
                               "the others were stopped")
    return 0
