#!/usr/bin/env bash
# A throw-away PostgreSQL server on 127.0.0.1 for tests and local many-worker sweeps, from Debian's
# `postgresql` package, no systemd.
#
#   sweeps/local_postgres.sh start [DIR]   install (if missing), initdb + start; prints `export` lines:
#                                          MTPC_PG_DIR, MTPC_PG_PORT, MTPC_PG_URL (postgresql://postgres@127.0.0.1:PORT)
#   sweeps/local_postgres.sh createdb DIR NAME   a database on that server
#   sweeps/local_postgres.sh stop DIR      fast shutdown of the server by its PID (postmaster.pid)
#
# Everything (data, socket, log) lives under DIR (default: a fresh mktemp dir, readable by the
# `postgres` user, which runs the server when the caller is root). Trust authentication on
# 127.0.0.1 only: for tests and a single-user machine, not for a shared cluster (docs/sweeps.md
# says how a real deployment differs). Exit codes: 0 ok, 3 not installable here (reason printed), 1 other.
set -euo pipefail

log() { echo "local_postgres: $*" >&2; }

pg_bin() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    [ -n "$d" ] && [ -x "$d/initdb" ] && echo "$d"
}

install_packages() {
    pg_bin >/dev/null && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "PostgreSQL missing and cannot apt-get install it (needs root and apt-get)"
        return 3
    fi
    local made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # no service start during the install
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    log "installing postgresql (--no-install-recommends)"
    if ! apt-get install -y -q --no-install-recommends postgresql >/tmp/mtpc-postgres-apt.log 2>&1; then
        if ! { apt-get update -q >>/tmp/mtpc-postgres-apt.log 2>&1 &&
            apt-get install -y -q --no-install-recommends postgresql >>/tmp/mtpc-postgres-apt.log 2>&1; }; then
            log "apt-get install postgresql failed (see /tmp/mtpc-postgres-apt.log)"
            rc=3
        fi
    fi
    [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    return "$rc"
}

as_owner() {  # run as the data directory's owner (postgres refuses to run as root)
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cmd=${1:-}
case "$cmd" in
start)
    install_packages || exit $?
    bin=$(pg_bin)
    dir=${2:-$(mktemp -d /tmp/mtpc-postgres.XXXXXX)}
    mkdir -p "$dir/sock"
    chmod 755 "$dir"
    [ "$(id -u)" = 0 ] && chown -R postgres "$dir"
    port=$(free_port)
    as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 ||
        { log "initdb failed: $(tail -n 3 "$dir/initdb.log")"; exit 1; }
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-h 127.0.0.1 -p $port -k $dir/sock -c fsync=off -c max_connections=200" start >/dev/null ||
        { log "server did not start: $(tail -n 5 "$dir/server.log")"; exit 1; }
    echo "export MTPC_PG_DIR=$dir"
    echo "export MTPC_PG_PORT=$port"
    echo "export MTPC_PG_URL=postgresql://postgres@127.0.0.1:$port"
    ;;
createdb)
    dir=${2:?DIR}; name=${3:?NAME}
    port=$(sed -n 4p "$dir/data/postmaster.pid")
    as_owner "$(pg_bin)/createdb" -h 127.0.0.1 -p "$port" -U postgres "$name"
    ;;
stop)
    dir=${2:?DIR}
    pidf="$dir/data/postmaster.pid"
    [ -f "$pidf" ] || exit 0
    pid=$(head -n 1 "$pidf")
    kill -INT "$pid" 2>/dev/null || exit 0  # fast shutdown
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    ;;
*)
    echo "usage: $0 start [DIR] | createdb DIR NAME | stop DIR" >&2
    exit 1
    ;;
esac
