#!/usr/bin/env bash
# Tear down the test cluster that scripts/slurm-up.sh started in $NBDDP_SLURM_DIR
# (default /tmp/nbddp-slurm): cancel every job still queued or running, stop exactly the
# daemons slurm-up recorded (by PID: SIGTERM, then SIGKILL after a few seconds; never by
# name), then remove the directory. Safe to run when nothing is up.
set -euo pipefail

DIR=${NBDDP_SLURM_DIR:-/tmp/nbddp-slurm}
PIDS=$DIR/pids
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

if [ ! -d "$DIR" ]; then
    echo "slurm-down: nothing to do ($DIR does not exist)"
    exit 0
fi
exec 9>"$DIR/lock"
flock -w 120 9 || { echo "slurm-down: $DIR/lock is held" >&2; exit 1; }

# pid_of NAME EXE MARKER: the PID recorded for NAME, if that process is still the daemon
# slurm-up started (runs EXE, MARKER in its command line), so a recycled PID is never hit.
pid_of() {
    local pid cmd
    pid=$(cat "$PIDS/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(readlink -f "$2")" ] || return 1
    cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
    [[ $cmd == *"$3"* ]] || return 1
    echo "$pid"
}
alive() {  # alive PID: exists and is not a zombie
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [ "${stat%% *}" != Z ] && [ "${stat%% *}" != X ]
}
# stop PID LABEL: SIGTERM, up to 5 s grace, then SIGKILL.
stop() {
    local pid=$1 sig _
    for sig in TERM KILL; do
        [ $sig = KILL ] && echo "slurm-down: $2 (pid $pid) ignored SIGTERM; sending SIGKILL"
        kill -$sig "$pid" 2>/dev/null || return 0
        for _ in $(seq 50); do
            alive "$pid" || { echo "slurm-down: stopped $2 (pid $pid)"; return 0; }
            sleep 0.1
        done
    done
    echo "slurm-down: $2 (pid $pid) survived SIGKILL" >&2
    return 1
}
# Job-step daemons (slurmstepd) of this cluster: they are re-parented away from slurmd,
# so they are found by what they hold open, the node log under $DIR/log (never by name).
stepds() {
    local fd pid exe stepd
    stepd=$(readlink -f /usr/sbin/slurmstepd 2>/dev/null) || return 0
    for fd in /proc/[0-9]*/fd/*; do
        case $(readlink "$fd" 2>/dev/null) in "$DIR"/log/*) ;; *) continue ;; esac
        pid=${fd#/proc/}; pid=${pid%%/*}
        exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || continue
        if [ "$exe" = "$stepd" ]; then echo "$pid"; fi
    done | sort -un
}

ctld=$(pid_of slurmctld /usr/sbin/slurmctld "$CONF") || ctld=
if [ -n "$ctld" ]; then
    mapfile -t jobs < <(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [ ${#jobs[@]} -gt 0 ]; then
        echo "slurm-down: cancelling jobs ${jobs[*]}"
        timeout 10 scancel "${jobs[@]}" || true
    fi
    # Wait (bounded) for the jobs to leave the queue and their step daemons to exit
    # (a job step that ignores SIGTERM gets SIGKILL after KillWait, 5 s).
    deadline=$((SECONDS + 30))
    while [ $SECONDS -lt $deadline ]; do
        [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null || echo busy)" ] \
            && [ -z "$(stepds)" ] && break
        sleep 0.2
    done
fi

status=0
for node in n1 n2; do
    pid=$(pid_of "slurmd-$node" /usr/sbin/slurmd "$CONF") \
        && { stop "$pid" "slurmd-$node" || status=1; }
done
[ -n "$ctld" ] && { stop "$ctld" slurmctld || status=1; }
for pid in $(stepds); do  # only if a job step outlived the cancel and its slurmd
    stop "$pid" "slurmstepd" || status=1
done
pid=$(pid_of munged /usr/sbin/munged "$DIR/munge/munge.key") && { stop "$pid" munged || status=1; }

if [ $status = 0 ]; then
    rm -rf "$DIR"
    echo "slurm-down: cluster stopped, $DIR removed"
else
    echo "slurm-down: some daemons could not be stopped; $DIR kept" >&2
fi
exit $status
