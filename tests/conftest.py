"""Test session set-up: 8 simulated CPU devices, chosen before anything initialises JAX."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

os.environ["TPUPEDIA_PRESET"] = "tiny"  # tests assert tiny-preset behaviour

# One persistent compilation cache for the session, empty at its start and removed at its end:
# many tests compile the same tiny programs (a step, a decode), and a program compiled once is
# read back by the next test and by the CLI subprocesses, which inherit these variables. Every
# program still compiles once per session. (On this 2-core host two test files took 297 s without
# it and 221 s with it.) A size limit turns on JAX's file lock, so the processes of a multi-process
# test never read an entry another is still writing. Set before anything imports JAX, which reads
# them at import.
_jax_cache = tempfile.mkdtemp(prefix="tpupedia-tests-jax-cache-")
atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
os.environ.update(JAX_COMPILATION_CACHE_DIR=_jax_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", JAX_COMPILATION_CACHE_MAX_SIZE=str(8 * 2**30))

from tpupedia import devices  # noqa: E402 - after the environment it reads

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
