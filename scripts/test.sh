#!/usr/bin/env bash
# Runs the whole test suite. The Redis tests start their own redis-server
# processes on free loopback ports, so the Redis binaries must be installed;
# tests freeze and stop processes with the external `kill` (procps). This
# script installs what is missing (Debian/Ubuntu).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    missing+=(redis-server redis-tools)
fi
# `type -P`: the program on PATH, not bash's builtin `kill`.
if ! type -P kill >/dev/null; then
    missing+=(procps)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing what the tests need: ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq "${missing[@]}"
fi

cargo test --workspace "$@"
