"""Diverged and hostile ranks, without MPI: the outlier mask of the robust option.

The runs with faulty ranks under a real mpiexec are in tests/mpi/test_faults_mpi.py.
"""
import numpy as np
import pytest

from communities.core import robust

pytestmark = pytest.mark.timeout(900)


def test_outlier_mask_flags_a_far_signature_but_not_a_diverged_one():
    rng = np.random.default_rng(0)
    S = rng.normal(size=(8, 32))
    S[6] *= 50.0  # a hostile rank: far from the coordinate-wise median
    S[2] = np.nan  # a diverged rank: handled by the reset path, not by exclusion
    mask = robust.outliers(S, factor=3.0)
    assert mask.tolist() == [i == 6 for i in range(8)]
    assert not robust.outliers(S[:3], factor=3.0).any()  # two finite rows: no median to trust
    assert (robust.sanitize(S)[2] == 0).all() and np.isfinite(robust.sanitize(S)).all()
