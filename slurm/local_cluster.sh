#!/usr/bin/env bash
# A real one-node SLURM cluster on 127.0.0.1 for tests and demos, from Debian's packages, no systemd.
#
#   slurm/local_cluster.sh start [DIR]   install (if missing) + start munged, slurmctld, slurmd;
#                                        prints `export SLURM_CONF=...` lines for the caller to eval
#   slurm/local_cluster.sh stop DIR      scancel everything, stop daemons and stray job processes by PID
#   slurm/local_cluster.sh install       only install the packages (root, apt-get)
#
# Everything (munge key + socket, slurm.conf, state, spool, logs, pid files) lives under DIR
# (default: a fresh mktemp dir). Client commands need SLURM_CONF=DIR/slurm.conf in their environment.
# Not for production: root is SlurmUser, no accounting database (use `scontrol show job`), no cgroups.
# Exit codes: 0 ok, 3 packages missing and not installable (the reason is printed), 1 other errors.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge)

log() { echo "local_cluster: $*" >&2; }

have_binaries() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
        { command -v munged >/dev/null || test -x /usr/sbin/munged; }
}

install_packages() {
    have_binaries && return 0
    if [ "$(id -u)" != 0 ]; then
        log "SLURM binaries missing and not root: cannot apt-get install ${PKGS[*]}"
        return 3
    fi
    if ! command -v apt-get >/dev/null; then
        log "SLURM binaries missing and no apt-get on this machine"
        return 3
    fi
    # Block service starts during the install (no stray system munged/slurmd on default ports).
    local made_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    export DEBIAN_FRONTEND=noninteractive
    log "installing ${PKGS[*]} (--no-install-recommends)"
    if ! apt-get install -y -q --no-install-recommends "${PKGS[@]}" >/tmp/mtpc-slurm-apt.log 2>&1; then
        log "apt-get install failed; running apt-get update once and retrying"
        if ! { apt-get update -q >>/tmp/mtpc-slurm-apt.log 2>&1 &&
            apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>/tmp/mtpc-slurm-apt.log 2>&1; }; then
            log "apt-get install ${PKGS[*]} failed (see /tmp/mtpc-slurm-apt.log): $(tail -n 2 /tmp/mtpc-slurm-apt.log | tr '\n' ' ')"
            rc=3
        fi
    fi
    [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    return "$rc"
}

free_port() {
    python3 - <<'EOF' 2>/dev/null || echo $((20000 + RANDOM % 20000))
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
EOF
}

wait_for() {  # wait_for SECONDS CMD... : retry CMD until it succeeds
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.3
    done
}

start() {
    local dir="${1:-}"
    install_packages || exit $?
    [ -n "$dir" ] || dir=$(mktemp -d /tmp/mtpc-slurm.XXXXXX)
    mkdir -p "$dir"/{state,spool,log,munge}
    dir=$(cd "$dir" && pwd)
    local munged=/usr/sbin/munged
    command -v munged >/dev/null && munged=$(command -v munged)

    # munge: own key, socket, pid and log under DIR
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
    chmod 700 "$dir/munge"
    chmod 400 "$dir/munge/munge.key"
    "$munged" --foreground --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed" >>"$dir/log/munged.out" 2>&1 &
    echo $! >"$dir/munged.pid"
    if ! wait_for 15 test -S "$dir/munge/munge.sock"; then
        log "munged did not create its socket; log: $(tail -n 5 "$dir/log/munged.log" "$dir/log/munged.out" 2>/dev/null)"
        stop "$dir"
        exit 1
    fi

    local host node_line ctld_port d_port
    host=$(hostname -s)
    # `slurmd -C` prints this machine's node line (NodeName=... CPUs=... RealMemory=...), then UpTime.
    node_line=$(slurmd -C | grep '^NodeName=' | head -n 1)
    ctld_port=$(free_port)
    d_port=$(free_port)
    while [ "$d_port" = "$ctld_port" ]; do d_port=$(free_port); done
    local mem
    mem=$(echo "$node_line" | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    cat >"$dir/slurm.conf" <<EOF
# written by slurm/local_cluster.sh: a one-node test cluster on 127.0.0.1
ClusterName=mtpc-local
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${dir}/munge/munge.sock
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool
SlurmctldPidFile=${dir}/slurmctld.daemon.pid
SlurmdPidFile=${dir}/slurmd.daemon.pid
SlurmctldLogFile=${dir}/log/slurmctld.log
SlurmdLogFile=${dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${dir}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$(( ${mem:-2048} / 8 > 256 ? ${mem:-2048} / 8 : 256 ))
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=300
KillWait=5
SlurmctldTimeout=30
SlurmdTimeout=30
${node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -D -i -f "$SLURM_CONF" >>"$dir/log/slurmctld.out" 2>&1 &
    echo $! >"$dir/slurmctld.pid"
    slurmd -D -f "$SLURM_CONF" >>"$dir/log/slurmd.out" 2>&1 &
    echo $! >"$dir/slurmd.pid"
    if ! wait_for 30 scontrol ping; then
        log "slurmctld did not answer; log: $(tail -n 5 "$dir/log/slurmctld.log" "$dir/log/slurmctld.out" 2>/dev/null)"
        stop "$dir"
        exit 1
    fi
    # the node must be up (idle) before jobs can start
    if ! wait_for 30 bash -c "sinfo -h -o %T | grep -Eq '^(idle|mixed|allocated)'"; then
        log "node did not become idle: $(sinfo -h -N -o '%N %T %E' 2>&1); slurmd log: $(tail -n 5 "$dir/log/slurmd.log" 2>/dev/null)"
        stop "$dir"
        exit 1
    fi
    log "cluster up in $dir (node: ${host})"
    echo "export SLURM_CONF=$dir/slurm.conf"
    echo "export MTPC_SLURM_DIR=$dir"
}

kill_pidfile() {  # kill_pidfile FILE: SIGTERM the pid, wait up to 5 s, then SIGKILL
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    [ -n "$pid" ] || return 0
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

stray_job_pids() {  # processes whose environment names this cluster's slurm.conf (job steps, their children)
    local dir=$1 conf="SLURM_CONF=$1/slurm.conf" p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = "$$" ] || [ "$p" = "$PPID" ] && continue
        if grep -qzxF "$conf" "/proc/$p/environ" 2>/dev/null; then
            # only job processes: they carry SLURM_JOB_ID
            grep -qz '^SLURM_JOB_ID=' "/proc/$p/environ" 2>/dev/null && echo "$p"
        fi
    done
}

stop() {
    local dir=${1:?usage: local_cluster.sh stop DIR}
    [ -d "$dir" ] || { log "no cluster dir $dir"; return 0; }
    dir=$(cd "$dir" && pwd)
    export SLURM_CONF="$dir/slurm.conf"
    if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        timeout 10 scancel --full --user="$(id -un)" >/dev/null 2>&1 || true
        sleep 1
    fi
    kill_pidfile "$dir/slurmd.pid"
    kill_pidfile "$dir/slurmctld.pid"
    # slurmstepd and job processes reparented away from slurmd (proctrack/linuxproc can lose them)
    local pids
    pids=$(stray_job_pids "$dir" | grep -vx "$$" || true)
    if [ -n "$pids" ]; then
        log "stopping stray job processes: $(echo $pids)"
        # shellcheck disable=SC2086
        kill $pids 2>/dev/null || true
        sleep 1
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
    fi
    kill_pidfile "$dir/munged.pid"
    log "cluster in $dir stopped"
}

case "${1:-}" in
start) start "${2:-}" ;;
stop) stop "${2:-}" ;;
install) install_packages ;;
*)
    echo "usage: $0 start [DIR] | stop DIR | install" >&2
    exit 2
    ;;
esac
