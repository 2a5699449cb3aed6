#!/usr/bin/env bash
# Serve SmolLM2 with vLLM's CPU build, pinned to the cores pdserve uses, as the external peer of
# `pdserve bench compare --external vllm=URL` (docs/vllm.md). Runs in the foreground; Ctrl-C or
# SIGTERM stops every process it started (each server is its own process group).
#
#   tools/vllm/serve.sh collocated [--port 8200]   one server on all the cores (like
#                                                  `pdserve up --collocated 1`)
#   tools/vllm/serve.sh disagg [--port 8200]       prefill server on the first half of the
#                                                  cores, decode server on the second half (like
#                                                  `pdserve up`), NixlConnector between them,
#                                                  tools/vllm/pd_proxy.py on --port (unpinned,
#                                                  like pdserve's router)
#
# Options: --port P (8200; disagg also uses P+1, P+2 for the servers and P+3, P+4 for NIXL's
# side channels), --model DIR (pdserve's SmolLM2 folder), --cpus LIST (default: the cores this
# shell may use), --kv-cache-bytes N (per server, 512M like pdserve's default), --max-num-seqs N
# (64, pdserve's default), --enforce-eager (skip torch.compile: faster start, slower steps),
# --nixl-progress-thread on|off (disagg; on = NIXL's default, see docs/vllm.md),
# --omp-threads-bind LIST (collocated: the cores of the model's OpenMP threads; default all of
# --cpus), --ready-timeout S (900), --log-dir DIR; anything after `--` goes to every vLLM
# server.
# Env: VLLM_VENV (/work/vllm-venv, made by tools/vllm/setup.sh).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VENV=${VLLM_VENV:-/work/vllm-venv}
PY=$VENV/bin/python

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

MODE=${1:-}
case "$MODE" in
    collocated|disagg) shift ;;
    -h|--help) usage 0 ;;
    *) echo "serve.sh: first argument must be collocated or disagg" >&2; usage 2 ;;
esac

PORT=8200
MODEL=${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/models/smollm2-135m-instruct
CPUS=$("$PY" -c 'import os; print(",".join(map(str, sorted(os.sched_getaffinity(0)))))' \
       2>/dev/null || echo 0)
KV_BYTES=512M
MAX_SEQS=64
EAGER=()
PROGRESS_THREAD=on
OMP_BIND=
READY_TIMEOUT=900
LOG_DIR=
EXTRA=()
while (($#)); do
    case "$1" in
        --port) PORT=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --cpus) CPUS=$2; shift 2 ;;
        --kv-cache-bytes) KV_BYTES=$2; shift 2 ;;
        --max-num-seqs) MAX_SEQS=$2; shift 2 ;;
        --enforce-eager) EAGER=(--enforce-eager); shift ;;
        --nixl-progress-thread) PROGRESS_THREAD=$2; shift 2 ;;
        --omp-threads-bind) OMP_BIND=$2; shift 2 ;;
        --ready-timeout) READY_TIMEOUT=$2; shift 2 ;;
        --log-dir) LOG_DIR=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) usage 0 ;;
        *) echo "serve.sh: unknown option $1" >&2; usage 2 ;;
    esac
done

die() { echo "serve.sh: $*" >&2; exit 2; }
[[ -x $PY ]] || die "no vLLM venv at $VENV (run tools/vllm/setup.sh)"
[[ -f $MODEL/config.json ]] || die "no Hugging Face model folder at $MODEL (run 'make demo' once: it converts SmolLM2 there)"
[[ $PROGRESS_THREAD == on || $PROGRESS_THREAD == off ]] || die "--nixl-progress-thread takes on or off"
ports=("$PORT")
[[ $MODE == disagg ]] && ports+=($((PORT + 1)) $((PORT + 2)) $((PORT + 3)) $((PORT + 4)))
for p in "${ports[@]}"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then die "port $p is already in use"; fi
done

# --cpus "0-3,6" -> "0 1 2 3 6"
expand_cpus() {
    local part out=()
    IFS=, read -ra parts <<<"$1"
    for part in "${parts[@]}"; do
        if [[ $part == *-* ]]; then out+=($(seq "${part%-*}" "${part#*-}")); else out+=("$part"); fi
    done
    echo "${out[@]}"
}
read -ra CORES <<<"$(expand_cpus "$CPUS")"
join() { local IFS=,; echo "$*"; }

LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/vllm-serve.XXXXXX")}
mkdir -p "$LOG_DIR"

# Settings every vLLM server gets.
#   HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: the model is a local folder; never reach for the Hub.
#   VLLM_NO_USAGE_STATS / DO_NOT_TRACK: no usage reporting.
#   VLLM_CPU_OMP_THREADS_BIND: the cores of the server's OpenMP threads, one thread per core.
#     Its default, auto, holds cores back for the engine-core process (one per server, one
#     more under a KV connector): collocated on 2 cores would run the model on 1 core.
#   VLLM_CPU_KVCACHE_SPACE is unset: it is an integer in GiB and, when set, overrides
#     --kv-cache-memory-bytes, which takes the 512M that matches pdserve's default pool.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
unset VLLM_CPU_KVCACHE_SPACE
VLLM_ARGS=(--model "$MODEL" --served-model-name smollm2 --dtype bfloat16 --host 127.0.0.1
           --max-model-len 2048 --max-num-seqs "$MAX_SEQS" --kv-cache-memory-bytes "$KV_BYTES"
           --disable-uvicorn-access-log "${EAGER[@]}" "${EXTRA[@]}")

PIDS=()    # leaders of the process groups we started (setsid: pid == pgid)
NAMES=()
STOPPING=0

stop_all() {
    ((STOPPING)) && return
    STOPPING=1
    ((${#PIDS[@]})) || return 0
    local pid i alive
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    for ((i = 0; i < 150; i++)); do  # up to 15 s for vLLM's own clean shutdown
        alive=0
        for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
    wait 2>/dev/null
    echo "serve.sh: stopped (logs in $LOG_DIR)" >&2
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap 'stop_all' EXIT

# start NAME CORES LOG ENV... -- CMD...: a new session (own process group), pinned when CORES.
start() {
    local name=$1 cores=$2 log=$3; shift 3
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done
    shift
    if [[ -n $cores ]]; then
        setsid env "${envs[@]}" taskset -c "$cores" "$@" >"$log" 2>&1 </dev/null &
    else
        setsid env "${envs[@]}" "$@" >"$log" 2>&1 </dev/null &
    fi
    PIDS+=($!)
    NAMES+=("$name")
}

# wait_ready URL...: until every URL/health answers 200; fails if a process dies or on timeout.
wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT)) url ok i
    while :; do
        ok=1
        for url in "$@"; do curl -sf -o /dev/null --max-time 2 "$url/health" || ok=0; done
        ((ok)) && return 0
        for i in "${!PIDS[@]}"; do
            if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
                echo "serve.sh: ${NAMES[$i]} exited during start-up; its log ends:" >&2
                tail -n 25 "$LOG_DIR/${NAMES[$i]}.log" >&2
                return 1
            fi
        done
        ((SECONDS < deadline)) || { echo "serve.sh: not ready after ${READY_TIMEOUT}s" >&2; return 1; }
        sleep 1
    done
}

# pin_group PGID CORES: every thread of every process in the group onto CORES. Needed after
# start-up in disagg mode: vLLM's NixlConnector worker calls sched_setaffinity on its own
# thread (the model runner's main thread) with the last core of the NUMA node, whatever
# taskset said, which on this machine moves the prefill server's compute onto the decode core.
pin_group() {
    local pid
    for pid in $(pgrep -g "$1"); do taskset -a -p -c "$2" "$pid" >/dev/null 2>&1; done
}

T0=$SECONDS
if [[ $MODE == collocated ]]; then
    cores=$(join "${CORES[@]}")
    echo "serve.sh: vLLM collocated on cores $cores, port $PORT (logs in $LOG_DIR)" >&2
    start vllm "$cores" "$LOG_DIR/vllm.log" VLLM_CPU_OMP_THREADS_BIND="${OMP_BIND:-$cores}" -- \
        "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port "$PORT"
    wait_ready "http://127.0.0.1:$PORT" || exit 1
else
    ((${#CORES[@]} >= 2)) || die "disagg needs at least 2 cores, --cpus gave ${CORES[*]}"
    half=$((${#CORES[@]} / 2))
    pcores=$(join "${CORES[@]:0:half}")
    dcores=$(join "${CORES[@]:half}")
    kv='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
    echo "serve.sh: vLLM prefill on cores $pcores (port $((PORT + 1))), decode on cores" \
         "$dcores (port $((PORT + 2))), proxy on port $PORT (logs in $LOG_DIR)" >&2
    nixl_env=(PYTHONPATH="$HERE/nixl_shim${PYTHONPATH:+:$PYTHONPATH}"
              VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
              PDSERVE_NIXL_PROGRESS_THREAD=$([[ $PROGRESS_THREAD == on ]] && echo 1 || echo 0))
    start prefill "$pcores" "$LOG_DIR/prefill.log" "${nixl_env[@]}" \
        VLLM_CPU_OMP_THREADS_BIND="$pcores" VLLM_NIXL_SIDE_CHANNEL_PORT=$((PORT + 3)) -- \
        "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port $((PORT + 1)) \
        --kv-transfer-config "$kv"
    start decode "$dcores" "$LOG_DIR/decode.log" "${nixl_env[@]}" \
        VLLM_CPU_OMP_THREADS_BIND="$dcores" VLLM_NIXL_SIDE_CHANNEL_PORT=$((PORT + 4)) -- \
        "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port $((PORT + 2)) \
        --kv-transfer-config "$kv"
    wait_ready "http://127.0.0.1:$((PORT + 1))" "http://127.0.0.1:$((PORT + 2))" || exit 1
    pin_group "${PIDS[0]}" "$pcores"
    pin_group "${PIDS[1]}" "$dcores"
    start proxy "" "$LOG_DIR/proxy.log" -- "$PY" "$HERE/pd_proxy.py" --port "$PORT" \
        --prefill "http://127.0.0.1:$((PORT + 1))" --decode "http://127.0.0.1:$((PORT + 2))"
    wait_ready "http://127.0.0.1:$PORT" || exit 1
fi

echo "serve.sh: vLLM $MODE ready in $((SECONDS - T0)) s"
echo "http://127.0.0.1:$PORT/v1"

# Stay in the foreground until a signal, or until a server dies (then stop the rest).
while :; do
    for i in "${!PIDS[@]}"; do
        if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
            echo "serve.sh: ${NAMES[$i]} exited; stopping the rest" >&2
            exit 1
        fi
    done
    sleep 1 &
    wait $! 2>/dev/null
done
