#!/usr/bin/env bash
# Overload check: `pdserve up` (1 prefill + 1 decode, the default model) under N closed-loop
# streaming clients for D seconds (`pdserve bench serve`), then the counters that say whether
# overload cost anything beyond latency: requests refused (429/503), streams moved or
# retried, decode-side recomputes, and KV leases that expired.
# Usage: tools/overload.sh [STREAMS=64] [SECONDS=120] [PORT=18400] [extra pdserve up flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
streams=${1:-64} seconds=${2:-120} port=${3:-18400}
shift $(( $# < 3 ? $# : 3 ))
log=$(mktemp)
.venv/bin/pdserve up --port "$port" "$@" >"$log" 2>&1 &
up=$!
trap 'kill -INT $up 2>/dev/null; wait $up 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
done
.venv/bin/pdserve bench serve --url "http://127.0.0.1:$port/v1" --workload chat \
    --concurrency "$streams" --duration "$seconds" --timeout 300
echo "== router"
curl -s "http://127.0.0.1:$port/metrics" | grep -E \
    "^pdserve_router_(rejected|migrations|retries|admitted)_total" || true
for w in 1 2; do
    echo "== worker on port $((port + w))"
    curl -s "http://127.0.0.1:$((port + w))/metrics" | grep -E "^pdserve_kv_recomputes_total" \
        || true
done
echo "== KV leases expired: $(grep -c 'lease expired' "$log" || true)"
