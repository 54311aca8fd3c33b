#!/usr/bin/env bash
# Loads `ratewarden serve` on Redis with more calls than it can answer, and
# counts the store calls that timed out: the measurement behind
# docs/redis.md's "The connections' thread".
#
#   1. gRPC: for each N in CLIENTS, N connections each keeping IN_FLIGHT
#      ShouldRateLimit calls in flight for DURATION_S seconds
#      (examples/grpc_load.rs);
#   2. HTTP: wrk with HTTP_CONNECTIONS connections for DURATION_S seconds,
#      POST /v1/check.
#
# Every call decides a key of its own (limit 1,000 per minute), so each is
# one store call that admits; a refusal is the failure policy (`closed`)
# answering for a store call that failed. For each step the table gives the
# calls answered per second, the store calls that timed out and the
# failure policy's answers (both from serve's /metrics, before and after the
# step) and the answered calls' latency. The load generators run at nice 19,
# so that they take the CPU the server leaves, and not the server's.
#
# serve runs on a redis-server started for the run; CLUSTER=1 starts a
# 3-master Redis Cluster instead, STORE=URL uses a Redis of yours. BIN=PATH
# measures another build of ratewarden (an older one, to compare).
#
# Needs redis-server (and redis-cli for CLUSTER=1), wrk, curl and python3
# (Debian: apt-get install redis-server wrk curl python3).
# Usage: scripts/bench-overload.sh [DURATION_S]
#   env: CLIENTS="4 8 16"  IN_FLIGHT=400  HTTP_CONNECTIONS=4000  CLUSTER=0
set -euo pipefail
cd "$(dirname "$0")/.."

duration_s=${1:-10}
clients=${CLIENTS:-4 8 16}
in_flight=${IN_FLIGHT:-400}
http_connections=${HTTP_CONNECTIONS:-4000}
cluster=${CLUSTER:-0}

for tool in redis-server wrk curl python3; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed (Debian: apt-get install $tool)" >&2; exit 1; }
done
if [[ $cluster == 1 ]]; then
    command -v redis-cli >/dev/null || { echo "redis-cli is not installed (Debian: apt-get install redis-tools)" >&2; exit 1; }
fi

cargo build --release --quiet --bin ratewarden --example grpc_load
target="${CARGO_TARGET_DIR:-target}/release"
bin=${BIN:-$target/ratewarden}
load="$target/examples/grpc_load"

# wrk holds one file per connection.
if (( $(ulimit -n) < http_connections + 256 )); then
    ulimit -n "$(( http_connections + 256 ))" 2>/dev/null || {
        echo "the open-file limit ($(ulimit -n), hard $(ulimit -Hn)) is below HTTP_CONNECTIONS + 256: raise it or set HTTP_CONNECTIONS lower" >&2
        exit 1
    }
fi

source scripts/lib.sh

redis_args=(--bind 127.0.0.1 --save "" --appendonly no)
if [[ -n ${STORE:-} ]]; then
    store=$STORE
elif [[ $cluster == 1 ]]; then
    nodes=()
    for i in 1 2 3; do
        port=$(free_port bus)
        mkdir -p "$work/node$i"
        redis-server --port "$port" "${redis_args[@]}" --dir "$work/node$i" \
            --cluster-enabled yes >/dev/null &
        pids+=($!)
        nodes+=("127.0.0.1:$port")
    done
    for node in "${nodes[@]}"; do wait_port "${node#*:}"; done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
    for _ in $(seq 1 100); do
        redis-cli -p "${nodes[0]#*:}" CLUSTER INFO | grep -q cluster_state:ok && break
        sleep 0.1
    done
    store="redis-cluster://$(IFS=,; echo "${nodes[*]}")"
else
    port=$(free_port)
    redis-server --port "$port" "${redis_args[@]}" --dir "$work" >/dev/null &
    pids+=($!)
    wait_port "$port"
    store="redis://127.0.0.1:$port"
fi

cat > "$work/overload.toml" <<TOML
[server]
failure_policy = "closed"
store_timeout_ms = 100

[keys]
limit = 1000
window_ms = 60000

[[domains]]
domain = "api"

[[domains.descriptors]]
key = "user"
limit = 1000
window_ms = 60000
TOML

http=$(free_port); grpc=$(free_port)
RUST_LOG=error "$bin" serve --config "$work/overload.toml" --store "$store" \
    --http "127.0.0.1:$http" --grpc "127.0.0.1:$grpc" >/dev/null &
pids+=($!)
wait_port "$http"; wait_port "$grpc"

# Sums a metric's series, optionally only those with a label.
metric() {
    curl -sSf "http://127.0.0.1:$http/metrics" |
        awk -v name="$1" -v label="${2:-}" '
            index($0, name "{") == 1 && (label == "" || index($0, label) > 0) { sum += $NF }
            END { printf "%d\n", sum }'
}

cat > "$work/unique.lua" <<'LUA'
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
    n = n + 1
    return wrk.format(nil, "/v1/check", nil, '{"key": "k' .. n .. '"}')
end
LUA

echo "$bin serve on $store, failure_policy closed, store_timeout_ms 100, $(nproc) cores, ${duration_s} s a step"
printf '%-28s %10s %10s %14s %12s %10s %10s\n' load "in flight" "answered/s" "store timeouts" "closed answers" p50 p99
step() {
    local name=$1 flight=$2 answered_s p50 p99 timeouts0 closed0 timeouts closed
    shift 2
    timeouts0=$(metric ratewarden_store_errors_total 'kind="timeout"')
    closed0=$(metric ratewarden_failure_policy_decisions_total)
    local out
    out=$(nice -n 19 "$@")
    timeouts=$(( $(metric ratewarden_store_errors_total 'kind="timeout"') - timeouts0 ))
    closed=$(( $(metric ratewarden_failure_policy_decisions_total) - closed0 ))
    if [[ $name == gRPC* ]]; then
        answered_s=$(sed -n 's/^answered [0-9]* (\([0-9]*\)\/s).*/\1/p' <<<"$out")
        p50=$(sed -n 's/.*p50 \([0-9.]*\) ms.*/\1ms/p' <<<"$out")
        p99=$(sed -n 's/.*p99 \([0-9.]*\) ms.*/\1ms/p' <<<"$out")
        local failed
        failed=$(sed -n 's/^failed \([0-9]*\).*/\1/p' <<<"$out")
        if [[ $failed != 0 ]]; then echo "$name: $(grep '^failed' <<<"$out")" >&2; fi
    else
        answered_s=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' <<<"$out")
        p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
        p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
        if grep -q 'Socket errors' <<<"$out"; then echo "$name: $(grep 'Socket errors' <<<"$out")" >&2; fi
    fi
    printf '%-28s %10s %10s %14s %12s %10s %10s\n' "$name" "$flight" "$answered_s" "$timeouts" "$closed" "$p50" "$p99"
}
for n in $clients; do
    step "gRPC, $n connections" "$(( n * in_flight ))" \
        "$load" --addr "127.0.0.1:$grpc" --connections "$n" --in-flight "$in_flight" \
        --duration-s "$duration_s"
done
step "HTTP (wrk), $http_connections connections" "$http_connections" \
    wrk -t1 -c"$http_connections" -d"${duration_s}s" --latency -s "$work/unique.lua" \
    "http://127.0.0.1:$http"
