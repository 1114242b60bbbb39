#!/usr/bin/env bash
# Stop a cluster started by launch/ci/slurm-up.sh DIR: cancel its jobs, then stop the
# daemons it started (slurmd, slurmctld, munged) by the PIDs in DIR, SIGKILL after 15 s.
set -uo pipefail
DIR=${1:?usage: slurm-down.sh DIR}
export SLURM_CONF=$DIR/slurm.conf PATH=$PATH:/usr/sbin:/sbin
if [[ -f $SLURM_CONF ]] && scontrol ping >/dev/null 2>&1; then
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
    if [[ -n $jobs ]]; then
        scancel $jobs 2>/dev/null
        for ((i = 0; i < 75; i++)); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.2; done
    fi
fi
for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    [[ -s $f ]] || continue
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || continue
    kill -TERM "$pid"
    for ((i = 0; i < 75; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
done
exit 0
