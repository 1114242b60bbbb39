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
    assert path == tmp_path / "res" / "tiny.sbatch" and path.stat().st_mode & 0o111
    assert not (tmp_path / "res" / "tiny").exists()  # generating makes no run directory: the job does
    text = path.read_text()
    assert sbatch_lines(text) == {
        "job-name": "tiny", "nodes": "2", "ntasks-per-node": "2", "cpus-per-task": "3", "time": "01:30:00",
        "partition": "gpu", "account": "proj", "output": f"{tmp_path}/res/tiny-%j.out", "open-mode": "append",
        "signal": "B:USR1@120", "gpus-per-node": "2"}
    assert "\n#SBATCH --requeue\n" in text
    for line in (f"CONFIG={tiny_config}", "OVERRIDES=(output.root=res train.lr=0.1 device=cuda)", "LAUNCHER=srun",
                 "SRUN_MPI=pmi2", f"PYTHON={PY}", f"WORKDIR={tmp_path}", f"RUN_DIR={tmp_path}/res/tiny",
                 "FIRST_RUN_ARGS=(--overwrite)", "ULFM=0"):
        assert f"\n{line}\n" in text, line
    subprocess.run(["bash", "-n", str(path)], check=True)
    # the body is the template's, untouched
    body = slurm.template_text().split("no edits needed below")[1]
    assert text.endswith(body)
    # the run directory is announced; the job's log waits beside it, and so does the script
    assert gen(tiny_config, "output.root=res", "--print-run-dir", cwd=tmp_path).stdout.strip() == \
        str(tmp_path / "res" / "tiny")
    gen(tiny_config, "output.root=res", "--ntasks-per-node", 2, cwd=tmp_path)
    assert slurm.log_path(tmp_path / "res" / "tiny", "123") == tmp_path / "res" / "tiny-123.out"


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
        (["--warn-before", "0"], "--warn-before=0"),
        (["--warn-before", "600", "--time", "00:10:00"], "--warn-before=600 s is not shorter than --time=00:10:00"),
        (["--setup", ""], "--setup ''"),
        (["--setup", "if then"], "not valid bash (setup lines: ['if then'])"),
        (["--launcher", "srun", "comm.fault_tolerance=shrink"], "Open MPI's mpirun --with-ft ulfm"),
        (["device=cpu", "--gpus-per-node", "2", "--ntasks-per-node", "2"], "the config sets device: cpu"),
        (["--gpus-per-node", "1", "--ntasks-per-node", "2"], "--gpus-per-node=1 is fewer than --ntasks-per-node=2"),
        (["--sbatch-option=--gpus-per-node=1", "--ntasks-per-node", "2"], "--gpus-per-node=1 is fewer"),
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
    assert "\nFIRST_RUN_ARGS=(--resume)\n" in (tmp_path / "results" / "tiny.sbatch").read_text()
    # --submit without SLURM's clients says so
    monkeypatch.setenv("PATH", "/nonexistent")
    code, err = run("--ntasks-per-node", 2, "--overwrite", "--submit")
    assert code == 2 and "sbatch not found" in err


def test_launcher_files_are_not_a_run(tmp_path):
    """A batch script and its log may wait in results/<name>/ (a hand-written script's, an older
    `communities slurm`'s): they do not make it a run, and --overwrite keeps them."""
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
    text = (tmp_path / "results" / "tiny.sbatch").read_text()
    assert sbatch_lines(text)["ntasks-per-node"] == "2"
    header = text.split("#SBATCH", 1)[0]
    assert "# A requeue onto fewer nodes just works for a population" in header
    assert "resumes bitwise from the\n# per-replica checkpoints" in header
    capsys.readouterr()
    code = slurm.main_slurm([str(tiny_config), "world_size=8", "protocol=async", "merge.optimizer_state=average",
                             "--ntasks-per-node", "2", "--overwrite"])
    assert code == 2 and "is refused with protocol='async'" in capsys.readouterr().err
    assert "fewer nodes just works for a population" in " ".join(slurm.build_parser().format_help().split())


# --------------------------------------------------------------------------- launcher, GPUs, setup, signal

SRUN_LIST_22 = "MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\nspecific pmix plugin versions " \
               "available: pmix_v4\n"
SRUN_LIST_PMIX = "srun: MPI types are...\nsrun: none\nsrun: pmix_v5\nsrun: pmix\n"


def test_srun_mpi_list_is_read_and_the_launcher_follows_the_mpi_library():
    from communities.tools.slurm_launcher import choose, plugins_listed, pmi_for

    assert plugins_listed(SRUN_LIST_22) == {"pmix", "none", "cray_shasta", "pmi2", "pmix_v4"}
    assert plugins_listed(SRUN_LIST_PMIX) == {"none", "pmix_v5", "pmix"}
    mpich, ompi = "MPICH Version: 5.0.2", "Open MPI v5.0.11, package: Open MPI"
    assert pmi_for(mpich) == "pmi2" and pmi_for(ompi) == "pmix" and pmi_for(None) == "pmi2"

    def auto(plugins, library, **kw):
        kw.setdefault("srun_mpi", None)
        return choose("auto", python="python3", ulfm=kw.pop("ulfm", False), plugins=plugins, library=library,
                      probe=False, **kw)

    both = plugins_listed(SRUN_LIST_22)
    assert (auto(both, mpich).launcher, auto(both, mpich).srun_mpi) == ("srun", "pmi2")
    assert (auto(both, ompi).launcher, auto(both, ompi).srun_mpi) == ("srun", "pmix")
    only_pmix = plugins_listed(SRUN_LIST_PMIX)
    assert auto(only_pmix, mpich).launcher == "mpirun" and "not pmi2" in auto(only_pmix, mpich).why
    assert auto(only_pmix, ompi).launcher == "srun"
    assert auto(None, mpich).launcher == "mpirun" and "no working `srun --mpi=list`" in auto(None, mpich).why
    assert auto(both, ompi, ulfm=True).launcher == "mpirun"  # ULFM: Open MPI's mpirun --with-ft ulfm
    assert auto(only_pmix, mpich, srun_mpi="pmix").launcher == "srun"  # --srun-mpi says what the library speaks
    assert choose("mpiexec", python="python3", srun_mpi=None, ulfm=False, probe=False).launcher == "mpirun"


def _fake_srun(tmp_path: Path, listing: str) -> str:
    """A PATH whose srun prints ``listing`` for --mpi=list (and whose sbatch is missing)."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\n[ \"$1\" = --mpi=list ] && printf '%s' '{listing}' && exit 0\nexit 1\n")
    srun.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.parametrize("listing,launcher", [(SRUN_LIST_22, "srun"), (SRUN_LIST_PMIX, "mpirun"), (None, "mpirun")])
def test_the_default_launcher_is_srun_where_slurm_speaks_the_wheels_pmi(tmp_path, tiny_config, listing, launcher):
    """The mpich wheel speaks PMI-2: srun where srun --mpi=list offers pmi2, else (or with no srun) mpirun."""
    import os

    path = _fake_srun(tmp_path, listing) if listing is not None else "/usr/bin:/bin"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=path)
    res = gen(tiny_config, "--ntasks-per-node", 2, cwd=tmp_path, env=env)
    text = Path(res.stdout.split()[0]).read_text()
    assert f"\nLAUNCHER={launcher}\n" in text and "\nSRUN_MPI=pmi2\n" in text
    assert f"communities slurm: launcher {'srun --mpi=pmi2' if launcher == 'srun' else 'mpirun'} (" in res.stderr
    shrink = gen(tiny_config, "comm.fault_tolerance=shrink", "--ntasks-per-node", 2, "--overwrite", cwd=tmp_path,
                 env=env)
    text = Path(shrink.stdout.split()[0]).read_text()
    assert "\nLAUNCHER=mpirun\n" in text and "\nULFM=1\n" in text  # ULFM: always mpirun --with-ft ulfm


def test_gpus_make_the_run_cuda_and_a_cpu_config_is_refused(tmp_path, tiny_config, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "results" / "tiny.sbatch"

    def overrides(*args):
        assert slurm.main_slurm([str(tiny_config), "--ntasks-per-node", "2", "--launcher", "srun", "--overwrite",
                                 *args]) == 0, capsys.readouterr().err
        return re.search(r"^OVERRIDES=\((.*)\)$", script.read_text(), re.M).group(1).split()

    assert overrides() == []  # no GPUs asked: the config's device (cpu by default) as it is
    assert overrides("--gpus-per-node", "2") == ["device=cuda"]
    assert sbatch_lines(script.read_text())["gpus-per-node"] == "2"
    assert overrides("--gpus-per-task", "1") == ["device=cuda"]
    assert sbatch_lines(script.read_text())["gpus-per-task"] == "1" and "gpus-per-node" not in \
        sbatch_lines(script.read_text())
    assert overrides("--sbatch-option=--gres=gpu:a100:2") == ["device=cuda"]
    assert overrides("device=auto", "--gpus-per-node", "4") == ["device=auto", "device=cuda"]  # not a silent CPU run
    assert overrides("device=cuda", "--gpus-per-node", "2") == ["device=cuda"]  # already cuda: nothing added
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text(tiny_config.read_text() + "device: cpu\n")
    code = slurm.main_slurm([str(cpu), "--ntasks-per-node", "2", "--gpus-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--gpus-per-node=2 asks for GPUs but the config sets device: cpu" in err


def test_the_setup_block_runs_first_in_the_job_shell(tmp_path, tiny_config, monkeypatch, capsys):
    """Setup lines from the config's slurm.setup, then --setup; they run in the batch shell, from WORKDIR."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "with_setup.yaml"
    cfg.write_text(tiny_config.read_text() + "slurm:\n  setup: ['export FROM_CONFIG=1', 'cd sub && cd ..']\n")
    (tmp_path / "sub").mkdir()
    code = slurm.main_slurm([str(cfg), "--ntasks-per-node", "2", "--launcher", "mpirun",
                             "--setup", "export FROM_CLI=$FROM_CONFIG$((1 + 1))", "--setup", "module() { :; }"])
    assert code == 0, capsys.readouterr().err
    text = (tmp_path / "results" / "tiny.sbatch").read_text()
    block = re.search(r"^setup\(\) \{.*?^\}$", text, re.M | re.S).group(0)
    assert block.split("\n")[1:-1] == ["    export FROM_CONFIG=1", "    cd sub && cd ..",
                                       "    export FROM_CLI=$FROM_CONFIG$((1 + 1))", "    module() { :; }"]
    # the block as the job runs it: the function, then what it left in the shell
    out = subprocess.run(["bash", "-c", block + '\nsetup && echo "$FROM_CONFIG $FROM_CLI $PWD"'], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "12", str(tmp_path)]
    # the body calls it first, right after moving to WORKDIR, and stops the job when it fails
    body = text.split("no edits needed below")[1]
    assert body.index('cd "$WORKDIR"') < body.index("setup ||") < body.index("--print-run-dir")
    assert 'echo "== the setup block failed (exit $rc)" >&2; exit 2' in body
    # the config's lines are not the run's: a resume with other setup lines is no other run
    from communities.config import RESUME_MAY_CHANGE

    assert "slurm" in RESUME_MAY_CHANGE


def test_the_stop_warning_is_a_flag_and_the_template_says_when_ranks_stop(tmp_path, tiny_config, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert slurm.main_slurm([str(tiny_config), "--ntasks-per-node", "2", "--launcher", "mpirun",
                             "--warn-before", "900", "--time", "02:00:00"]) == 0
    assert sbatch_lines((tmp_path / "results" / "tiny.sbatch").read_text())["signal"] == "B:USR1@900"
    assert slurm.time_seconds("02:00:00") == 7200 and slurm.time_seconds("1-00:30") == 88200
    assert slurm.time_seconds("90") == 5400 and slurm.time_seconds("5:30") == 330
    # the template's words match the engine: a stop is acted on at the next signature round (virtual clock)
    words = " ".join(line.lstrip("# ") for line in slurm.template_text().split("\n") if line.startswith("#"))
    assert "at the end of the current unit" not in words
    assert "A rank only acts on a stop at a signature round (every signature.every units;" in words
    assert "--warn-before" in words and "plus one checkpoint" in words
    from communities.engine.mixing.mixer import Mixer

    assert "At signature rounds, one tiny Allreduce" in Mixer.stop_reason.__doc__  # what the words describe


def test_the_script_honours_the_umask(tmp_path, tiny_config, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    old = os.umask(0o027)
    try:
        assert slurm.main_slurm([str(tiny_config), "--ntasks-per-node", "2", "--launcher", "mpirun"]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "results" / "tiny.sbatch").stat().st_mode & 0o777 == 0o750


def test_a_job_given_gpus_that_trains_on_cpus_says_so():
    """A hand-written script with GPUs and device: cpu is not a silent CPU run: rank 0 warns."""
    from communities.engine.loop import unused_gpus

    assert "SLURM gave this job 4 GPU(s) per node, but device='cpu'" in unused_gpus("cpu", {"SLURM_GPUS_ON_NODE": "4"})
    assert unused_gpus("cuda", {"SLURM_GPUS_ON_NODE": "4"}) is None
    assert unused_gpus("cpu", {"SLURM_GPUS_ON_NODE": "0"}) is None and unused_gpus("cpu", {}) is None
