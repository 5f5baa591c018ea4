# gpu-tpu-pedia: every target creates the environment it needs on a fresh machine.
#   make serve      build the site and serve it at http://127.0.0.1:8000
#   make test       ruff, unit + parity tests, notebook hygiene, nbval (strict) over every notebook, strict docs build
#   make check      ruff, notebook hygiene and the tests that take under 5 s each: minutes, for iterating
#   make rehearse   every full-size way in (generate paths, notebooks) planned for a v6e-8, nothing loaded
#   make lab        JupyterLab with jupytext pairing (edit lessons/*.py or notebooks/*.ipynb)
#   make notebooks  re-execute every lesson with the tiny preset and write notebooks/*.ipynb
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export NO_MKDOCS_2_WARNING := 1
# Offline (the tiny preset builds its checkpoints) unless the full preset is asked for, which
# downloads real ones; a value set in your environment wins.
HF_HUB_OFFLINE ?= $(if $(filter full,$(TPUPEDIA_PRESET)),0,1)
export HF_HUB_OFFLINE
export TOKENIZERS_PARALLELISM := false
export PYDEVD_DISABLE_FILE_VALIDATION := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

LESSONS := $(sort $(wildcard lessons/[0-9][0-9]_*.py))

# The stored notebook outputs are those of the tiny preset on CPU, so everything that executes or
# compares notebooks runs that way. `make lab` and `make serve` keep your environment: on a TPU VM,
# `TPUPEDIA_PRESET=full make lab` runs the notebooks on the real chips.
test check unit nbval notebooks: export TPUPEDIA_PRESET := tiny
test check unit nbval notebooks: export JAX_PLATFORMS := cpu
test check nbval notebooks: export TPUPEDIA_AOT_CACHE ?= $(CURDIR)/tests/aot-kept

.PHONY: env test check unit nbval nbval-reordered docs serve lab notebooks clean chromium rehearse

env: $(STAMP)

$(STAMP): requirements/ci.txt requirements/lock.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements/ci.txt -c requirements/lock.txt -e .
	$(BIN)/pip check
	@touch $@

# tests/ holds the unit and parity tests, the notebook hygiene checks and the strict docs build
# (tests/test_docs.py runs `mkdocs build --strict`); nbval re-runs every notebook. One pytest
# session runs both on two pytest-xdist workers, a file (a notebook: its cells in order, in one
# kernel) at a time on whichever worker is free, the notebooks first (tests/conftest.py). The
# workers share JAX's persistent compilation cache, made empty for this run and removed after it
# (a program compiled once, a tiny step or a decode, is read back by the other worker and by the
# command-line processes the tests start). Compiles for TPU topologies, which JAX's cache cannot
# hold, are kept by `tpupedia.aot` in tests/aot-kept, in the repository, keyed by the program, the
# slice, the compiler and its versions: a fresh clone compiles only the programs a change touched.
# A run that passes writes tests/slow.txt (what `make check` skips) and keeps in tests/aot-kept
# every compile it used, and only those: commit both. TPUPEDIA_AOT_CACHE=off make test
# compiles everything.
test: env chromium
	$(BIN)/ruff check .
	@caches=$$(mktemp -d -t tpupedia-make-test-XXXXXX); trap 'rm -rf "$$caches"' EXIT; \
	export JAX_COMPILATION_CACHE_DIR=$$caches/jax \
	  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1 \
	  JAX_COMPILATION_CACHE_MAX_SIZE=$$((8 * 2**30)); \
	$(BIN)/python -m tpupedia.notebooks nbval tests notebooks -n 2 --dist loadfile --durations=30 --record-slow

# Every full-size way in, rehearsed for a v6e-8 on this CPU host (`tpupedia.rehearse`): each
# `tpupedia generate` path and each notebook's calls into the pipelines, under TPUPEDIA_PRESET=full,
# plan their run by compiling its programs ahead of time for the slice (one layer per model, as
# `tpupedia plan` does) and stop before a weight loads; a call whose plan does not fit fails it,
# naming the caller. Compiles are read from and kept in tests/rehearse-kept (commit it); a program a
# change touched compiles anew, which for a full-size VAE decode takes minutes. CI runs it after
# `make test`: the ways in whose compiles are kept (recorded.json there); REHEARSE=--all adds the others
# (hours on a 2-core host) and prunes what it neither read nor wrote.
rehearse: env
	$(BIN)/python -m tpupedia.rehearse --keep tests/rehearse-kept $(REHEARSE)

# For iterating: lint, the notebooks' pairing and hygiene, and the cheapest tests of the last
# `make test` (each under 5 s, up to 75 s in all; tests/slow.txt lists the others; a test not
# listed yet runs), on two workers. Under 3 minutes on the 2-core machine from a fresh clone; run
# `make test` before you push. It reads tests/aot-kept and adds there what a change compiled anew.
check: env
	$(BIN)/ruff check .
	$(BIN)/python -m tpupedia.notebooks check
	$(BIN)/python -m pytest tests --quick -q -n 2 --dist loadfile

# The browser test (tests/test_browser.py) drives the system Chromium and checks that the Chinese
# pages render real glyphs, which needs a CJK font. Install what is missing (chromium,
# fonts-noto-cjk) with apt when we can (root, apt present); never fail here: without Chromium the
# test skips and says why, without a CJK font it fails and says to install fonts-noto-cjk.
chromium:
	@have_chromium=1; have_font=1; \
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || have_chromium=; \
	{ fc-list :lang=zh 2>/dev/null | grep -q . || \
	  dpkg-query -W -f='$${Status}' fonts-noto-cjk 2>/dev/null | grep -q 'install ok installed'; } || have_font=; \
	if [ -z "$$have_chromium" ] || [ -z "$$have_font" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq >/dev/null 2>&1 && updated=1 || updated=; \
	    if [ -z "$$have_chromium" ]; then \
	      { [ -n "$$updated" ] && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; } \
	        || echo "chromium: apt install failed; tests/test_browser.py will be skipped"; \
	    fi; \
	    if [ -z "$$have_font" ] && ! { [ -n "$$updated" ] && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fonts-noto-cjk >/dev/null 2>&1; }; then \
	      if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
	        echo "fonts-noto-cjk: apt install failed; tests/test_browser.py will fail on the Chinese pages"; \
	      fi; \
	    fi; \
	  elif [ -z "$$have_chromium" ]; then \
	    echo "chromium: not installed and apt not usable here; tests/test_browser.py will be skipped"; \
	  else \
	    echo "fonts-noto-cjk: no CJK font and apt not usable here; tests/test_browser.py will fail on the Chinese pages"; \
	  fi; \
	fi

unit: env
	$(BIN)/python -m pytest tests

nbval: env
	$(BIN)/python -m tpupedia.notebooks nbval notebooks -n 2 --dist loadfile

# The stored outputs under another machine's floating-point order: one thread, no vector kernels
# in PyTorch, XLA's CPU code generated for SSE4.2 and its Eigen single-threaded. Matmuls, convs
# and softmaxes then round differently (notebook `fewer_steps` printed 3.1e-06 here and 4.7e-06 on
# another 2-core host), and strict nbval must still pass: a measured value is compared by its bound.
nbval-reordered: export OMP_NUM_THREADS := 1
nbval-reordered: export ATEN_CPU_CAPABILITY := default
nbval-reordered: export XLA_FLAGS := --xla_cpu_max_isa=SSE4_2 --xla_cpu_multi_thread_eigen=false
nbval-reordered: export TPUPEDIA_PRESET := tiny
nbval-reordered: export JAX_PLATFORMS := cpu
nbval-reordered: export TPUPEDIA_AOT_CACHE ?= $(CURDIR)/tests/aot-kept
nbval-reordered: env
	$(BIN)/python -m tpupedia.notebooks nbval notebooks -n 2 --dist loadfile

docs: env
	$(BIN)/mkdocs build --strict

serve: env
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

lab: env
	$(BIN)/pip install --quiet "jupyterlab==4.6.6"
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --no-browser $$([ "$$(id -u)" = 0 ] && echo --allow-root)

notebooks: env
	$(BIN)/python -m tpupedia.notebooks execute $(LESSONS)

clean:
	rm -rf site .pytest_cache
