#!/usr/bin/env bash
# Bring up a real single-machine SLURM cluster for the tests: munged, slurmctld and two
# virtual compute nodes (slurmd -N n1, slurmd -N n2) on this host. Needs root (Debian).
#
# Everything the cluster writes (config, munge key and socket, state, spool, PID files,
# logs) lives under $NBDDP_SLURM_DIR (default /tmp/nbddp-slurm). Clients find the
# cluster through SLURM_CONF:   source "$NBDDP_SLURM_DIR/env"
# Idempotent: daemons that are already running are left alone. Waits (bounded by
# $NBDDP_SLURM_TIMEOUT seconds, default 60) until both nodes are idle; on failure prints
# the daemons' logs and exits non-zero. Stop it all with scripts/slurm-down.sh.
#
# Ports: slurmctld $NBDDP_SLURMCTLD_PORT (default 6817), slurmd n1/n2 on
# $NBDDP_SLURMD_PORT and the port after it (default 6818, 6819).
set -euo pipefail

DIR=${NBDDP_SLURM_DIR:-/tmp/nbddp-slurm}
TIMEOUT=${NBDDP_SLURM_TIMEOUT:-60}
CTLD_PORT=${NBDDP_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${NBDDP_SLURMD_PORT:-6818}
NODES=(n1 n2)
CPUS_PER_NODE=2

die() { echo "slurm-up: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (starts munged and slurmd)"
case $DIR in /*) ;; *) die "NBDDP_SLURM_DIR must be an absolute path: $DIR" ;; esac
case $DIR in *[[:space:]]*) die "NBDDP_SLURM_DIR must not contain spaces: $DIR" ;; esac

# --- packages -----------------------------------------------------------------------------
need=()
for pkg in munge slurmctld slurmd slurm-client; do
    [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] \
        || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "slurm-up: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # Debian's policy-rc.d (no init system here) keeps the packages' own services stopped.
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- layout -------------------------------------------------------------------------------
CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
MUNGE_KEY=$MUNGE_DIR/munge.key
MUNGE_SOCKET=$MUNGE_DIR/munge.socket.2
PIDS=$DIR/pids   # the PIDs this script started, one file per daemon (slurm-down uses them)
LOGS=$DIR/log
[ ${#MUNGE_SOCKET} -lt 100 ] || die "NBDDP_SLURM_DIR too long for a unix socket path: $DIR"

mkdir -p "$DIR" "$PIDS" "$LOGS" "$DIR/state" "$DIR/run"
chmod 0755 "$DIR"
for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
# munged refuses a key, socket or log in a directory others can write to.
mkdir -p "$MUNGE_DIR"
chown munge:munge "$MUNGE_DIR"
chmod 0755 "$MUNGE_DIR"   # clients (any user) must reach the socket
# Debian's standard munge run dir, owned by munge as the package expects (no init system
# creates it here). This cluster's munged keeps its socket in $MUNGE_DIR instead, and
# Slurm finds it there through AuthInfo.
install -d -o munge -g munge -m 0755 /run/munge

# One slurm-up (or slurm-down) at a time on this directory. Daemons get fd 9 closed.
exec 9>"$DIR/lock"
flock -w 120 9 || die "another slurm-up/slurm-down holds $DIR/lock"

# Node names must resolve (clients and slurmd look them up).
grep -qE '^127\.0\.0\.1[[:space:]]+n1[[:space:]]+n2([[:space:]]|$)' /etc/hosts \
    || echo "127.0.0.1 n1 n2" >>/etc/hosts

# --- daemons' identities ------------------------------------------------------------------
# running NAME EXE MARKER: true if $PIDS/NAME.pid names a live process running EXE with
# MARKER (our config or key path) in its command line, so a recycled PID is never ours.
running() {
    local pid
    pid=$(cat "$PIDS/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$2")" ] || return 1
    local cmd
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmd == *"$3"* ]]
}
# start NAME -- COMMAND...: start a daemon in the foreground of its own session, in $DIR
# (not the caller's directory, which its job steps would inherit), its output in
# $LOGS/NAME.out, and record its PID (the subshell execs setsid, which execs the daemon).
start() {
    local name=$1; shift 2
    (cd "$DIR" && exec setsid "$@" </dev/null >>"$LOGS/$name.out" 2>&1 9>&-) &
    echo $! >"$PIDS/$name.pid"
    echo "slurm-up: started $name (pid $!)"
}

# --- config -------------------------------------------------------------------------------
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
new_conf=$(cat <<EOF
# Written by nbddp scripts/slurm-up.sh: a single-machine test cluster, two virtual nodes.
ClusterName=nbddp
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
# Schedule a submitted job at once (default: up to 3 s later).
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MinJobAge=300
KillWait=5
InactiveLimit=0
NodeName=n1 NodeAddr=127.0.0.1 Port=$SLURMD_PORT CPUs=$CPUS_PER_NODE RealMemory=$mem_mb State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + 1)) CPUs=$CPUS_PER_NODE RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
)
any_slurm=false
running slurmctld /usr/sbin/slurmctld "$CONF" && any_slurm=true
for node in "${NODES[@]}"; do
    running "slurmd-$node" /usr/sbin/slurmd "$CONF" && any_slurm=true
done
if [ "$(cat "$CONF" 2>/dev/null)" != "$new_conf" ]; then
    $any_slurm && die "cluster in $DIR runs with another config; run scripts/slurm-down.sh first"
    printf '%s\n' "$new_conf" >"$CONF"
fi
echo "export SLURM_CONF=$CONF" >"$DIR/env"
export SLURM_CONF=$CONF

show_logs() {
    local f
    for f in "$LOGS"/*; do
        [ -s "$f" ] || continue
        echo "===== $f (last 40 lines) =====" >&2
        tail -n 40 "$f" >&2
    done
}
fail() {
    echo "slurm-up: $*" >&2
    show_logs
    echo "slurm-up: the cluster is left as it is; stop it with scripts/slurm-down.sh" >&2
    exit 1
}
# The daemons started (or found running) so far. Just started, one may not have exec'd
# its binary yet, so this checks only that its process lives (and is no zombie).
daemons=()
check_daemons() {
    local name pid stat
    for name in "${daemons[@]}"; do
        pid=$(cat "$PIDS/$name.pid")
        stat=$(cat "/proc/$pid/stat" 2>/dev/null) || fail "$name (pid $pid) died"
        stat=${stat##*) }
        case ${stat%% *} in Z|X) fail "$name (pid $pid) died" ;; esac
    done
}
deadline=$((SECONDS + TIMEOUT))
wait_for() {  # wait_for WHAT COMMAND...: poll COMMAND; fail at once if a daemon died
    local what=$1; shift
    until "$@" >/dev/null 2>&1; do
        check_daemons
        [ $SECONDS -lt $deadline ] || fail "timed out after ${TIMEOUT}s waiting for $what"
        sleep 0.2
    done
    check_daemons
}

# --- munged -------------------------------------------------------------------------------
if ! running munged /usr/sbin/munged "$MUNGE_KEY"; then
    if [ ! -s "$MUNGE_KEY" ]; then
        (umask 077; head -c 1024 /dev/urandom >"$MUNGE_KEY")
    fi
    chown munge:munge "$MUNGE_KEY"
    chmod 0400 "$MUNGE_KEY"
    start munged -- setpriv --reuid=munge --regid=munge --init-groups \
        /usr/sbin/munged --foreground --key-file="$MUNGE_KEY" --socket="$MUNGE_SOCKET" \
        --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed" \
        --log-file="$MUNGE_DIR/munged.log"  # unused: in the foreground it logs to stderr
fi
munge_ok() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }
daemons+=(munged)
wait_for munged munge_ok

# --- slurmctld ----------------------------------------------------------------------------
if ! running slurmctld /usr/sbin/slurmctld "$CONF"; then
    # -i: start even if state saved by an earlier (killed) slurmctld is unreadable.
    start slurmctld -- /usr/sbin/slurmctld -D -i -f "$CONF"
fi
ctld_ok() { [[ $(scontrol ping) == *"is UP"* ]]; }
daemons+=(slurmctld)
wait_for slurmctld ctld_ok

# --- slurmd x2 ----------------------------------------------------------------------------
for node in "${NODES[@]}"; do
    if ! running "slurmd-$node" /usr/sbin/slurmd "$CONF"; then
        start "slurmd-$node" -- /usr/sbin/slurmd -D -N "$node" -f "$CONF"
    fi
    daemons+=("slurmd-$node")
done
nodes_idle() {
    local states
    states=$(sinfo -h -N -o '%N %t' | sort -u | tr '\n' ' ')
    [ "$states" = "n1 idle n2 idle " ]
}
wait_for "nodes n1 and n2 to be idle" nodes_idle
echo "slurm-up: cluster up in ${SECONDS}s; source $DIR/env (SLURM_CONF=$CONF)"
sinfo -N
