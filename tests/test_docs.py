"""`mkdocs build --strict` succeeds and the site shows what the notebooks stored."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_strict_docs_build_renders_stored_notebook_outputs(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]

    page = (site / "notebooks" / "00_start_here" / "index.html").read_text()
    assert "v6e ridge point: 560 FLOP/byte" in page  # a stored output, not re-executed
    assert "RESOURCE_EXHAUSTED" in page

    api = (site / "reference" / "api" / "index.html").read_text()
    assert "make_mesh" in api and "simulate_cpu_devices" in api

    hardware = (site / "kb" / "hardware" / "index.html").read_text()
    assert "{{ hardware_table }}" not in hardware and "918" in hardware

    results_page = (site / "results" / "index.html").read_text()
    assert "{{ plans_table }}" not in results_page and "v6e:2x4 (8 chips)" in results_page  # docs/results/plans.json

    assert (site / "guides" / "tpu-vm" / "index.html").exists()
    assert not list(site.rglob("*.py")), "python sources leaked into the site"
