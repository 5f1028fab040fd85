#!/usr/bin/env bash
# Stop the cluster slurm/local/start.sh started: cancel its jobs, then stop
# slurmd, slurmctld and munged by their pid files (never by name, so a system
# slurm or another user's daemons are left alone). Quiet on success; safe to
# call when nothing runs. Logs stay in the state directory for a post-mortem;
# `--purge` removes what start.sh wrote there (and the directory if empty).
#
#   bash slurm/local/stop.sh [--purge]
set -euo pipefail

STATE=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
purge=0
case "${1:-}" in
"") ;;
--purge) purge=1 ;;
*)
    echo "usage: bash slurm/local/stop.sh [--purge]" >&2
    exit 2
    ;;
esac

die() {
    echo "slurm/local/stop.sh: error: $*" >&2
    exit 1
}

[[ -d $STATE ]] || exit 0
[[ $(id -u) -eq 0 ]] || die "must run as root, like start.sh; try: sudo bash $0"

# start.sh calls us while it holds the lock.
if [[ -z ${HPCTRAIN_SLURM_LOCKED:-} ]]; then
    exec 9>"$STATE/.lock"
    flock -w 180 9 || die "start.sh or stop.sh holds $STATE/.lock for over 180 s"
fi

export SLURM_CONF=$STATE/slurm.conf

# The pid in $1 if it is a live process whose name is $2 (a stale pid file
# may name a recycled pid that belongs to someone else).
live_pid() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]] && echo "$pid"
}

stop_daemon() { # pidfile name
    local pid
    pid=$(live_pid "$1" "$2") || { rm -f "$1"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        [[ -d /proc/$pid ]] || break
        sleep 0.1
    done
    if [[ -d /proc/$pid ]]; then
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.2
    fi
    [[ -d /proc/$pid ]] && die "$2 (pid $pid) survived SIGKILL"
    rm -f "$1"
}

# Jobs first, while slurmd can still kill their steps; otherwise their
# processes would outlive the cluster.
if live_pid "$STATE/slurmctld.pid" slurmctld >/dev/null && command -v squeue >/dev/null; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        # shellcheck disable=SC2086  # one job id per word
        timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 100); do
            [[ -z $(timeout 10 squeue -h -o %A 2>/dev/null || true) ]] && break
            sleep 0.1
        done
    fi
fi

stop_daemon "$STATE/slurmd.pid" slurmd
for f in "$STATE"/slurmd-*.pid; do # the emulated nodes of HPCTRAIN_SLURM_NODES > 1
    if [[ -e $f ]]; then stop_daemon "$f" slurmd; fi
done
stop_daemon "$STATE/slurmctld.pid" slurmctld
stop_daemon "$STATE/munge/munged.pid" munged
rm -f "$STATE/env"

if ((purge)); then
    # Only what start.sh makes: HPCTRAIN_SLURM_DIR may point at a shared directory.
    rm -rf "${STATE:?}"/{munge,ctld,spool,nodes}
    rm -f "$STATE"/{slurm.conf,jobcomp.txt,apt.log,.lock} "$STATE"/slurm{ctld,d}.{log,err} "$STATE"/slurmd-*.{log,err}
    rmdir "$STATE" 2>/dev/null || true
fi
