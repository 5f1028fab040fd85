#!/usr/bin/env bash
# Start a throwaway single-node SLURM on this machine, for tests, CI and for
# trying slurm/train.sbatch without a cluster. Debian/Ubuntu, as root.
#
#   eval "$(bash slurm/local/start.sh)"     # or: source /tmp/hpctrain-slurm/env
#   sinfo; srun --mpi=pmix -n 4 hpctrain-train trainer.steps=5
#   bash slurm/local/stop.sh
#
# On success the only output is one line, `export SLURM_CONF=<dir>/slurm.conf`,
# which is also written to <dir>/env. Calling it again while the cluster is up
# does nothing and prints the same line. Everything (config, munge key and
# socket, state, logs) lives in one directory, never in /etc, so it cannot
# clash with a system munge or slurm.
#
# Settings (environment):
#   HPCTRAIN_SLURM_DIR       state directory        (default /tmp/hpctrain-slurm)
#   HPCTRAIN_SLURM_CPUS      CPUs the node claims   (default 8; more than the real
#                            cores is fine: config_overrides, for oversubscribed tests)
#   HPCTRAIN_SLURMCTLD_PORT  controller port        (default 6817)
#   HPCTRAIN_SLURMD_PORT     node daemon port       (default 6818; with several
#                            nodes, node i listens on this + i)
#   HPCTRAIN_SLURM_NODES     nodes                  (default 1). More than one
#                            emulates a multi-node cluster on this machine: one
#                            slurmd per node (<host>-1, <host>-2, ...), each with
#                            HPCTRAIN_SLURM_CPUS CPUs, so srun --nodes, --exclude
#                            and a node that fails behave as on a real cluster
#                            (restart inside an allocation is tested this way)
set -euo pipefail

STATE=${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}
CPUS=${HPCTRAIN_SLURM_CPUS:-8}
CTLD_PORT=${HPCTRAIN_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${HPCTRAIN_SLURMD_PORT:-6818}
NODES=${HPCTRAIN_SLURM_NODES:-1}
PARTITION=local
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() {
    echo "slurm/local/start.sh: error: $*" >&2
    exit 1
}

# The last lines of a daemon log, to say why it did not come up.
show_log() {
    [[ -s $1 ]] && { echo "--- last lines of $1:" >&2; tail -n 15 "$1" >&2; }
    return 0
}

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and runs the daemons as root); try: sudo bash $0"
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "HPCTRAIN_SLURM_NODES must be a positive integer, got '$NODES'"
[[ $STATE = /* ]] || die "HPCTRAIN_SLURM_DIR must be an absolute path, got '$STATE'"
# 0755: munged refuses a socket or key below a directory others may write.
# An existing directory is used as it is (never chmod a directory we did not make).
[[ -d $STATE ]] || mkdir -p -m 0755 "$STATE"

# Two callers at once (CI steps, two shells) must not start two clusters.
# Daemons are started with 9>&- so they do not inherit, and hold, the lock.
exec 9>"$STATE/.lock"
flock -w 180 9 || die "another slurm/local/start.sh or stop.sh holds $STATE/.lock for over 180 s"

# ---------------------------------------------------------------- packages
need_install() {
    local c
    for c in munged munge unmunge slurmctld slurmd srun sbatch sinfo squeue scontrol scancel; do
        command -v "$c" >/dev/null 2>&1 || return 0
    done
    id munge >/dev/null 2>&1 || return 0
    return 1
}

if need_install; then
    command -v apt-get >/dev/null || die "slurm/munge are missing and there is no apt-get; install slurmd slurmctld slurm-client munge with your package manager"
    export DEBIAN_FRONTEND=noninteractive
    apt_log=$STATE/apt.log
    pkgs=(slurmd slurmctld slurm-client munge)
    # Refresh the package lists only when they do not know the packages yet
    # (a fresh image has empty lists).
    if ! apt-cache show slurmctld >/dev/null 2>&1 || ! apt-cache show munge >/dev/null 2>&1; then
        apt-get -o DPkg::Lock::Timeout=120 update >"$apt_log" 2>&1 ||
            { show_log "$apt_log"; die "apt-get update failed (network? see $apt_log)"; }
    fi
    if ! apt-get -o DPkg::Lock::Timeout=120 install -y --no-install-recommends "${pkgs[@]}" >>"$apt_log" 2>&1; then
        # Stale lists point at versions the mirror no longer has: refresh once.
        apt-get -o DPkg::Lock::Timeout=120 update >>"$apt_log" 2>&1 || true
        apt-get -o DPkg::Lock::Timeout=120 install -y --no-install-recommends "${pkgs[@]}" >>"$apt_log" 2>&1 ||
            { show_log "$apt_log"; die "apt-get install ${pkgs[*]} failed (see $apt_log)"; }
    fi
    need_install && die "installed ${pkgs[*]} but a command or the munge user is still missing (see $apt_log)"
fi

# ---------------------------------------------------------------- names and paths
HOST=$(hostname -s)
# The nodes' names. Emulated nodes (HPCTRAIN_SLURM_NODES > 1) each have their
# own slurmd pid file, log, spool and a copy of slurm.conf beside an mpi.conf
# of their own: PMIx puts its per-step directory under /tmp otherwise, where
# two slurmds of one host collide.
NODE_NAMES=()
if ((NODES == 1)); then
    NODE_NAMES=("$HOST")
else
    for i in $(seq "$NODES"); do NODE_NAMES+=("$HOST-$i"); done
fi
NODE=${NODE_NAMES[0]}
slurmd_pidfile() { if ((NODES == 1)); then echo "$STATE/slurmd.pid"; else echo "$STATE/slurmd-$1.pid"; fi; }
CONF=$STATE/slurm.conf
MUNGE_DIR=$STATE/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
export SLURM_CONF=$CONF

pid_alive() { # pidfile name: the pid in pidfile is a live process called name
    local pid
    [[ -s $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$2" ]]
}

node_state() { # [node] idle, mix, alloc, comp, down, drain, ... (flag characters like * ~ stripped)
    local out
    out=$(timeout 10 sinfo -h -N -n "${1:-$NODE}" -o %t 2>/dev/null || true)
    echo "${out%%$'\n'*}" | tr -cd 'a-z'
}

healthy() {
    local n
    pid_alive "$MUNGE_DIR/munged.pid" munged &&
        pid_alive "$STATE/slurmctld.pid" slurmctld &&
        [[ $(timeout 10 scontrol ping 2>/dev/null || true) == *UP* ]] || return 1
    # the cluster running is the one asked for: as many nodes, each up
    [[ $(timeout 10 sinfo -h -N -o %N 2>/dev/null | sort -u | wc -l) -eq $NODES ]] || return 1
    for n in "${NODE_NAMES[@]}"; do
        pid_alive "$(slurmd_pidfile "$n")" slurmd && [[ $(node_state "$n") =~ ^(idle|mix|alloc|comp)$ ]] || return 1
    done
}

print_env() {
    echo "export SLURM_CONF=$CONF" >"$STATE/env"
    cat "$STATE/env"
}

if [[ -f $CONF ]] && healthy; then
    print_env
    exit 0
fi

# Something of ours is half up (a crash, a killed CI job): start from scratch.
HPCTRAIN_SLURM_LOCKED=1 bash "$HERE/stop.sh" >/dev/null 2>&1 || true

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
port_busy "$CTLD_PORT" && die "port $CTLD_PORT is in use (a system slurmctld, or a cluster started with another HPCTRAIN_SLURM_DIR?); stop it or set HPCTRAIN_SLURMCTLD_PORT"
for n in $(seq 0 "$NODES"); do
    if ((NODES == 1 && n > 0 || NODES > 1 && n == 0)); then continue; fi
    port_busy $((SLURMD_PORT + n)) && die "port $((SLURMD_PORT + n)) is in use (a system slurmd?); stop it or set HPCTRAIN_SLURMD_PORT"
done

# ---------------------------------------------------------------- munge
mkdir -p "$MUNGE_DIR"
chown munge:munge "$MUNGE_DIR"
chmod 0755 "$MUNGE_DIR" # 0755: clients of any user reach the socket
if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key"
fi
chown munge:munge "$MUNGE_DIR/munge.key"
chmod 0400 "$MUNGE_DIR/munge.key"
rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
runuser -u munge -- munged \
    --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" >/dev/null 2>"$MUNGE_DIR/munged.err" 9>&- ||
    { show_log "$MUNGE_DIR/munged.err"; show_log "$MUNGE_DIR/munged.log"; die "munged did not start"; }
for _ in $(seq 50); do
    munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && break
    sleep 0.1
done
munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 ||
    { show_log "$MUNGE_DIR/munged.log"; die "munged runs but a credential round trip through $MUNGE_SOCKET fails"; }

# ---------------------------------------------------------------- slurm.conf
mem_mb=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
mkdir -p "$STATE/ctld" "$STATE/spool"
if ((NODES == 1)); then
    spool=$STATE/spool slurmd_pid=$STATE/slurmd.pid slurmd_log=$STATE/slurmd.log
else # %n: the node's name
    spool=$STATE/spool/%n slurmd_pid=$STATE/slurmd-%n.pid slurmd_log=$STATE/slurmd-%n.log
fi
cat >"$CONF" <<EOF
# Written by slurm/local/start.sh; rewritten on every start. $NODES node(s), no
# systemd, no cgroups, no accounting database: a test cluster, not a template
# for a real one.
ClusterName=hpctrain-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
# Root runs everything, so no slurm user is needed.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$slurmd_log
# No cgroups: containers and CI runners often lack a writable cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Finished jobs go to a text file (no sacct without slurmdbd) and stay in
# scontrol for 10 minutes, so tests can read their final state.
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
MinJobAge=600
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Trust the CPUs= below even beyond the real cores (oversubscribed MPI tests).
SlurmdParameters=config_overrides
# Like many real sites: no default, so scripts must say --mpi=pmix.
MpiDefault=none
ReturnToService=2
KillWait=5
InactiveLimit=0
EOF
if ((NODES == 1)); then
    echo "NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN" >>"$CONF"
else
    # Emulated nodes share this machine's /dev/shm, where Open MPI names its
    # shared-memory files by job and node-local rank: ranks of two "nodes" would
    # open each other's. A directory per node and job keeps them apart (the
    # task prolog's "export" lines enter every task's environment).
    mkdir -p "$STATE/nodes"
    cat >"$STATE/nodes/task_prolog.sh" <<'PROLOG'
#!/bin/sh
d=/dev/shm/hpctrain-slurm-$SLURM_JOB_ID-$SLURMD_NODENAME
mkdir -p "$d" && echo "export OMPI_MCA_btl_vader_backing_directory=$d"
PROLOG
    chmod 0755 "$STATE/nodes/task_prolog.sh"
    echo "TaskProlog=$STATE/nodes/task_prolog.sh" >>"$CONF"
    for i in $(seq "$NODES"); do
        echo "NodeName=$HOST-$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i)) CPUs=$CPUS RealMemory=$((mem_mb / NODES)) State=UNKNOWN" >>"$CONF"
    done
fi
echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODE_NAMES[*]}") Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF"

# ---------------------------------------------------------------- daemons
# -c: start with no saved jobs; this cluster is throwaway.
slurmctld -c >"$STATE/slurmctld.err" 2>&1 9>&- ||
    { show_log "$STATE/slurmctld.err"; show_log "$STATE/slurmctld.log"; die "slurmctld did not start"; }
if ((NODES == 1)); then
    slurmd >"$STATE/slurmd.err" 2>&1 9>&- ||
        { show_log "$STATE/slurmd.err"; show_log "$STATE/slurmd.log"; die "slurmd did not start"; }
else
    for n in "${NODE_NAMES[@]}"; do
        mkdir -p "$STATE/spool/$n" "$STATE/nodes/$n/pmix"
        cp "$CONF" "$STATE/nodes/$n/slurm.conf"
        echo "PMIxCliTmpDirBase=$STATE/nodes/$n/pmix" >"$STATE/nodes/$n/mpi.conf"
        slurmd -N "$n" -f "$STATE/nodes/$n/slurm.conf" >"$STATE/slurmd-$n.err" 2>&1 9>&- ||
            { show_log "$STATE/slurmd-$n.err"; show_log "$STATE/slurmd-$n.log"; die "slurmd for node $n did not start"; }
    done
fi

for n in "${NODE_NAMES[@]}"; do
    state=""
    for _ in $(seq 120); do
        state=$(node_state "$n" || true)
        [[ $state == idle ]] && break
        # A node remembered as down from an earlier run: bring it back.
        if [[ $state =~ ^(down|drain|drng|fail)$ ]]; then
            scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
        fi
        sleep 0.25
    done
    if [[ $state != idle ]]; then
        show_log "$STATE/slurmctld.log"
        show_log "$STATE/slurmd.log"
        [[ $NODES -gt 1 ]] && show_log "$STATE/slurmd-$n.log"
        die "node $n is '${state:-unreachable}' after 30 s, not idle (logs above; stop with: bash $HERE/stop.sh)"
    fi
done

# srun --mpi=pmix is the point of this cluster; say so now rather than in a test.
srun --mpi=list 2>&1 | grep -qw pmix ||
    die "Slurm has no mpi/pmix plugin here (srun --mpi=list); on Debian it comes with slurm-wlm-basic-plugins"

print_env
