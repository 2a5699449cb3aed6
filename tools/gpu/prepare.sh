#!/usr/bin/env bash
# On this (CPU) machine, before a device run: the wheels the GPU machine lacks (it has torch,
# transformers, aiohttp, pytest; Python 3.12) into .whl/, and SmolLM2's config and tokenizer
# into .gpu/smollm2/ (the GGUF is too large to carry; run.sh gives the model random weights).
# Both folders are git-ignored here through .git/info/exclude; name them in the run's carry.
#
#   tools/gpu/prepare.sh        then: run `bash tools/gpu/run.sh` with carry [".whl", ".gpu"]
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.gpu/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .gpu/smollm2
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$@"
}
# openai 3.x needs httpx2, which the GPU machine lacks: the 2.x client runs the tests the same.
get fastcrc cryptography cffi pycparser "openai<3" distro jiter pydantic pydantic-core \
  annotated-types typing-inspection sniffio "nvidia-cuda-runtime-cu12==12.8.*" nixl-cu12
# nixl-cu12 is 68 MB, over the 64 MiB a run carries: drop its expert-parallel kernels
# (nixl_ep_cu12, unused here) and UCX's perftest library, and zip it again (~28 MB).
wheel=$(ls .whl/nixl_cu12-*.whl)
tmp=$(mktemp -d)
(cd "$tmp" && unzip -q "$OLDPWD/$wheel" && rm -rf nixl_ep_cu12 \
  nixl_cu12.libs/ucx/libucx_perftest_cuda.so.* && zip -q -r -9 repacked.whl . -x repacked.whl)
mv "$tmp/repacked.whl" "$wheel" && rm -rf "$tmp"
model="${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/models/smollm2-135m-instruct"
[ -f "$model/config.json" ] || .venv/bin/python -c "from pdserve.common.model_folder import resolve_model; resolve_model('smollm2')"
cp "$model"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2/
cp tools/gpu/random_model.py .gpu/
du -sh .whl .gpu
