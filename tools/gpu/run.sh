#!/usr/bin/env bash
# On the GPU machine (the device tool's `run`, carry [".whl", ".gpu"], after prepare.sh here):
#  1. the gpu-marked tests, and the tests of the Triton kernels (paged attention, CRC32C) and of
#     the decode graphs, compiled for the GPU rather than interpreted;
#  2. `pdserve bench engine --device cuda` on a SmolLM2-shaped model with random weights,
#     decode steps from CUDA graphs, then the same with --enforce-eager (decode batch
#     1/8/32/128, prefill of 1,000 and 8,191 tokens; beside transformers on the same GPU and
#     its measured memory read and matmul peak), one JSON object per row;
#  3. `pdserve bench transfer --device cuda`: KV in VRAM moved over NIXL between two processes
#     on the GPU, beside a device-to-device copy; the session's CRC32C on the GPU; then
#     `pdserve bench layerwise --device cuda`: a 2,000-token prompt's KV streamed layer by layer
#     from a prefill engine on the GPU to a second process's GPU pool, against whole;
#  4. with ROUTER=1, `pdserve bench router --device cuda` as before.
# Everything lands in $OUT. Each part is bounded (TEST_S 210 s, BENCH_S 120 s per bench engine
# run, TRANSFER_S 90 s, LAYERWISE_S 60 s): at most ~10 minutes after the machine starts, most
# likely 5-6 (none of these parts has run on a GPU yet; the tests alone took 135 s on an H200
# before them).
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
export LD_LIBRARY_PATH=/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}  # UCX's CUDA module
nvidia-smi -L; nproc
python3 -c "import torch, transformers, nixl_cu12; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
python3 -c "import triton; print('triton', triton.__version__)" || echo "no triton: SDPA, no graphs"
timeout "${TEST_S:-210}" python3 -m pytest -q -p no:cacheprovider --timeout 120 -rA \
  tests/engine/test_triton_paged.py tests/engine/test_decode_graphs.py tests/engine/test_cuda.py \
  tests/transfer/test_device_crc32c.py tests/bench/test_transfer_bench_device.py \
  tests/bench/test_layerwise_bench.py \
  tests/serve/test_cuda.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -30
echo "== tests done at +$(( $(date +%s) - t0 )) s"
python3 .gpu/random_model.py .gpu/smollm2 /tmp/smollm2-random 2>&1 | tail -1
bench() {  # $1: a name for the files, then bench engine's extra flags
  local name=$1; shift
  timeout "${BENCH_S:-120}" python3 -m pdserve.cli bench engine --model /tmp/smollm2-random \
    --device cuda --dtype bfloat16 --batches 1,8,32,128 --prompt-lens 1000,8191 \
    --cached-len 0 --chunk 0 --repeats 3 --json "$@" \
    > "$OUT/bench_engine_cuda_$name.jsonl" 2> "$OUT/bench_engine_cuda_$name.log"
  echo "== bench engine ($name) rc=$? at +$(( $(date +%s) - t0 )) s"
  tail -3 "$OUT/bench_engine_cuda_$name.log"; cat "$OUT/bench_engine_cuda_$name.jsonl"
}
bench graphs
bench eager --enforce-eager --prompt-lens 1000  # graphs change decode steps only
timeout "${TRANSFER_S:-90}" python3 -m pdserve.cli bench transfer --device cuda \
  --sizes 16,256 --repeats 3 --json > "$OUT/bench_transfer_cuda.jsonl" \
  2> "$OUT/bench_transfer_cuda.log"
echo "== bench transfer rc=$? at +$(( $(date +%s) - t0 )) s"; cat "$OUT/bench_transfer_cuda.jsonl"
timeout "${LAYERWISE_S:-60}" python3 -m pdserve.cli bench layerwise --device cuda \
  --model /tmp/smollm2-random --transport nixl --prompt-tokens 2000 --repeats 5 --json \
  > "$OUT/bench_layerwise_cuda.jsonl" 2> "$OUT/bench_layerwise_cuda.log"
echo "== bench layerwise rc=$? at +$(( $(date +%s) - t0 )) s"; cat "$OUT/bench_layerwise_cuda.jsonl"
if [ "${ROUTER:-0}" = 1 ]; then
  timeout "${ROUTER_S:-170}" python3 -m pdserve.cli bench router --model /tmp/smollm2-random \
    --device cuda --concurrency "${LEVELS:-1,64}" --repeats 3 --requests 24 2>&1 \
    | tee "$OUT/bench_router_cuda.log" | tail -6
  echo "== bench router done at +$(( $(date +%s) - t0 )) s"
fi
