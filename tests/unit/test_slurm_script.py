"""SLURM without a cluster: the batch-script template and ``communities slurm``, which need nothing but bash.

The jobs on a real one-node SLURM are in tests/slurm/test_slurm.py.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from communities.tools import slurm
from tests.helpers.mpi import ROOT
from tests.helpers.slurm_cluster import PY, gen

pytestmark = pytest.mark.timeout(900)


def sbatch_lines(text: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))


# --------------------------------------------------------------------------- no SLURM needed


def test_template_is_the_packaged_one_and_renders_to_itself():
    """launch/slurm.sbatch is the one template: the package reads it, and rendering nothing changes nothing."""
    assert slurm.template_path().resolve() == (ROOT / "launch" / "slurm.sbatch").resolve()
    text = slurm.template_text()
    assert slurm.render(text, {k: None for k in slurm.SBATCH_OPTIONS}, {}) == text
    for script in ("slurm.sbatch", "sweep.sbatch", "mpirun.sh", "ci/slurm-up.sh", "ci/slurm-down.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)


def test_generated_script(tmp_path, tiny_config):
    res = gen(tiny_config, "output.root=res", "train.lr=0.1", "--nodes", 2, "--ntasks-per-node", 2,
              "--cpus-per-task", 3, "--time", "01:30:00", "--partition", "gpu", "--account", "proj",
              "--launcher", "srun", "--sbatch-option=--gpus-per-node=2", "--overwrite", cwd=tmp_path)
    path = Path(res.stdout.split()[0])
    assert path == tmp_path / "res" / "tiny" / "job.sbatch" and path.stat().st_mode & 0o111
    text = path.read_text()
    assert sbatch_lines(text) == {
        "job-name": "tiny", "nodes": "2", "ntasks-per-node": "2", "cpus-per-task": "3", "time": "01:30:00",
        "partition": "gpu", "account": "proj", "output": f"{tmp_path}/res/tiny/slurm-%j.out", "open-mode": "append",
        "signal": "B:USR1@120", "gpus-per-node": "2"}
    assert "\n#SBATCH --requeue\n" in text
    for line in (f"CONFIG={tiny_config}", "OVERRIDES=(output.root=res train.lr=0.1)", "LAUNCHER=srun",
                 f"PYTHON={PY}", f"WORKDIR={tmp_path}", f"RUN_DIR={tmp_path}/res/tiny", "FIRST_RUN_ARGS=(--overwrite)"):
        assert f"\n{line}\n" in text, line
    subprocess.run(["bash", "-n", str(path)], check=True)
    # the body is the template's, untouched
    body = slurm.template_text().split("no edits needed below")[1]
    assert text.endswith(body)
    # the run directory is announced, and holding only job.sbatch it is no "existing run"
    assert gen(tiny_config, "output.root=res", "--print-run-dir", cwd=tmp_path).stdout.strip() == str(path.parent)
    gen(tiny_config, "output.root=res", "--ntasks-per-node", 2, cwd=tmp_path)


def test_user_errors_exit_2(tmp_path, tiny_config, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def run(*args):
        code = slurm.main_slurm([str(tiny_config), *map(str, args)])
        return code, capsys.readouterr().err

    cases = [
        (["train.lr=oops"], "train.lr"),
        (["world_size=4", "--nodes", "3"], "world_size=4"),
        (["world_size=4", "--ntasks-per-node", "3"], "world_size=4"),
        (["--time", "ten minutes"], "--time"),
        (["--nodes", "0"], "--nodes=0"),
        (["--partition", "a b"], "--partition"),
        (["--python", "/no/such/python"], "--python"),
    ]
    for args, needle in cases:
        code, err = run(*args)
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)
    # a directory that holds a run needs --overwrite or --resume
    run_dir = tmp_path / "results" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "meta.json").write_text("{}")
    code, err = run("--ntasks-per-node", 2)
    assert code == 2 and "already holds a run" in err
    assert run("--ntasks-per-node", 2, "--resume")[0] == 0
    assert "\nFIRST_RUN_ARGS=(--resume)\n" in (run_dir / "job.sbatch").read_text()
    # --submit without SLURM's clients says so
    monkeypatch.setenv("PATH", "/nonexistent")
    code, err = run("--ntasks-per-node", 2, "--overwrite", "--submit")
    assert code == 2 and "sbatch not found" in err


def test_launcher_files_are_not_a_run(tmp_path):
    """job.sbatch and the SLURM log may wait in results/<name>/; --overwrite keeps them."""
    from communities.results import ResultsError, RunWriter

    run = tmp_path / "tiny"
    run.mkdir()
    (run / "job.sbatch").write_text("#!/bin/bash\n")
    (run / "slurm-12.out").write_text("log\n")
    RunWriter(run).close()
    (run / "meta.json").write_text("{}")
    with pytest.raises(ResultsError, match="already exists"):
        RunWriter(run)
    RunWriter(run, overwrite=True).close()
    assert sorted(p.name for p in run.iterdir()) == ["job.sbatch", "rounds", "slurm-12.out"]


def test_a_population_may_run_on_fewer_ranks_and_the_script_says_a_requeue_onto_fewer_nodes_works(
        tmp_path, tiny_config, monkeypatch, capsys):
    """world_size=8 replicas on 1 node x 2 ranks is a population: accepted, unless it asks what one refuses."""
    monkeypatch.chdir(tmp_path)
    assert slurm.main_slurm([str(tiny_config), "world_size=8", "--ntasks-per-node", "2"]) == 0
    text = (tmp_path / "results" / "tiny" / "job.sbatch").read_text()
    assert sbatch_lines(text)["ntasks-per-node"] == "2"
    header = text.split("#SBATCH", 1)[0]
    assert "# A requeue onto fewer nodes just works for a population" in header
    assert "resumes bitwise from the\n# per-replica checkpoints" in header
    capsys.readouterr()
    code = slurm.main_slurm([str(tiny_config), "world_size=8", "protocol=async", "--ntasks-per-node", "2",
                             "--overwrite"])
    assert code == 2 and "is refused with protocol='async'" in capsys.readouterr().err
    assert "fewer nodes just works for a population" in " ".join(slurm.build_parser().format_help().split())
