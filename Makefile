# gpu-tpu-pedia: every target creates the environment it needs on a fresh machine.
#   make serve      build the site and serve it at http://127.0.0.1:8000
#   make test       ruff, unit + parity tests, notebook hygiene, nbval (strict) over every notebook, strict docs build
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
test unit nbval notebooks: export TPUPEDIA_PRESET := tiny
test unit nbval notebooks: export JAX_PLATFORMS := cpu

.PHONY: env test unit nbval docs serve lab notebooks clean chromium

env: $(STAMP)

$(STAMP): requirements/ci.txt requirements/lock.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements/ci.txt -c requirements/lock.txt -e .
	$(BIN)/pip check
	@touch $@

# tests/ holds the unit and parity tests, the notebook hygiene checks and the strict docs build
# (tests/test_docs.py runs `mkdocs build --strict`); nbval re-runs every notebook beside it. The
# two run side by side (either alone leaves part of a 2-core machine idle): a fresh-clone
# `bash .ci/run` took 35:56 that way against 41:21 one after the other (2-core CPU host). nbval's
# output is printed when both are done; the target fails if either does.
test: env chromium
	$(BIN)/ruff check .
	$(BIN)/python -m tpupedia.notebooks nbval notebooks > .nbval.log 2>&1 & nbval=$$!; \
	$(BIN)/python -m pytest tests --durations=25; py=$$?; \
	wait $$nbval; nb=$$?; cat .nbval.log; \
	echo "pytest exit $$py, nbval exit $$nb"; test $$py = 0 && test $$nb = 0

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
	$(BIN)/python -m tpupedia.notebooks nbval notebooks

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
