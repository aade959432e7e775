#!/usr/bin/env bash
# Start/stop the Redis servers the remote-tier tests use (loopback only).
#
#   .ci/redis.sh start   # standalone on 127.0.0.1:6399, 3-node cluster on 127.0.0.1:7100-7102;
#                        # prints "started", or "reused" when another run's servers are up
#                        # (then that run stops them, not this caller)
#   .ci/redis.sh stop    # stop them and remove their data directory
#
# Installs redis-server with apt-get if it is missing. Data lives in a temp dir
# recorded in $KVTIER_REDIS_STATE (default /tmp/kvtier-ci-redis.state). Persistence
# is off (no RDB/AOF): these servers hold a cache only. maxmemory bounds each
# server and allkeys-lru evicts, the capacity model the Redis tier documents.
set -euo pipefail

STATE_FILE="${KVTIER_REDIS_STATE:-/tmp/kvtier-ci-redis.state}"
STANDALONE_PORT=6399
CLUSTER_PORTS=(7100 7101 7102)
HOST=127.0.0.1

ensure_redis() {
    if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
        return
    fi
    echo "redis.sh: installing redis-server" >&2
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update
    $sudo apt-get install -y redis-server
}

wait_ping() {  # port
    for _ in $(seq 1 100); do
        if redis-cli -h "$HOST" -p "$1" ping 2>/dev/null | grep -q PONG; then return 0; fi
        sleep 0.05
    done
    echo "redis.sh: server on port $1 did not answer PING" >&2
    return 1
}

start_server() {  # port dir extra-args...
    local port="$1" dir="$2"; shift 2
    mkdir -p "$dir"
    redis-server --bind "$HOST" --port "$port" --protected-mode yes \
        --dir "$dir" --save "" --appendonly no --daemonize yes \
        --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" \
        --maxmemory 512mb --maxmemory-policy allkeys-lru "$@"
    wait_ping "$port"
}

all_alive() {  # every server of the state answers and the cluster is ok
    local p
    for p in "$STANDALONE_PORT" "${CLUSTER_PORTS[@]}"; do
        redis-cli -h "$HOST" -p "$p" ping 2>/dev/null | grep -q PONG || return 1
    done
    redis-cli -h "$HOST" -p "${CLUSTER_PORTS[0]}" cluster info 2>/dev/null | grep -q "cluster_state:ok"
}

start() {
    ensure_redis
    if [ -f "$STATE_FILE" ]; then
        if all_alive; then
            # Another run (a second test.sh on this machine) started them and uses them now:
            # reuse them, and say so on stdout so the caller does not stop them at its end.
            echo "redis.sh: servers of $STATE_FILE already running; reusing them" >&2
            echo reused
            return 0
        fi
        # A previous run that was never stopped (killed session, crashed CI step):
        # stop whatever it left, then start afresh.
        echo "redis.sh: stale state $STATE_FILE found; stopping its servers first" >&2
        stop
    fi
    local root
    root="$(mktemp -d /tmp/kvtier-ci-redis.XXXXXX)"
    echo "$root" > "$STATE_FILE"
    start_server "$STANDALONE_PORT" "$root/standalone"
    local addrs=()
    for p in "${CLUSTER_PORTS[@]}"; do
        start_server "$p" "$root/cluster-$p" --cluster-enabled yes \
            --cluster-config-file "$root/cluster-$p/nodes.conf" --cluster-node-timeout 2000
        addrs+=("$HOST:$p")
    done
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >"$root/cluster-create.log"
    for _ in $(seq 1 100); do
        if redis-cli -h "$HOST" -p "${CLUSTER_PORTS[0]}" cluster info | grep -q "cluster_state:ok"; then
            echo "redis.sh: standalone on $HOST:$STANDALONE_PORT, cluster on $HOST:${CLUSTER_PORTS[0]}-${CLUSTER_PORTS[-1]} (data in $root)" >&2
            echo started
            return 0
        fi
        sleep 0.1
    done
    echo "redis.sh: cluster did not reach cluster_state:ok" >&2
    exit 1
}

stop() {
    if [ ! -f "$STATE_FILE" ]; then
        echo "redis.sh: nothing to stop" >&2
        return 0
    fi
    local root
    root="$(cat "$STATE_FILE")"
    for dir in "$root"/standalone "$root"/cluster-*; do
        [ -f "$dir/redis.pid" ] || continue
        local pid
        pid="$(cat "$dir/redis.pid")"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
        kill -9 "$pid" 2>/dev/null || true
    done
    case "$root" in /tmp/kvtier-ci-redis.*) rm -rf "$root" ;; esac
    rm -f "$STATE_FILE"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
