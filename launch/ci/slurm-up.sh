#!/usr/bin/env bash
# A throwaway one-node SLURM cluster for the tests (tests/slurm/test_slurm.py) and for trying
# the launch/ scripts on a workstation: Debian's slurm-wlm + munge, no systemd, everything
# (config, state, spool, logs, munge key and socket, PID files) under one directory.
#
#   launch/ci/slurm-up.sh [DIR]      start it; prints "export SLURM_CONF=DIR/slurm.conf"
#   eval "$(launch/ci/slurm-up.sh /tmp/slurm)" && sbatch --wrap hostname && squeue
#   launch/ci/slurm-down.sh DIR      cancel its jobs and stop the daemons it started, by PID
#
# Needs root (slurmd launches jobs; munged and slurmctld run as root here). When slurm-wlm
# or munge is missing it installs them with apt-get (root only). The node is the real short
# host name at 127.0.0.1 with CPUs=8 whatever the core count (SlurmdParameters=config_overrides),
# so a 4-rank job fits on a 2-core machine. Ports are the first free ones from 16817 up
# (SLURM_CI_PORT to pick another base), so a system SLURM on the same host is left alone.
#
# Exit status: 0 up; 3 cannot run here (not root, no apt-get, install failed), with the
# reason on stderr (the tests skip on it, or fail when CI=true); 1 a daemon did not come up
# (its log is printed).
set -euo pipefail

DIR=${1:-$(mktemp -d /tmp/slurm-ci.XXXXXX)}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
CANNOT=3
say() { echo "slurm-up: $*" >&2; }

need=()
for b in munged mungekey slurmctld slurmd sbatch sinfo; do
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b ]] || need+=("$b")
done
if ((${#need[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        say "not root: cannot install slurm-wlm and munge (missing: ${need[*]})"; exit $CANNOT
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        say "no apt-get: install slurm-wlm (slurmctld, slurmd, client) and munge by hand (missing: ${need[*]})"; exit $CANNOT
    fi
    say "installing slurm-wlm and munge with apt-get (missing: ${need[*]})"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d keeps the packages' init scripts from starting system daemons on install
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [[ ! -e $policy ]]; then printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; made_policy=1; fi
    ok=1
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$DIR/apt.log" 2>&1 || ok=0
    ((made_policy)) && rm -f "$policy"
    if ((!ok)); then tail -20 "$DIR/apt.log" >&2; say "apt-get install slurm-wlm munge failed"; exit $CANNOT; fi
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: slurmd must run as root to launch jobs"; exit $CANNOT
fi
export PATH=$PATH:/usr/sbin:/sbin

NODE=$(hostname -s)
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
base=${SLURM_CI_PORT:-16817}
while ! { port_free "$base" && port_free $((base + 1)); }; do base=$((base + 2)); done
CTLD_PORT=$base SLURMD_PORT=$((base + 1))

# Job ids start at a number of this start's own, not at 1: MPICH names a job's shared-memory segment
# (/dev/shm/mpich_shm_*) after its PMI name, which under srun --mpi=pmi2 is JOBID.STEPID. A killed job leaves its
# segment behind, and job 1.0 of the next throwaway cluster opened the same one and hung in MPI_Init.
FIRST_JOB=$(( ($(date +%s) % 600000) * 100 + $$ % 100 + 1000 ))

mkdir -p "$DIR"/{munge,state,spool,log,tmp}
chmod 700 "$DIR/munge"

# ---- munge: a private key and socket
KEY=$DIR/munge/munge.key
[[ -s $KEY ]] || dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
chmod 400 "$KEY"
SOCK=$DIR/munge/munge.socket.2

cat >"$DIR/slurm.conf" <<CONF
# one-node test cluster written by launch/ci/slurm-up.sh
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCK
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/plugstack.conf
TmpFS=$DIR/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
FirstJobId=$FIRST_JOB
KillWait=10
MinJobAge=900
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
: >"$DIR/plugstack.conf"
echo "export SLURM_CONF=$DIR/slurm.conf" >"$DIR/env.sh"
export SLURM_CONF=$DIR/slurm.conf

fail() {
    say "$1"
    for f in "$DIR"/munge/munged.log "$DIR"/log/slurmctld.log "$DIR"/log/slurmd.log; do
        [[ -f $f ]] && { echo "--- $f" >&2; tail -25 "$f" >&2; }
    done
    exit 1
}
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local t=$1 what=$2; shift 2
    for ((i = 0; i < t * 5; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    fail "timed out after ${t}s waiting for $what"
}

munged --force --socket="$SOCK" --key-file="$KEY" --pid-file="$DIR/munge/munged.pid" \
    --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" || fail "munged did not start"
wait_for 20 "munged" bash -c "munge -n --socket='$SOCK' | unmunge --socket='$SOCK'"

slurmctld -f "$SLURM_CONF" -i || fail "slurmctld did not start"
wait_for 60 "slurmctld" scontrol ping
slurmd -f "$SLURM_CONF" -N "$NODE" || fail "slurmd did not start"
node_idle() { [[ $(sinfo -h -n "$NODE" -o %t 2>/dev/null) == idle ]]; }
wait_for 90 "node $NODE to be idle" node_idle

say "up: node $NODE idle, ports $CTLD_PORT/$SLURMD_PORT, dir $DIR"
echo "export SLURM_CONF=$DIR/slurm.conf"
