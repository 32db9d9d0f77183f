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

# CPU benchmarks (each prints ratios against a baseline run in the same process).
bench: setup
	cd bench && ../$(VENV)/python bench_decode.py && ../$(VENV)/python bench_host_overhead.py \
	  && ../$(VENV)/python bench_rejection.py && ../$(VENV)/python bench_block_vs_token.py
