"""The tiny preset on a host with one TPU chip (Colab, Kaggle, a v5e-1 VM).

There the notebooks keep their eight simulated CPU devices as JAX's default backend (meshes,
models) and open the chip as a second backend for Pallas kernels (`devices.kernel_chip`). No TPU
is here, so this proves what a CPU host can: with a chip reported present, every notebook's
set-up asks JAX for `cpu,tpu`; JAX really tries to open the chip (libtpu is installed) and, as
no chip answers here, the set-up says why and goes on with the eight CPU devices. What stays
unproven (the chip opening, the kernel running on it) is listed in `docs/guides/free-tpu.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpupedia import devices

ROOT = Path(__file__).resolve().parents[1]

# Every lesson's cells up to the one that sets the devices up, run in one process; JAX's
# backends are cleared between lessons so each starts as a fresh kernel would.
SETUP = r"""
import json, os, sys, warnings
import jax, jax.extend.backend, jupytext
from tpupedia import devices

devices.tpu_present = lambda: True  # what /dev/accel0 or /dev/vfio/0 would say on a TPU host
report = {}
for path in sys.argv[1:]:
    cells = [c for c in jupytext.read(path).cells
             if c.cell_type == "code" and "raises-exception" not in c.metadata.get("tags", [])]
    setup = next(i for i, c in enumerate(cells) if "session.start(" in c.source or "simulate_cpu_devices(" in c.source)
    jax.extend.backend.clear_backends()
    os.environ.pop("JAX_PLATFORMS", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        namespace = {"__name__": "__main__"}
        for cell in cells[: setup + 1]:
            exec("\n".join(l for l in cell.source.splitlines() if not l.startswith("%")), namespace)
    report[os.path.basename(path)] = {
        "backend": jax.default_backend(), "devices": jax.device_count(), "chip": str(devices.kernel_chip()),
        "chip_error": devices.chip_error(), "warned": [str(w.message) for w in caught if "TPU chip" in str(w.message)],
    }
print(json.dumps(report))
"""


def test_tiny_platforms_asks_for_the_chip_only_where_one_is_attached(monkeypatch):
    monkeypatch.setattr(devices, "has_libtpu", lambda: True)
    monkeypatch.setattr(devices, "tpu_present", lambda: True)
    assert devices.tiny_platforms(chip=True) == "cpu,tpu"  # CPU first: JAX's default backend
    assert devices.tiny_platforms(chip=False) == "cpu"  # the CLI's tiny runs never take the chip
    monkeypatch.setattr(devices, "tpu_present", lambda: False)
    assert devices.tiny_platforms(chip=True) == "cpu"
    monkeypatch.setattr(devices, "tpu_present", lambda: True)
    monkeypatch.setattr(devices, "has_libtpu", lambda: False)
    assert devices.tiny_platforms(chip=True) == "cpu"  # a chip JAX cannot drive without libtpu


@pytest.mark.skipif(not devices.has_libtpu(), reason="needs libtpu (jax[tpu]), which make test installs")
def test_every_notebook_setup_on_a_one_chip_host_keeps_eight_cpu_devices():
    lessons = sorted(str(p) for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    # libtpu's start-up without a chip: no metadata server to ask, no lock on a chip to take
    env |= {"TPUPEDIA_PRESET": "tiny", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            "TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost"}
    out = subprocess.run([sys.executable, "-c", SETUP, *lessons], capture_output=True, text=True, env=env,
                         cwd=ROOT / "notebooks", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(Path(p).name for p in lessons)
    for name, seen in report.items():
        assert (seen["backend"], seen["devices"], seen["chip"]) == ("cpu", 8, "None"), (name, seen)
        # JAX was asked for the chip and tried it: the error is libtpu's, from opening a TPU backend
        assert "Unable to initialize backend 'tpu'" in seen["chip_error"], (name, seen)
        assert len(seen["warned"]) == 1 and "8 CPU devices" in seen["warned"][0], (name, seen)
