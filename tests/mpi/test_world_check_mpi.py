"""A set-up failure under mpiexec prints one traceback, from the rank that failed (the launcher-versus-MPI world
checks are in tests/unit/test_world_check.py)."""
import pytest

from tests.helpers.mpi import run_engine

# --------------------------------------------------------------------------- one traceback per failure


@pytest.mark.timeout(300)
def test_a_setup_bug_prints_one_traceback(tmp_path, tiny_config):
    res = run_engine(3, tiny_config, tmp_path, "data.dataset=tests.helpers.user_fns:bug_in_setup_on_rank_0",
                     "data.partition=iid", check=False, timeout=120)
    assert res.returncode != 0
    assert "injected set-up bug on rank 0" in res.stderr and "rank 0 failed; aborting all 3 ranks" in res.stderr
    assert res.stderr.count("Traceback") == 1, res.stderr
    for rank in (1, 2):  # the others stop with one line, no traceback of their own
        assert f"rank {rank} stopping: rank 0 failed during set-up: ZeroDivisionError" in res.stderr \
            or f"rank {rank}" not in res.stderr  # killed by rank 0's abort before it got to say so
