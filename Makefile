# The two commands a new user runs: `make demo` and `make test`. Each makes .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU torch from this machine's local wheel: an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
CUPY_EXTRA ?= cu12

.PHONY: venv demo test gpu-check bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,$(CUPY_EXTRA)]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m nvfp4_mla demo

test: venv
	$(PY) -m pytest -q

# On a GPU machine whose python3 already has torch and CuPy (no install): all GPU tests, the
# sanitizers and the benchmark, logs under $$OUT (or ./gpu-logs).
gpu-check:
	bash benchmarks/gpu_check.sh

bench:
	PYTHONPATH=src $(PYTHON) -m nvfp4_mla bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
