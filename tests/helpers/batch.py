"""Several ``communities run`` jobs in one MPI job, one after another: the test runs share one start-up.

On this 2-core machine, starting 4 or 8 ranks (each imports torch, scipy and
scikit-learn) costs more than most test runs themselves. Each job here goes
through ``communities.cli.main``, the command line's own entry, in processes
that stay up between jobs: the code path of ``communities run``, minus the
process start-up. A job that fails on some rank aborts the whole batch, as it
would abort its own job.

    mpiexec -n N python tests/helpers/batch.py JOBS.json OUT_DIR

``JOBS.json`` is a list of ``{"name": ..., "argv": ["run", CONFIG, ...]}``. Each
job's output goes to ``OUT_DIR/<name>.<rank>.out`` and ``.err`` (read back by
``tests.helpers.mpi.run_batch``), and rank 0 records each job's exit code in
``OUT_DIR/<name>.code`` once every rank has finished it.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np


def main() -> int:
    from mpi4py import MPI

    from communities.cli import main as cli_main

    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = MPI.COMM_WORLD.Get_rank()
    for job in jobs:
        name = job["name"]
        with open(out / f"{name}.{rank}.out", "w") as fo, open(out / f"{name}.{rank}.err", "w") as fe, \
                contextlib.redirect_stdout(fo), contextlib.redirect_stderr(fe):
            code = cli_main(list(job["argv"]))
        codes = np.zeros(MPI.COMM_WORLD.Get_size(), dtype=np.int64)
        MPI.COMM_WORLD.Gather(np.array([int(code or 0)], dtype=np.int64), codes, root=0)
        if rank == 0:
            (out / f"{name}.code").write_text(json.dumps(codes.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
