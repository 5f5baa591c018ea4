"""Test session set-up: 8 simulated CPU devices, chosen before anything initialises JAX."""

import os
import subprocess
import sys
import warnings

import pytest

os.environ["TPUPEDIA_PRESET"] = "tiny"  # tests assert tiny-preset behaviour

from tpupedia import devices

devices.simulate_cpu_devices(8)
warnings.filterwarnings("ignore", message="Explicitly requested dtype")


@pytest.fixture
def run_cli():
    """`run_cli(*args, cwd=DIR)`: `python -m tpupedia.cli ARGS` in a fresh process, as a user runs
    it (tiny preset, CPU, its checkpoint cache under DIR); the `CompletedProcess`, output captured."""

    def run(*args: str, cwd) -> subprocess.CompletedProcess:
        env = {**os.environ, "TPUPEDIA_PRESET": "tiny", "JAX_PLATFORMS": "cpu", "TPUPEDIA_CACHE": str(cwd / "cache")}
        return subprocess.run([sys.executable, "-m", "tpupedia.cli", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=600)

    return run
