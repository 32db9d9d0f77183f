# The two quickstart commands: `make demo` and `make test`. Each sets up what it needs.
.PHONY: setup demo test test-all bench
VENV := .venv/bin

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/specloop generate --prompt "Tell me about llamas." --max-tokens 64

# The whole CPU suite; GPU tests skip without CUDA.
test: setup
	$(VENV)/python -m pytest -q -rs tests

bench: setup
	$(VENV)/python bench/run_all.py
