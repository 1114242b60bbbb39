"""Your own data and model under a real mpiexec (docs/guides/own-model-and-data.md): the documented example run as
the docs say, from another directory with the installed command; a sharded reader; and the refusals before any rank
trains (data that differ between ranks, a model function with the wrong signature)."""
import json
import sys
from pathlib import Path

import pytest

from tests.helpers.mpi import ROOT, run_mpi, tiny_batch
from tests.helpers.plugin_docs import doc_commands

EXAMPLE_CONFIG = ROOT / "examples" / "plugins" / "config.yaml"  # the docs' file (tests/unit/test_plugins.py)


def run_documented(tmp_path: Path, *overrides: str):
    """The docs' ``mpiexec -n 4 communities run examples/plugins/config.yaml``, from a directory of its own."""
    command = doc_commands()[1].split()
    assert command[:4] == ["mpiexec", "-n", "4", "communities"] and command[5] == "examples/plugins/config.yaml"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    communities = Path(sys.executable).parent / "communities"  # the installed command, not python -m
    return run_mpi(int(command[2]), [command[4], EXAMPLE_CONFIG, *command[6:], f"output.root={tmp_path}",
                                     "--no-progress", *overrides], program=communities, cwd=elsewhere, timeout=300)


@pytest.mark.timeout(360)
def test_the_documented_example_runs_from_another_directory(tmp_path):
    res = run_documented(tmp_path)
    s = json.loads((tmp_path / "plugins_example" / "summary.json").read_text())
    assert s["world_size"] == 4 and s["consensus_test_split"] == "shared"
    assert s["consensus_test_acc"] >= 0.9, res.stdout  # three well-separated blobs
    assert "== plugins_example: community on 4 ranks" in res.stdout
    partition = json.loads((tmp_path / "plugins_example" / "partition.json").read_text())
    assert partition["partition"] == "dirichlet" and partition["n_train"] == 900 and partition["n_classes"] == 3


@pytest.mark.timeout(360)
def test_a_sharded_reader_trains_each_rank_on_its_own_shard(tmp_path):
    run_documented(tmp_path, "data.dataset=my_data:blobs_sharded", "train.budget=15")
    run = tmp_path / "plugins_example-my_data.blobs_sharded"  # another dataset, so another run name
    partition = json.loads((run / "partition.json").read_text())
    assert partition["partition"] == "sharded" and partition["shard_sizes"] == [225] * 4
    assert partition["n_train"] == 900 and partition["n_test"] == 300
    assert [sum(c) for c in partition["label_counts"]] == [225] * 4
    s = json.loads((run / "summary.json").read_text())
    assert s["consensus_test_split"] == "shared" and s["consensus_test_acc"] >= 0.9


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The two refused runs of the tiny config, in one batch on 3 ranks (one process per rank: not_deterministic
    draws its data per process): name -> (result, run directory)."""
    user = "tests.helpers.user_fns"
    jobs = {"not_deterministic": [f"data.dataset={user}:not_deterministic", "data.partition=iid", "name=tiny"],
            "wrong_signature": [f"model.name={user}:wrong_signature", "name=tiny"]}
    runs = tiny_batch(tmp_path_factory, "plugins", 3, jobs, timeout=280, check=False)
    return {name: (runs.result[name], runs[name]) for name in jobs}


@pytest.mark.timeout(300)
def test_data_that_differ_between_ranks_are_refused_naming_the_ranks(refused):
    res, run = refused["not_deterministic"]
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    assert "the ranks' data differ: ranks [1, 2] hold another training set and test split than rank 0" in res.stderr
    assert "Is not_deterministic() deterministic? It is called with seed=" in res.stderr
    assert not run.exists()  # refused before the run directory was made


@pytest.mark.timeout(300)
def test_a_model_function_with_the_wrong_signature_is_exit_2_naming_it(refused):
    res, _ = refused["wrong_signature"]
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    assert "aborting" not in res.stderr and "MPI_Abort" not in res.stderr
    assert ("model.name='tests.helpers.user_fns:wrong_signature': wrong_signature(width, depth) cannot be called as "
            "def fn(input_shape, n_classes) -> torch.nn.Module") in res.stderr
