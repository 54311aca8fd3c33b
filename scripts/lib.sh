# Shared by the benchmark scripts (bench-serve.sh, bench-overload.sh):
# sourced, not run. Sets `work` (a temporary folder) and `pids` (processes
# to stop), both cleaned up when the script exits.

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# A free loopback port; with `bus`, one whose cluster bus port (the port
# + 10000) is free too, below the ephemeral range so that both stay free.
free_port() {
    python3 - "${1:-}" <<'PY'
import random, socket, sys
def free(p):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        s.close()
if sys.argv[1] != "bus":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); sys.exit()
for _ in range(1000):
    p = random.randint(20000, 22000)
    if free(p) and free(p + 10000):
        print(p); sys.exit()
sys.exit("no free pair of ports (P, P + 10000) found from 20000 to 32000")
PY
}

# Waits (at most 10 s) until something listens on loopback port $1.
wait_port() {
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    exit 1
}
