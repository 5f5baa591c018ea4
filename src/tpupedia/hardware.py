"""Chip facts for roofline and memory arithmetic, each row with its source.

Every number here is a vendor *peak* per chip: dense bf16 matrix throughput, HBM capacity,
HBM bandwidth, and chip-to-chip bandwidth. Nothing in this table was measured by this project;
measured numbers live in the benchmark results, with the machine they were measured on.

Chip-to-chip bandwidth is quoted per chip, both directions, all ports together. A collective
gets only part of it: on a TPU, `Chip.ring_bytes_per_s` is what one chip can send in a ring
along one axis of the torus (two of its ports, one direction each), and it is what the dry-run's
communication floor divides by.

Introduced in notebook `start_here` (start here); the dry-run planner of notebook `plan_without_tpu` divides by these.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from tpupedia.errors import TpupediaError

__all__ = [
    "Chip",
    "CHIPS",
    "MXU_SOURCE",
    "PRICES",
    "price",
    "HardwareError",
    "chip",
    "Topology",
    "parse_topology",
    "table_rows",
    "chip_for_device_kind",
    "host_memory_available",
]

GB = 1e9
GIB = 2**30
TB = 1e12
TFLOP = 1e12

_TPU_V5E = "https://cloud.google.com/tpu/docs/v5e"
_TPU_V5P = "https://cloud.google.com/tpu/docs/v5p"
_TPU_V6E = "https://cloud.google.com/tpu/docs/v6e"
_TPU7X = "https://docs.cloud.google.com/tpu/docs/tpu7x"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
MXU_SOURCE = ("https://cloud.google.com/tpu/docs/system-architecture-tpu-vm, read 2026-12-02 from stored copies: \"An "
              "MXU is composed of either 256 x 256 (TPU v6e) or 128 x 128 (TPU versions prior to v6e) "
              "multiply-accumulators in a systolic array\" (older copies: 128 x 128 only)")
_H200 = "https://www.nvidia.com/en-us/data-center/h200/"
_B200 = "https://www.nvidia.com/en-us/data-center/hgx/"


class HardwareError(TpupediaError, ValueError):
    """An unknown chip or a topology name that cannot be parsed."""


@dataclass(frozen=True)
class Chip:
    """Peak figures for one accelerator chip (one TPU chip, or one GPU).

    How much of the chip-to-chip bandwidth one collective gets, for the v6e (Google's page,
    https://cloud.google.com/tpu/docs/v6e: "Bidirectional inter-chip interconnect (ICI)
    bandwidth (per chip) 800 GBps", "ICI ports per chip 4", "Interconnect topology 2D torus"):

    - one port, both directions: 800 / 4 = 200 GB/s; one port, one direction: 200 / 2 =
      **100 GB/s** (`ici_port_bytes_per_s`), an eighth of the chip's 800.
    - In a 2D torus each port leads to one neighbour: +x, -x, +y, -y. A ring along one mesh
      axis (say x) uses the two x ports only. Per direction of the ring a chip sends through
      one port: 100 GB/s clockwise, 100 GB/s counter-clockwise. A bidirectional ring (half
      of the data each way, what How to Scale Your Model's collective costs assume) therefore
      sends **200 GB/s** out of each chip (`ring_bytes_per_s`, and receives 200 GB/s): a quarter
      of the 800, and half of the 400 GB/s a chip could send through all four ports at once.
    - The dry-run counts the bytes each chip *sends* (`tpupedia.aot.collective_traffic`), so
      its communication floor is bytes sent / 200 GB/s on a v6e. Dividing by the 800 GB/s
      total would count the receiving half and the other axis's ports as sending bandwidth:
      a floor 4x too low.
    """

    name: str
    vendor: str
    hbm_bytes: float
    """HBM capacity per chip, in bytes, in the vendor's unit: GiB for TPUs (Google's TPU7x table
    heads its column "HBM capacity per chip (GiB)": v5p 95, v6e 32, TPU7x 192; the compile
    budget libtpu gives a v5e or v6e program, 15.75 and 31.25 GiB, is more than 16 or 32 x 10^9
    bytes could hold), decimal GB for NVIDIA's GPUs."""
    bf16_flops: float
    """Peak dense bf16 matrix throughput per chip, FLOP/s (no structured-sparsity doubling)."""
    hbm_bytes_per_s: float
    """Peak HBM bandwidth per chip, bytes/s."""
    link_bytes_per_s: float
    """Chip-to-chip bandwidth per chip, bytes/s, all ports and both directions together (ICI for
    TPUs, NVLink for GPUs). No single collective gets all of it: see `ring_bytes_per_s`."""
    link: str
    chips_per_host: int
    source: str
    note: str = ""
    read: str = ""
    """When the row was last read against its source (a date), where that was recorded."""
    ici_ports: int | None = None
    """ICI ports per chip (TPUs; `None` for GPUs): one per torus neighbour. 4 for the 2D-torus
    v5e and v6e ("ICI ports per chip 4" on Google's pages); 6 for the 3D-torus v5p (its page
    gives no port count: 6 is one per neighbour of a 3D torus)."""
    ici_port_bytes_per_s: float | None = None
    """One direction of one ICI port, bytes/s: the chip's bidirectional ICI figure divided by
    2 x `ici_ports`. v6e: 800 GB/s / 8 = 100 GB/s; v5p: 1,200 GB/s / 12 = 100 GB/s; v5e: the
    current v5e page's 400 GB/s bidirectional / 8 = 50 GB/s (the table's `link_bytes_per_s`
    keeps the older, unlabelled 1,600 Gbps = 200 GB/s)."""
    devices_per_chip: int = 1
    """JAX devices per chip: one where the chip is one device (v5e and v6e have one TensorCore;
    v5p's two act as one, "megacore"); two on TPU7x, whose two TensorCores are two devices, each
    with half the chip's HBM (libtpu 0.0.42.1 here lists `tpu7x:2x2x1`, four chips, as eight
    devices with a 94.75 GiB compile budget each). A mesh, a sharding and a compile budget count
    devices; peaks, HBM and prices are per chip (`Topology`)."""
    scoped_vmem_bytes: float | None = None
    """The TPU compiler's default limit on the VMEM one kernel may allocate, bytes (`None` for
    GPUs): what a splash kernel's blocks must fit (`tpupedia.attention.chip_block_sizes`).
    Measured here, not a vendor figure: the limit libtpu 0.0.42.1's error states when a kernel
    asks for more ("Scoped allocation with size 23.35M and limit 16.00M exceeded"), 16 MiB on
    v5e and v5p, 32 MiB on v6e and TPU7x (`tests/test_splash_blocks.py` compiles it again).
    `--xla_tpu_scoped_vmem_limit_kib` in `LIBTPU_INIT_ARGS` raises it, at the cost of the VMEM
    the compiler keeps for its own fusions."""
    mxu_width: int | None = None
    """The side of one MXU's systolic array (TPUs; `None` for GPUs): a matmul whose contracted or
    output dimension is narrower than it leaves the rest of each pass idle, which is what a splash
    call's `head_dim` is (`tpupedia.predict.mxu_fill`). Google's TPU architecture page
    (`MXU_SOURCE`): 128 x 128 on v5e and v5p, 256 x 256 on v6e. TPU7x's is on no page read here:
    256, as on v6e, is assumed."""
    fp8_flops: float | None = None
    """Peak dense fp8 matrix throughput per chip, FLOP/s, where the vendor lists one; `None` where
    it does not (v5e lists int8, not fp8; the TPU7x page lists v5p's and v6e's fp8 as their bf16)."""

    @property
    def device_bf16_flops(self) -> float:
        """One device's share of the bf16 peak (the chip's, over `devices_per_chip`)."""
        return self.bf16_flops / self.devices_per_chip

    @property
    def device_hbm_bytes_per_s(self) -> float:
        """One device's share of the HBM bandwidth (each TPU7x TensorCore has its own half)."""
        return self.hbm_bytes_per_s / self.devices_per_chip

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity at which the chip turns from memory-bound to compute-bound."""
        return self.bf16_flops / self.hbm_bytes_per_s

    @property
    def ring_bytes_per_s(self) -> float | None:
        """Bytes/s one chip sends in a bidirectional ring along one torus axis: that axis's two
        ports, one direction each (2 x `ici_port_bytes_per_s`; 200 GB/s on a v6e). `None` for
        GPUs, which have no torus. Bytes sent divided by it is a floor, not a prediction: v5e
        and v6e slices have wraparound links only along an axis of 16 chips (How to Scale Your
        Model, "TPUs"), so along a shorter axis the ring is a line and runs slower."""
        return None if self.ici_port_bytes_per_s is None else 2 * self.ici_port_bytes_per_s

    @property
    def device_ring_bytes_per_s(self) -> float | None:
        """One device's share of `ring_bytes_per_s`: the two devices of a TPU7x chip send through
        the chip's ports."""
        ring = self.ring_bytes_per_s
        return None if ring is None else ring / self.devices_per_chip

    def seconds_for(self, flops: float, hbm_bytes: float) -> float:
        """Roofline lower bound: the slower of doing the math and moving the bytes."""
        return max(flops / self.bf16_flops, hbm_bytes / self.hbm_bytes_per_s)


CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v5e", "Google", 16 * GIB, 197 * TFLOP, 819 * GB, 400 * GB, "ICI", 8, _TPU_V5E,
             "HBM 16 GiB (the page writes 16 GB); ICI 400 GB/s bidirectional as the current page gives it "
             "(older copies: 1,600 Gbps, no direction); HBM bandwidth 819 GB/s as older copies give it, the "
             "current one '800 GiBps', which is not the same figure in other units (819 GB/s is 763 GiB/s)",
             ici_ports=4, ici_port_bytes_per_s=400 * GB / (2 * 4), scoped_vmem_bytes=16 * 2**20,
             mxu_width=128, read="2026-12-02, stored copies of the page"),
        Chip("v5p", "Google", 95 * GIB, 459 * TFLOP, 2765 * GB, 1200 * GB, "ICI", 4, _TPU_V5P,
             "two TensorCores per chip acting as one device; 3D torus; 95 GiB of 96 GiB physical (the rest "
             "kept by the runtime, the page says); one copy of the page gives the bandwidth as 2,575 GiBps, "
             "the same figure", ici_ports=6, ici_port_bytes_per_s=1200 * GB / (2 * 6),
             fp8_flops=459 * TFLOP, scoped_vmem_bytes=16 * 2**20, mxu_width=128, read="2026-12-02, stored copies of the page"),
        Chip("v6e", "Google", 32 * GIB, 918 * TFLOP, 1638 * GB, 800 * GB, "ICI", 8, _TPU_V6E,
             "Trillium; HBM 32 GiB (the v6e page writes 32 GB, the TPU7x page's table 32 GiB); earlier "
             "revisions of the page listed 1,640 and 1,600 GB/s HBM, and 3,584 or 3,200 Gbps ICI without a "
             "direction", ici_ports=4, ici_port_bytes_per_s=800 * GB / (2 * 4),
             fp8_flops=918 * TFLOP, scoped_vmem_bytes=32 * 2**20, mxu_width=256, read="2026-12-02, stored copies of the page"),
        Chip("tpu7x", "Google", 192 * GIB, 2307 * TFLOP, 7380 * GB, 1200 * GB, "ICI", 4, _TPU7X,
             "Ironwood, read 2026-12-02 from stored copies of the page; two TensorCores per chip, each a JAX "
             "device; HBM 192 GiB (206 GB) as the page states it, in GiB; HBM bandwidth 7,380 GB/s (copies of the "
             "page label it GB/s and GBps); ICI 1,200 GB/s bidirectional; the page gives no ICI port count: 6 "
             "assumes a 3D torus like v5p's (it 'shares many similarities with TPU v5p'); no public list price", ici_ports=6, ici_port_bytes_per_s=1200 * GB / (2 * 6), devices_per_chip=2,
             fp8_flops=4614 * TFLOP, scoped_vmem_bytes=32 * 2**20, mxu_width=256, read="2026-12-02, stored copies of the page"),
        Chip("H100", "NVIDIA", 80 * GB, 989 * TFLOP, 3.35 * TB, 900 * GB, "NVLink 4", 8, _H100,
             "SXM5; the datasheet's 1,979 TFLOP/s bf16 figure assumes 2:4 sparsity"),
        Chip("H200", "NVIDIA", 141 * GB, 989 * TFLOP, 4.8 * TB, 900 * GB, "NVLink 4", 8, _H200,
             "SXM; same Hopper die as H100, more and faster HBM"),
        Chip("B200", "NVIDIA", 180 * GB, 2250 * TFLOP, 7.7 * TB, 1800 * GB, "NVLink 5", 8, _B200,
             "HGX B200 (1,000 W); dense bf16 is half the datasheet's 4.5 PFLOP/s sparse figure"),
    )
}


_SKYPILOT = ("SkyPilot's GCP catalog, catalogs/v8/gcp/vms.csv in skypilot-org/skypilot-catalog at commit 006059e0f1, "
             "read 2026-11-27 (the docs' cost page cites the same file)")
PRICES: dict[str, dict[str, Any]] = {
    "v5e": dict(on_demand=1.20, spot=0.24493, region="us-central1",
                source=_SKYPILOT + ": tpu-v5litepod-1 $1.2 an hour, tpu-v5litepod-8 $9.6"),
    "v6e": dict(on_demand=2.70, spot=0.544, region="us-central1", source=_SKYPILOT),
}
"""List prices in US dollars per chip-hour, on demand and Spot, in one region, with their source:
what `tpupedia plan --cheapest` prices a slice at. Prices change and differ by region; a user
with their own passes `--price CHIP=DOLLARS`."""


def price(chip_name: str, kind: str = "on_demand") -> float:
    """The listed price of one `chip_name` chip for an hour (`PRICES`), `kind` `on_demand` or `spot`."""
    if chip_name not in PRICES or kind not in ("on_demand", "spot"):
        raise HardwareError(f"no {kind} price for {chip_name!r} here: prices are listed for "
                            f"{', '.join(PRICES)} (on_demand, spot)")
    return float(PRICES[chip_name][kind])


def chip(name: str) -> Chip:
    """Look a chip up by name (case-insensitive): `chip("v6e")`, `chip("h100")`."""
    for key, value in CHIPS.items():
        if key.lower() == name.strip().lower():
            return value
    raise HardwareError(f"unknown chip {name!r}; known chips: {', '.join(CHIPS)}")


@dataclass(frozen=True)
class Topology:
    """A TPU slice named the way libtpu names it, e.g. `v6e:2x4` (a v6e-8) or `tpu7x:2x2x1`: its
    chips (`shape`, `num_chips`: what peaks, HBM and prices count), its devices (`num_devices`:
    what a mesh, a sharding and a compile budget count; two per TPU7x chip) and its hosts (the
    VMs, `hosts`: what a job's processes count). Three numbers, kept apart."""

    name: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def num_chips(self) -> int:
        return math.prod(self.shape)

    @property
    def num_devices(self) -> int:
        """JAX devices in the slice: `num_chips` x `chip.devices_per_chip` (8 for `tpu7x:2x2x1`)."""
        return self.num_chips * self.chip.devices_per_chip

    @property
    def accelerator_type(self) -> str:
        """The Cloud TPU accelerator type for this slice (`v6e-8`; v5p and TPU7x count
        TensorCores: `tpu7x:2x2x1` is a `tpu7x-8`, as Google's XPK names it)."""
        cores = 2 if self.chip.name in ("v5p", "tpu7x") else 1
        return f"{self.chip.name}-{self.num_chips * cores}"

    @property
    def hosts(self) -> int:
        """VMs in the slice: one up to `chip.chips_per_host` chips (a v6e-8 is one 8-chip VM, a
        TPU7x VM holds 4 chips); larger slices are built from 4-chip hosts (Google's v6e table: a
        v6e-16 is 4 VMs, a v6e-256 64; libtpu's own topology description groups the chips the same way)."""
        if self.num_chips <= self.chip.chips_per_host:
            return 1
        return self.num_chips // MULTIHOST_CHIPS_PER_HOST


MULTIHOST_CHIPS_PER_HOST = 4  # TPU VMs of multi-host v5e, v5p, v6e and TPU7x slices hold 4 chips each

_TOPOLOGY = re.compile(r"^(v5e|v5p|v6e|tpu7x):(\d+(?:x\d+){1,2})$")
_V7X = re.compile(r"^(?:v7x|tpu7|ironwood|v7)[:-](.*)$", re.IGNORECASE)


def parse_topology(name: str) -> Topology:
    """Parse `"v6e:2x4"` or `"tpu7x:2x2x1"` into a `Topology`; a bad name gets an error with
    examples, and a TPU7x slice spelled another way (`v7x:2x2x1`, which libtpu refuses) the name
    libtpu takes."""
    text = name.strip()
    m = _TOPOLOGY.match(text)
    if not m:
        other = _V7X.match(text)
        if other:
            raise HardwareError(f"topology {name!r}: libtpu names TPU7x (Ironwood) slices tpu7x:AxBxC, as in "
                                f"tpu7x:{other.group(1) or '2x2x1'} (tpu7x:2x2x1 is 4 chips, 8 devices; tpu7x:2x2x2 "
                                "is 8 chips on 2 hosts)")
        raise HardwareError(
            f"topology {name!r} is not of the form CHIP:AxB[xC] with CHIP one of v5e, v5p, v6e, tpu7x "
            "(for example v6e:2x4, v6e:4x4, v5e:2x4, v5p:2x2x2, tpu7x:2x2x1)"
        )
    shape = tuple(int(d) for d in m.group(2).split("x"))
    if 0 in shape:
        raise HardwareError(f"topology {name!r} has a zero-sized dimension")
    if m.group(1) == "tpu7x" and len(shape) != 3:
        raise HardwareError(f"topology {name!r}: a TPU7x slice is a 3D torus, named AxBxC (tpu7x:2x2x1, tpu7x:2x2x2)")
    return Topology(name=text, chip=chip(m.group(1)), shape=shape)


def _one_decimal(x: float) -> float | int:
    return int(round(x)) if abs(x - round(x)) < 0.05 else round(x, 1)


def table_rows() -> list[dict[str, object]]:
    """The chip table as plain rows (for notebooks and the docs), in human units."""
    rows = []
    for c in CHIPS.values():
        d = asdict(c)
        rows.append(
            {
                "chip": c.name,
                "vendor": c.vendor,
                "HBM (GiB)": _one_decimal(d["hbm_bytes"] / GIB),
                "devices per chip": c.devices_per_chip,
                "bf16 peak (TFLOP/s)": round(d["bf16_flops"] / TFLOP),
                "HBM bandwidth (GB/s)": round(d["hbm_bytes_per_s"] / GB),
                "ridge (FLOP/byte)": round(c.ridge_flops_per_byte),
                "link (GB/s)": round(d["link_bytes_per_s"] / GB),
                "ICI ring, one axis (GB/s)": "—" if c.ring_bytes_per_s is None else round(c.ring_bytes_per_s / GB),
                "link type": c.link,
                "scoped VMEM (MiB)": "—" if c.scoped_vmem_bytes is None else round(c.scoped_vmem_bytes / 2**20),
                "MXU": "—" if c.mxu_width is None else f"{c.mxu_width}x{c.mxu_width}" + ("*" if c.name == "tpu7x" else ""),
                "source": c.source,
                "read": c.read or "—",
                "note": c.note,
            }
        )
    return rows


_DEVICE_KINDS = (
    (r"TPU v5 lite|TPU v5e", "v5e"),
    (r"TPU v5p|TPU v5$", "v5p"),
    (r"TPU v6", "v6e"),
    (r"TPU7x|TPU v7", "tpu7x"),
    (r"H100", "H100"),
    (r"H200", "H200"),
    (r"B200", "B200"),
)


def chip_for_device_kind(kind: str) -> Chip | None:
    """The table's chip for a JAX `device_kind` ("TPU v6 lite", "NVIDIA H100 80GB HBM3"), or None."""
    for pattern, name in _DEVICE_KINDS:
        if re.search(pattern, kind):
            return CHIPS[name]
    return None


def host_memory_available() -> int:
    """Bytes of this host's memory a new allocation can have now without swapping: Linux's
    `MemAvailable` (`/proc/meminfo`), else the free pages `os.sysconf` reports. What a run on CPU
    devices is checked against before it loads weights (`tpupedia.plan.preflight`): simulated CPU
    devices all take their memory from here."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # pragma: no cover
