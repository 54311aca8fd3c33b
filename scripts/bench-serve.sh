#!/usr/bin/env bash
# Measures `ratewarden serve` on loopback with wrk, beside nginx, in one run
# on one machine:
#
#   1. nginx answering `return 200` (the ceiling for an HTTP round trip),
#   2. nginx with `limit_req` keyed by a request header,
#   3. ratewarden serve on the embedded store,
#   4. ratewarden serve on Redis (a redis-server started for the run).
#
# Every target gets the same requests: POST /v1/check with a JSON body and
# an X-Key header, the key drawn from KEYS distinct values. ratewarden runs
# the reference configuration (sliding-window-counter, 100 per 1000 ms), so
# each request is one real check.
#
# Needs wrk, nginx and redis-server (Debian: apt-get install wrk nginx
# redis-server). Usage: scripts/bench-serve.sh [DURATION_S] [CONNECTIONS]
# BIN=PATH measures another build of ratewarden (an older one, to compare).
set -euo pipefail
cd "$(dirname "$0")/.."

duration_s=${1:-10}
connections=${2:-32}
threads=${WRK_THREADS:-1}
keys=${KEYS:-10000}

for tool in wrk nginx redis-server; do
    command -v "$tool" >/dev/null || { echo "$tool is not installed (Debian: apt-get install $tool)" >&2; exit 1; }
done

cargo build --release --quiet
bin=${BIN:-${CARGO_TARGET_DIR:-target}/release/ratewarden}

source scripts/lib.sh

# The request every target gets.
cat > "$work/check.lua" <<LUA
local keys = $keys
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
    n = n + 1
    local key = "user:" .. (n % keys)
    wrk.headers["X-Key"] = key
    return wrk.format(nil, "/v1/check", nil, '{"key": "' .. key .. '"}')
end
LUA

nginx_port=$(free_port)
limit_port=$(free_port)
mkdir -p "$work/nginx/logs"
cat > "$work/nginx/nginx.conf" <<CONF
worker_processes auto;
pid $work/nginx/nginx.pid;
error_log $work/nginx/logs/error.log;
daemon off;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $work/nginx/body;
    proxy_temp_path $work/nginx/proxy;
    fastcgi_temp_path $work/nginx/fastcgi;
    uwsgi_temp_path $work/nginx/uwsgi;
    scgi_temp_path $work/nginx/scgi;
    limit_req_zone \$http_x_key zone=keys:64m rate=100r/s;
    server {
        listen 127.0.0.1:$nginx_port;
        location / { return 200 "ok\n"; }
    }
    server {
        listen 127.0.0.1:$limit_port;
        location / { limit_req zone=keys burst=100 nodelay; limit_req_status 429; return 200 "ok\n"; }
    }
}
CONF
nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" &
pids+=($!)

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" >/dev/null &
pids+=($!)

mem_http=$(free_port); mem_grpc=$(free_port)
RUST_LOG=warn "$bin" serve --http "127.0.0.1:$mem_http" --grpc "127.0.0.1:$mem_grpc" >/dev/null &
pids+=($!)

wait_port "$redis_port"
redis_http=$(free_port); redis_grpc=$(free_port)
RUST_LOG=warn "$bin" serve --store "redis://127.0.0.1:$redis_port" \
    --http "127.0.0.1:$redis_http" --grpc "127.0.0.1:$redis_grpc" >/dev/null &
pids+=($!)

for port in "$nginx_port" "$limit_port" "$mem_http" "$redis_http"; do wait_port "$port"; done

echo "$bin; wrk -t$threads -c$connections -d${duration_s}s --latency, POST /v1/check over $keys keys, $(nproc) cores"
printf '%-34s %12s %10s %10s %10s\n' target "requests/s" "p50" "p99" "non-2xx"
run() {
    local name=$1 port=$2 out
    out=$(wrk -t"$threads" -c"$connections" -d"${duration_s}s" --latency -s "$work/check.lua" "http://127.0.0.1:$port")
    local rps p50 p99 non2xx
    rps=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
    p50=$(awk '$1 == "50%" {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {print $2}' <<<"$out")
    non2xx=$(awk '/Non-2xx/ {print $5}' <<<"$out")
    printf '%-34s %12s %10s %10s %10s\n' "$name" "$rps" "$p50" "$p99" "${non2xx:-0}"
}
run "nginx return 200" "$nginx_port"
run "nginx limit_req" "$limit_port"
run "ratewarden serve (memory)" "$mem_http"
run "ratewarden serve (redis)" "$redis_http"
