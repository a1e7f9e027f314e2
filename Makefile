# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
TEST_WORKERS ?= $(shell nproc)

.PHONY: install model native browser serve test test-slow lint bench-peers bench-spec clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so that no dependency pulls a different (CUDA) build.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-model: pyproject.toml $(VENV)/.installed
	$(PIP) install -q -e ".[model]"
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed-model
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The default model, downloaded and converted once (into DEEPINFER_CACHE, or ~/.cache/deepinfer).
model: $(VENV)/.installed
	$(VENV)/bin/deepinfer prepare-model

# The native CPU ops built now, two at a time (a no-op once built), not by pytest's workers
# waiting on each other's first use one op at a time.
native: $(VENV)/.installed
	$(PY) -P -m deepinfer.kernels.cpu.prebuild

# Headless Chromium and its WebDriver for the browser-page tests (Debian's packages), installed
# when missing; without apt (or root) the tests say how to get them and are skipped (not on CI).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  $$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver \
	  || echo "make browser: could not install chromium and chromium-driver"; }

serve: model
	$(VENV)/bin/deepinfer serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --config pyproject.toml

# One pytest worker per core, a test file's tests on one worker (its module's server starts once).
test: $(VENV)/.installed-test model native browser lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The long tests and the rare-regression guards (README, Tests), e.g. build the wheel, install it
# into a fresh venv, serve from there. .ci/run runs them after `make test`.
test-slow: $(VENV)/.installed-test model native
	$(VENV)/bin/pytest -q -m slow -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench-peers: model
	$(PY) scripts/bench_peers.py

# n-gram speculative decoding on vs off (input-grounded and random prompts, llama.cpp if present).
bench-spec: model
	$(PY) scripts/bench_spec_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info .clients
