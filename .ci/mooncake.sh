#!/usr/bin/env bash
# Start/stop the Mooncake master the mooncake:// tier's tests use (loopback only).
#
#   .ci/mooncake.sh start   # mooncake_master, RPC on 127.0.0.1:50151, metrics on 127.0.0.1:50152;
#                           # prints "started", "reused" (another run's master is up: that run
#                           # stops it), or "missing" (Mooncake not installed: the tests skip)
#   .ci/mooncake.sh stop    # stop it (by its pid) and remove its directory
#
# Nothing listens beyond loopback: no metadata server runs (clients exchange transfer-engine
# metadata directly, P2PHANDSHAKE; the master's embedded HTTP metadata server binds 0.0.0.0
# whatever --http_metadata_server_host says), --rpc_address and --metrics_host bind the other
# two servers to 127.0.0.1, and start checks every socket the master listens on (ss -ltnp, or
# /proc without ss) and stops it if one is not on 127.0.0.1. The master keeps keys in memory
# only. State (pid, directory) lives in $CI_MOONCAKE_STATE (default /tmp/kvtier-ci-mooncake.state).
set -euo pipefail

STATE_FILE="${CI_MOONCAKE_STATE:-/tmp/kvtier-ci-mooncake.state}"
HOST=127.0.0.1
RPC_PORT=50151
METRICS_PORT=50152
PY="${PYTHON:-python}"

master_binary() {
    "$PY" - <<'EOF' 2>/dev/null
import importlib.util, pathlib
spec = importlib.util.find_spec("mooncake")
for d in (spec.submodule_search_locations or []) if spec else []:
    p = pathlib.Path(d) / "mooncake_master"
    if p.is_file():
        print(p)
        break
EOF
}

accepts() {  # port
    "$PY" -c "import socket,sys; socket.create_connection(('$HOST', int(sys.argv[1])), timeout=0.3).close()" "$1" 2>/dev/null
}

listeners() {  # pid -> one "address:port" per line
    if command -v ss >/dev/null 2>&1; then
        ss -ltnpH 2>/dev/null | awk -v pid="pid=$1," 'index($0, pid) { print $4 }'
    else
        "$PY" -c "
import sys
from kvtier.testing.mooncake_master import listening_addresses
for a, p in listening_addresses(int(sys.argv[1])): print(f'{a}:{p}')" "$1"
    fi
}

stop_pid() {  # pid (only if it is still a mooncake_master: a stale pid may name another process)
    case "$(cat "/proc/$1/comm" 2>/dev/null)" in mooncake_master*) ;; *) return 0 ;; esac
    kill "$1" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.05; done
    kill -9 "$1" 2>/dev/null || true
}

start() {
    local bin
    bin="$(master_binary)"
    if [ -z "$bin" ]; then
        echo "mooncake.sh: Mooncake is not installed; the mooncake tests will skip" >&2
        echo missing
        return 0
    fi
    if [ -f "$STATE_FILE" ]; then
        local pid
        pid="$(sed -n 1p "$STATE_FILE")"
        if kill -0 "$pid" 2>/dev/null && accepts "$RPC_PORT"; then
            echo "mooncake.sh: master of $STATE_FILE already running; reusing it" >&2
            echo reused
            return 0
        fi
        echo "mooncake.sh: stale state $STATE_FILE found; stopping what it left first" >&2
        stop
    fi
    local root
    root="$(mktemp -d /tmp/kvtier-ci-mooncake.XXXXXX)"
    "$bin" --rpc_address="$HOST" --rpc_port="$RPC_PORT" \
        --metrics_host="$HOST" --metrics_port="$METRICS_PORT" \
        --enable_http_metadata_server=false --log_dir="$root" >"$root/master.out" 2>&1 &
    local pid=$!
    printf '%s\n%s\n' "$pid" "$root" > "$STATE_FILE"
    for _ in $(seq 1 200); do
        if accepts "$RPC_PORT"; then break; fi
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "mooncake.sh: mooncake_master exited; see $root/master.out" >&2
            tail -5 "$root/master.out" >&2 || true
            stop
            exit 1
        fi
        sleep 0.05
    done
    accepts "$RPC_PORT" || { echo "mooncake.sh: master did not accept on $HOST:$RPC_PORT" >&2; stop; exit 1; }
    local addrs bad
    addrs="$(listeners "$pid")"
    bad="$(printf '%s\n' "$addrs" | grep -v -E "^(127\.0\.0\.1|\[::1\]|::1):[0-9]+$" | grep -v '^$' || true)"
    if [ -n "$bad" ]; then
        echo "mooncake.sh: the master listens beyond loopback ($(echo $bad)); stopping it" >&2
        stop
        exit 1
    fi
    echo "mooncake.sh: master on $HOST:$RPC_PORT (listening on $(echo $addrs); logs in $root)" >&2
    echo started
}

stop() {
    if [ ! -f "$STATE_FILE" ]; then
        echo "mooncake.sh: nothing to stop" >&2
        return 0
    fi
    local pid root
    pid="$(sed -n 1p "$STATE_FILE")"
    root="$(sed -n 2p "$STATE_FILE")"
    [ -n "$pid" ] && stop_pid "$pid"
    case "$root" in /tmp/kvtier-ci-mooncake.*) rm -rf "$root" ;; esac
    rm -f "$STATE_FILE"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
