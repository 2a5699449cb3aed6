#!/usr/bin/env bash
# On the GPU machine (the device tool's `run`, carry [".whl", ".gpu"], after prepare.sh here):
# the gpu-marked tests, then `pdserve bench router --device cuda` on a SmolLM2-shaped model with
# random weights. Logs go to $OUT. About 5 minutes after the machine starts (on an H200: tests
# 135 s with the set-up, the one-stream level of the bench 190 s).
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export LD_LIBRARY_PATH=/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}  # UCX's CUDA module
nvidia-smi -L; nproc
python3 -c "import torch, transformers, nixl_cu12; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider --timeout 100 -rA -m gpu \
  tests/engine/test_cuda.py tests/serve/test_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "== tests done at +$(( $(date +%s) - t0 )) s"
python3 .gpu/random_model.py .gpu/smollm2 /tmp/smollm2-random 2>&1 | tail -1
timeout "${BENCH_S:-170}" python3 -m pdserve.cli bench router --model /tmp/smollm2-random \
  --device cuda --concurrency "${LEVELS:-1,64}" --repeats 3 --requests 24 2>&1 \
  | tee "$OUT/bench_router_cuda.log" | tail -6
echo "== bench done at +$(( $(date +%s) - t0 )) s"
