#!/usr/bin/env bash
# Runs the whole test suite. The Redis tests start their own redis-server
# processes on free loopback ports, so the Redis binaries must be installed;
# this script installs them (Debian/Ubuntu) when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "redis-server/redis-cli not found: installing redis-server and redis-tools" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq redis-server redis-tools
fi

cargo test --workspace "$@"
