# cpref: every target creates .venv and installs what it needs on first use.
#
# TORCH_SPEC chooses the torch build. The default pins the CPU wheel this project is tested
# with; an unpinned `torch` would pull a multi-GB CUDA build. On an Ascend NPU machine pass
# the torch that matches your torch_npu, e.g. `make test-npu TORCH_SPEC=torch==2.5.1`, or
# TORCH_SPEC= (empty) to keep a torch that PYTHON's environment already has (then create the
# venv with VENV_FLAGS=--system-site-packages).
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
PY         := $(VENV)/bin/python
PYTEST_ARGS ?= -n auto
# docs-check drives Debian's headless Chromium, installed with apt where neither it nor
# chromium is on PATH (sudo unless root).
SUDO       := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo test test-all test-sim test-npu lint docs docs-check bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.docs: $(VENV)/.base
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

demo: $(VENV)/.base
	$(PY) -m sim.tools.demo

# make test: everything but what is marked `full` (tests/conftest.py): each sweep's pairwise cover, no slow
# multi-process run. make test-all: exactly what make test leaves out; the two together are the whole suite.
test: $(VENV)/.dev
	$(PY) -m pytest $(PYTEST_ARGS) -m "not full"

test-all: $(VENV)/.dev
	$(PY) -m pytest $(PYTEST_ARGS) -m full

# ruff (in the docs extra, pinned there), with the rules pyproject.toml's [tool.ruff] selects: bugs and dead code
lint: $(VENV)/.docs
	$(PY) -m ruff check .

test-sim: $(VENV)/.dev
	$(PY) -m pytest $(PYTEST_ARGS) tests/sim

test-npu: $(VENV)/.dev
	$(PY) -m sim.tools.npu_check

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(PY) -m mkdocs build --strict

# Build, then open every page offline in headless Chromium (docs/check_site.py); screenshots
# go to site-check/.
docs-check: docs
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || { \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium-headless-shell; }
	$(PY) docs/check_site.py site --shots site-check

# Each benchmark prints its tables (see bench/report.py, the docs' performance page); nothing is
# asserted. What each prints and what it measured are kept in bench/out/ (.txt, .json; ignored by git). The
# performance page renders its tables and draws its figures from the committed bench/results/: KEEP=1 writes
# there instead (make bench KEEP=1), to be committed.
KEEP ?=
bench: $(VENV)/.base
	$(PY) -m bench.all $(if $(filter 1,$(KEEP)),--update-results)

clean:
	rm -rf $(VENV) site site-check .pytest_cache .hypothesis
