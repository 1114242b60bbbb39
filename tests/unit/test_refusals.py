"""The cross-section refusals as one table, and the placement check that run, validate and slurm share."""
from __future__ import annotations

import re
import types

import pytest

from communities import cli, config, refusals
from communities.config import ConfigError
from communities.refusals import REFUSALS, check_placement
from tests.helpers.mpi import ROOT

QUICK = ROOT / "configs" / "quickstart.yaml"
KEY = re.compile(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)\b")


def _texts(row: refusals.Refusal, cfg) -> str:
    """The row's subject and key as its message would say them (a text computed from the config: its name)."""
    layout = refusals.Layout(8, 2)
    return " ".join(t.__name__ if callable(t) else refusals._text(t, cfg, layout) for t in (row.subject, row.key))


def test_every_row_names_keys_that_exist():
    """A message names the keys a user can change: every dotted name in a row's subject and key is a config key
    (or an entry of pbt.params)."""
    keys = set(config._all_keys(config.Config)) | {"pbt.params." + k for k in config.PBT_PARAMS}
    cfg = config.load(QUICK)
    named = set()
    for row in REFUSALS:
        text = _texts(row, cfg)
        for name in KEY.findall(text):
            named.add(name)
            assert name in keys or name.rsplit(".", 1)[0] in keys, (name, text)
    assert len(named) > 30 and len(REFUSALS) > 50


@pytest.mark.parametrize("overrides, subject, key", [
    (["protocol=async", "strategy=diloco"], "protocol='async'", "strategy='diloco'"),
    (["protocol=async", "comm.exchange=posted", "merge.outer.enabled=true"], "comm.exchange='posted'",
     "merge.outer.enabled=true"),
    (["comm.exchange=posted"], "comm.exchange='posted'", "protocol='virtual_clock'"),
    (["privacy.enabled=true", "privacy.epsilon=3", "model.dropout=0.1"], "privacy.enabled=true", "model.dropout=0.1"),
    (["partners.schedule=hypercube", "strategy=ring"], "partners.schedule='hypercube'", "strategy='ring'"),
    (["merge.average_every=4", "strategy=diloco"], "merge.average_every=4", "strategy='diloco'"),
    (["pbt.enabled=true", "pbt.params={train.lr: {low: 0.01, high: 0.1}}"], "pbt.enabled=true",
     "data.local_test_fraction=0"),
    (["data.dataset=pystdlib", "data.partition=iid"], "data.dataset='pystdlib' (a language model's corpus)",
     "model.name='mlp'"),
    (["comm.fault_tolerance=shrink", "signature.overlap=true"], "comm.fault_tolerance='shrink'",
     "signature.overlap=true"),
    (["strategy=oracle", "data.partition=iid"], "strategy='oracle'", "data.partition='iid' and data.shift='none'"),
    (["consensus.mode=communities", "strategy=gossip"], "consensus.mode='communities'", "strategy='gossip'"),
])
def test_a_refusal_names_both_keys_and_why(overrides, subject, key):
    with pytest.raises(ConfigError) as err:
        config.load(QUICK, overrides)
    assert f"{subject} is refused with {key} (" in str(err.value), str(err.value)


def test_the_first_row_that_holds_is_the_message_and_placement_rows_wait_for_a_placement():
    cfg = types.SimpleNamespace(protocol="async", device="cpu", faults=types.SimpleNamespace(speed={}, kill={},
                                                                                           stall_rank=None),
                                comm=types.SimpleNamespace(fault_tolerance="abort"),
                                merge=types.SimpleNamespace(optimizer_state="average", partner_policy="law",
                                                            outer=types.SimpleNamespace(enabled=False)),
                                examples=types.SimpleNamespace(pass_hard=False))
    rows = [row for row in REFUSALS if row.placement]
    assert refusals.first_refusal(cfg, rows) is None  # without a placement, no placement row applies
    message = refusals.first_refusal(cfg, rows, p=refusals.Layout(8, 2))
    assert message == ("world_size=8 replicas on 2 MPI processes (4 per process) is refused with protocol='async' "
                       "and merge.optimizer_state='average' (a posted exchange carries the weights, a header and "
                       "signature rows only, not the optimizer moments)")


def test_placement_of_replicas_on_processes():
    cfg = config.load(QUICK)  # world_size: 8
    assert check_placement(cfg, 8) == 8 and check_placement(cfg, 2) == 8 and check_placement(cfg, 1) == 8
    for p in (3, 16, 64):
        with pytest.raises(ConfigError) as err:
            check_placement(cfg, p, source=f"{p} MPI processes (--processes {p})")
        text = str(err.value)
        assert f"world_size=8 replicas cannot be placed on {p} MPI processes (--processes {p})" in text
        assert "1, 2, 4 or 8" in text and f"world_size={p}" in text and "MPI started" not in text
    free = config.load(QUICK, ["world_size=null"])
    assert check_placement(free, 5) == 5  # one replica per process, any number
    with pytest.raises(ConfigError, match="data.groups=4 planted groups need at least as many ranks"):
        check_placement(free, 3)
    with pytest.raises(ConfigError, match="at least 1"):
        check_placement(cfg, 0)


def test_a_population_refuses_what_acts_on_a_process():
    with pytest.raises(ConfigError, match=r"world_size=8 replicas on 2 MPI processes \(4 per process\) is refused "
                                          r"with faults.kill without comm.fault_tolerance=shrink \(it kills a "
                                          r"process\): start 8 processes, one replica each"):
        check_placement(config.load(QUICK, ["faults.kill={3: 5}"]), 2)
    assert check_placement(config.load(QUICK, ["faults.kill={3: 5}"]), 8) == 8  # one replica each: fine
    # a lost process is the loss of its block of replicas (comm.fault_tolerance shrink; tests/mpi under ULFM)
    assert check_placement(config.load(QUICK, ["faults.kill={3: 5}", "comm.fault_tolerance=shrink"]), 2) == 8
    # a slow or stalled process is the emulation of a slow node: faults.speed acts on the whole process
    assert check_placement(config.load(QUICK, ["faults.speed={1: 2.0}"]), 4) == 8


def test_the_readme_slurm_example_passes_for_a_64_replica_config_and_a_population(tmp_path, monkeypatch, capsys):
    """``communities slurm CONFIG --nodes 2 --ntasks-per-node 32``: 64 tasks for 64 replicas, or 256 replicas as a
    population on them; 8 replicas on 64 tasks is refused, naming the job's tasks and not claiming MPI started."""
    from communities.tools import slurm

    monkeypatch.chdir(tmp_path)
    job = ["--nodes", "2", "--ntasks-per-node", "32", "--out", str(tmp_path / "job.sbatch")]
    assert slurm.main_slurm([str(QUICK), "world_size=64", *job]) == 0
    assert slurm.main_slurm([str(ROOT / "configs" / "population.yaml"), *job]) == 0
    capsys.readouterr()
    assert slurm.main_slurm([str(QUICK), *job]) == 2
    err = capsys.readouterr().err
    assert "world_size=8 replicas cannot be placed on 64 MPI processes (--nodes=2 x --ntasks-per-node=32)" in err
    assert "MPI started" not in err


def test_validate_checks_a_placement_on_processes(capsys):
    base = ["validate", str(QUICK), "--no-dry-run"]
    assert cli.main(base + ["--processes", "2"]) == 0
    assert "world_size=8 replicas on 2 MPI processes, 4 per process (a population)" in capsys.readouterr().err
    assert cli.main(base + ["--world-size", "2"]) == 0  # the option's old name
    capsys.readouterr()
    assert cli.main(base + ["--processes", "3"]) == 2
    err = capsys.readouterr().err
    assert "cannot be placed on 3 MPI processes (--processes 3)" in err and "MPI started" not in err
    assert cli.main(base + ["protocol=async", "--processes", "2"]) == 0  # an asynchronous population
    capsys.readouterr()
    assert cli.main(base + ["protocol=async", "merge.optimizer_state=average", "--processes", "2"]) == 2
    assert "is refused with protocol='async' and merge.optimizer_state='average'" in capsys.readouterr().err
