#!/usr/bin/env bash
# Counts the instructions redis-server spends per EVALSHA call of each
# policy's script and of the benchmark's minimal sliding-window counter,
# under valgrind's callgrind: a count that the machine's other load cannot
# move, unlike `usec_per_call`. Each script runs in a fresh redis-server on
# a private Unix socket, driven by redis-benchmark (CALLS calls over 1000
# keys, pipeline 16, Redis TIME), with the reference configuration (100 per
# 1000 ms); only the instructions inside EVALSHA are counted.
#
# Usage: scripts/redis-script-cost.sh [CALLS]   (default 5000; about 40 s
# for the six scripts). Needs redis-server, redis-benchmark, redis-cli, valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
calls="${1:-5000}"
case "$calls" in
    '' | *[!0-9]*) echo "CALLS must be a number, not $calls" >&2; exit 2 ;;
esac
if [ "$calls" -lt 100 ] || [ "$calls" -gt 1000000 ]; then
    echo "use 100 to 1000000 calls" >&2
    exit 2
fi
for tool in redis-server redis-benchmark redis-cli valgrind callgrind_annotate; do
    command -v "$tool" >/dev/null || { echo "$tool not found (Debian: redis-server redis-tools valgrind)" >&2; exit 2; }
done
work="$(mktemp -d)"
server_pid=""
cleanup() {
    [ -z "$server_pid" ] || kill "$server_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

lua=crates/redis/src/lua
# As RedisStore calls a script for the reference configuration with the
# default options: limit, window_ms, burst, cost, now_ms ('' reads Redis
# TIME), ttl_grace_ms, max_ttl_ms.
args=(100 1000 100 1 "" 0 1099511627776)

# measure NAME FILE ARGS...: prints NAME and instructions per call.
measure() {
    local name="$1" file="$2"
    shift 2
    local dir="$work/$name"
    mkdir -p "$dir"
    valgrind --tool=callgrind --toggle-collect=evalGenericCommand \
        --callgrind-out-file="$dir/callgrind.out" \
        redis-server --port 0 --unixsocket "$dir/sock" --save "" --appendonly no \
        --dir "$dir" >"$dir/log" 2>&1 &
    server_pid=$!
    for _ in $(seq 300); do
        redis-cli -s "$dir/sock" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    local sha
    sha="$(redis-cli -s "$dir/sock" script load "$(cat "$file")")"
    redis-benchmark -s "$dir/sock" -n "$calls" -c 1 -P 16 -r 1000 -q \
        EVALSHA "$sha" 1 "k:$name:__rand_int__" "$@" >/dev/null
    local calls_done
    calls_done="$(redis-cli -s "$dir/sock" info commandstats |
        sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),.*/\1/p')"
    redis-cli -s "$dir/sock" shutdown nosave >/dev/null 2>&1 || true
    wait "$server_pid" || true
    server_pid=""
    local total
    total="$(sed -n 's/^summary: \([0-9]*\).*/\1/p' "$dir/callgrind.out")"
    if [ -z "$total" ] || [ -z "$calls_done" ] || [ "$calls_done" -eq 0 ]; then
        echo "no count for $name (see $dir/log)" >&2
        exit 1
    fi
    printf '%-24s %8d calls %10d instructions/call\n' "$name" "$calls_done" $((total / calls_done))
    per_call[$name]=$((total / calls_done))
}

declare -A per_call

measure minimal-swc src/cmd/lua/minimal_swc.lua 100 1000
for policy in fixed-window sliding-window-counter sliding-log token-bucket gcra; do
    file="$work/${policy}.lua"
    cat "$lua/prelude.lua" "$lua/${policy//-/_}.lua" >"$file"
    measure "$policy" "$file" "${args[@]}"
done
awk -v ours="${per_call[sliding-window-counter]}" -v minimal="${per_call[minimal-swc]}" \
    'BEGIN { printf "sliding-window-counter / minimal-swc: %.2fx instructions per call\n", ours / minimal }'
