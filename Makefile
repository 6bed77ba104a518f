# The two commands a new user runs: `make demo` and `make test`. Each makes .venv when missing and
# installs only what it needs, with pip's progress shown; `make test` after `make demo` adds the rest.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# setuptools' note on where a strict editable install keeps its links (build/, which `make clean`
# removes with the venv) is information, not something to act on: left out of the log.
PIP := PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install
# The editable install is setuptools' strict mode: a tree of links under build/ put on sys.path by a
# .pth file, instead of setuptools' default import hook, which mypy and other type checkers cannot
# follow (with it a `mypy script.py` outside the checkout finds nvfp4_mla and its py.typed). The tree
# shows a file added to src/nvfp4_mla or kernels/ only after the next install, so the installs
# depend on the list of those files, $(VENV)/.package-files.
EDITABLE := --config-settings editable_mode=strict -e
# CPU torch from this machine's local wheel: an unpinned torch would pull a multi-GB CUDA build.
# Elsewhere, without a GPU: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
CUPY_EXTRA ?= cu12

.PHONY: venv demo test test-kernels gpu-check bench clean

# The demo's venv: the package and torch (about 1 GB), plus CuPy and NVRTC ([$(CUPY_EXTRA)]) only
# where `nvidia-smi -L` finds a GPU that can use them.
GPU_EXTRA = $(shell nvidia-smi -L >/dev/null 2>&1 && echo "[$(CUPY_EXTRA)]")

# Rewritten only when a file is added, removed or renamed, so that only that reinstalls.
$(VENV)/.package-files: FORCE
	@mkdir -p $(VENV)
	@find src/nvfp4_mla kernels -name __pycache__ -prune -o -type f -print | LC_ALL=C sort >$@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

FORCE:

$(VENV)/.demo-installed: pyproject.toml Makefile $(VENV)/.package-files
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	@echo "Installing $(TORCH_PIN) and nvfp4-mla$(GPU_EXTRA) into $(VENV) (about 1 GB unpacked)"
	@$(if $(GPU_EXTRA),,echo "No GPU (nvidia-smi -L): CuPy and NVRTC left out; make test adds them")
	$(PIP) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_PIN)" $(EDITABLE) ".$(GPU_EXTRA)"
	touch $@

# The tests' venv adds [$(CUPY_EXTRA)] on every machine (NVRTC compiling every kernel is the CPU
# suite's check of the kernels) and the test and lint tools.
$(VENV)/.test-installed: $(VENV)/.demo-installed pyproject.toml Makefile $(VENV)/.package-files
	$(PIP) $(EDITABLE) ".[test,$(CUPY_EXTRA)]"
	touch $@

venv: $(VENV)/.demo-installed

demo: $(VENV)/.demo-installed
	$(PY) -m nvfp4_mla demo

# Lint, format, types (the hooks of .pre-commit-config.yaml), then the tests (GPU tests skip with their reason on a machine without one) on
# one pytest-xdist worker a core (at most 8), each with one torch thread, all but test_ops_compile.py:
# `make test-kernels` runs that one (NVRTC compiling every kernel for every arch, about 80 s on
# 2 cores), and CI runs both.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$((n < 8 ? n : 8)))

test: $(VENV)/.test-installed
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pre_commit run --all-files --show-diff-on-failure
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --ignore=tests/test_ops_compile.py

test-kernels: $(VENV)/.test-installed
	$(PY) -m pytest -q tests/test_ops_compile.py

# On a GPU machine, with an interpreter that already has torch and CuPy (GPU_PYTHON, default
# python3; nothing is installed), from the source tree: all GPU tests, the sanitizers and the
# benchmarks, logs under $$OUT (or ./gpu-logs); fails when any step fails.
GPU_PYTHON ?= python3

gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash benchmarks/gpu_check.sh

# Results under bench-results/<gpu>/ (never over docs/).
bench:
	PYTHONPATH=src $(GPU_PYTHON) -m nvfp4_mla bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
