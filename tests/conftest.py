"""Test session set-up: 8 simulated CPU devices, chosen before anything initialises JAX."""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ["TPUPEDIA_PRESET"] = "tiny"  # tests assert tiny-preset behaviour

# One persistent compilation cache for the session, empty at its start and removed at its end:
# many tests compile the same tiny programs (a step, a decode), and a program compiled once is
# read back by the next test and by the CLI subprocesses, which inherit these variables. Every
# program still compiles once per session. (On this 2-core host two test files took 297 s without
# it and 221 s with it.) A size limit turns on JAX's file lock, so the processes of a multi-process
# test never read an entry another is still writing. `make test` makes one for the whole run and
# shares it with nbval; a session started another way makes its own. (Compiles for TPU topologies
# are kept by `tpupedia.aot` in the package's cache folder instead: JAX's cannot hold them.) Set
# before anything imports JAX, which reads them at import.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _jax_cache = tempfile.mkdtemp(prefix="tpupedia-tests-jax-cache-")
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _jax_cache
os.environ.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
                  JAX_COMPILATION_CACHE_MAX_SIZE=str(8 * 2**30))

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



@dataclass(frozen=True)
class DocsBuild:
    """One `mkdocs build --strict` of the repository's site: its exit status, its stderr (where
    mkdocs writes its warnings) and the directory it wrote."""

    returncode: int
    stderr: str
    site: Path


@pytest.fixture(scope="session")
def docs_build(tmp_path_factory) -> DocsBuild:
    """The site built once per test session with `mkdocs build --strict`, for tests/test_docs.py
    and tests/test_browser.py. Under pytest-xdist the workers share one build (pytest-xdist's
    documented pattern): the first to take the lock builds under the session's shared temporary
    folder and records how the build went; the others wait for it and read that record. A failed
    build is recorded too, not raised here: the docs test asserts on it."""

    def build(site: Path) -> DocsBuild:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                                cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, env=env,
                                timeout=600)
        return DocsBuild(result.returncode, result.stderr, site)

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: this session fixture is the only build
        return build(tmp_path_factory.mktemp("docs") / "site")
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above each worker's own
    record = shared / "docs-build.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            done = build(shared / "docs-site")
            record.write_text(json.dumps({"returncode": done.returncode, "stderr": done.stderr}))
        recorded = json.loads(record.read_text())
    return DocsBuild(recorded["returncode"], recorded["stderr"], shared / "docs-site")


# -- make check: the quick tests ------------------------------------------------------------------
# `make check` runs the cheapest tests, counting what a test needs that it shares with others (a
# module's tiny pipeline, built once) as if it ran alone: those under QUICK_SECONDS each, cheapest
# first, until their costs add up to QUICK_BUDGET_SECONDS. `tests/slow.txt` lists the others, and
# every `make test` writes it anew from what it measured. A test not listed (a new one) runs in
# `make check` too. A budget, not only a per-test limit, is what carries to another machine: on a
# host half as fast, every cost doubles and a per-test limit lets in hundreds of tests that were
# just under it here (a 2-core host of the same kind ran 834 of them in 500 s), while the budget's
# tests take twice as long, still minutes.
QUICK_SECONDS = 5.0
QUICK_BUDGET_SECONDS = 75.0
SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")
# The TPU compiles `make test` keeps in the repository (`tpupedia.aot.compile_aot`, keyed by the
# program, the slice, the compiler and its versions): a fresh clone reads the answers of the
# compiles this code asks for, and compiles whatever changed. A full `--record-slow` run that
# passed keeps what it used, every compile, however cheap: a threshold on compile time does not
# carry to another host (what took 1.9 s here and was dropped took 3 s there, and such compiles
# added minutes to a fresh clone's `make check` on a host of the same kind).
AOT_KEPT = os.path.join(os.path.dirname(__file__), "aot-kept")
_STARTED = time.time()


def pytest_addoption(parser):
    group = parser.getgroup("tpupedia")
    group.addoption("--quick", action="store_true",
                    help=f"run only the tests that cost under {QUICK_SECONDS:g} s (those not in tests/slow.txt)")
    group.addoption("--record-slow", action="store_true",
                    help=f"write tests/slow.txt: the tests that cost {QUICK_SECONDS:g} s or more in this run")


def _read_slow() -> set[str]:
    try:
        with open(SLOW_LIST) as f:
            return {line.strip() for line in f if line.strip() and not line.startswith("#")}
    except FileNotFoundError:
        return set()


def pytest_collection_modifyitems(config, items):
    """`--quick`: leave out what tests/slow.txt lists. And the notebooks first: each is one long
    unit for pytest-xdist (`--dist loadfile` keeps a notebook's cells in order on one worker), and
    the longest units started first end the run soonest; the test files then fill the gaps."""
    items.sort(key=lambda item: not item.nodeid.split("::")[0].endswith(".ipynb"))  # stable: order kept within
    if not config.getoption("--quick"):
        return
    slow = _read_slow()
    keep = [item for item in items if item.nodeid not in slow]
    dropped = [item for item in items if item.nodeid in slow]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


_costs: dict[str, float] = {}  # test id -> seconds: its own setup, call and teardown, and what it borrowed
_shared: dict[tuple, tuple[float, str]] = {}  # a shared fixture's instance -> (seconds to set up, test that did)
_current: list[str] = [""]


def _shared_fixtures(item) -> list[tuple]:
    """The module- or session-scoped fixture instances `item` uses (each parametrization its own)."""
    info = getattr(item, "_fixtureinfo", None)
    indices = getattr(getattr(item, "callspec", None), "indices", {})
    keys = []
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name) if info else None
        if defs and defs[-1].scope != "function":
            keys.append((defs[-1].baseid, name, indices.get(name, 0)))
    return keys


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        if fixturedef.scope != "function":
            key = (fixturedef.baseid, fixturedef.argname, getattr(request, "param_index", 0))
            _shared[key] = (time.perf_counter() - start, _current[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's teardown report carries the seconds of the shared fixtures it uses that another
    test set up (in the process that ran it, which with pytest-xdist is not the one that writes
    tests/slow.txt)."""
    report = yield
    if call.when == "teardown":
        borrowed = (_shared.get(key, (0.0, item.nodeid)) for key in _shared_fixtures(item))
        report.user_properties.append(("borrowed_seconds", sum(s for s, by in borrowed if by != item.nodeid)))
    return report


def pytest_runtest_logreport(report):
    borrowed = sum(v for k, v in report.user_properties if k == "borrowed_seconds")
    _costs[report.nodeid] = _costs.get(report.nodeid, 0.0) + report.duration + borrowed


def quick_tests(costs: dict[str, float], limit: float = QUICK_SECONDS, budget: float = QUICK_BUDGET_SECONDS) -> set[str]:
    """The tests `make check` runs, from each test's cost: those under `limit`, cheapest first (ties
    by name), while their costs add up to at most `budget`."""
    chosen, spent = set(), 0.0
    for name in sorted((n for n in costs if costs[n] < limit), key=lambda n: (costs[n], n)):
        if spent + costs[name] > budget:
            break
        chosen.add(name)
        spent += costs[name]
    return chosen


def pytest_sessionfinish(session, exitstatus):
    """Write tests/slow.txt (`--record-slow`): the tests that cost QUICK_SECONDS or more this run,
    and those listed before that did not run; once, in the process that collected the reports."""
    config = session.config
    if not config.getoption("--record-slow") or hasattr(config, "workerinput") or not _costs:
        return
    if exitstatus == 0 and os.path.realpath(os.environ.get("TPUPEDIA_AOT_CACHE", "")) == os.path.realpath(AOT_KEPT):
        from tpupedia import aot

        aot.prune(AOT_KEPT, since=_STARTED)
    ran = {n for n in _costs if not n.endswith(".ipynb") and ".ipynb::" not in n}
    slow = ran - quick_tests({n: _costs[n] for n in ran})
    root = os.path.dirname(os.path.dirname(__file__))
    kept = {n for n in _read_slow() - ran if os.path.exists(os.path.join(root, n.split("::")[0]))}
    lines = ["# Tests `make check` skips: on the machine that last ran `make test`, those that cost "
             f"{QUICK_SECONDS:g} s or more, counting",
             "# the shared fixtures they use as if they ran alone, and the dearest of the others past a budget of "
             f"{QUICK_BUDGET_SECONDS:g} s",
             "# (tests/conftest.py writes this file)."]
    with open(SLOW_LIST, "w") as f:
        f.write("\n".join(lines + sorted(slow | kept)) + "\n")
