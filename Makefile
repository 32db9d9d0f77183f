# The two quickstart commands: `make demo` and `make test`. Each sets up what it needs.
.PHONY: setup demo test test-fast test-all bench typecheck
VENV := .venv/bin

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/specloop generate --prompt "Tell me about llamas." --max-tokens 64

# Tests run on one pytest-xdist worker per core (one torch thread each, tests/conftest.py);
# tests sharing an expensive session fixture, and the multi-process ones, are grouped onto
# one worker (`--dist loadgroup`). Plain `pytest` without -n runs everything in-process.
PYTEST := $(VENV)/python -m pytest -q -rs -n auto --dist loadgroup
# Bytecode caching on for the test run, even where the environment turns it off: else every
# process the suite starts (2 workers, ~30 CLI/torchrun/serve children) compiles the
# project and the assertion-rewritten test modules afresh (~4 s of CPU per worker).
unexport PYTHONDONTWRITEBYTECODE

# The whole CPU suite; GPU tests skip without CUDA.
test: setup
	$(PYTEST) tests

# What to run on every change: no slow or multi-process tests. Sets up .venv only when
# pyproject.toml or setup.sh changed since the last setup (a pip run costs tens of seconds).
test-fast: .venv/.setup-stamp
	$(PYTEST) -m "not slow and not distributed" tests

.venv/.setup-stamp: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

# mypy, strict on the public packages (pyproject.toml [tool.mypy]); also run by
# tests/test_typecheck.py in test and test-fast.
typecheck: .venv/.setup-stamp
	$(VENV)/python scripts/typecheck.py

# CPU benchmarks (each prints ratios against a baseline run in the same process).
bench: setup
	cd bench && ../$(VENV)/python bench_decode.py && ../$(VENV)/python bench_host_overhead.py \
	  && ../$(VENV)/python bench_rejection.py && ../$(VENV)/python bench_block_vs_token.py
