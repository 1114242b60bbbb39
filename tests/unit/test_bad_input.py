"""Bad input gets one clear message naming the key (or file, or ranks), before any rank trains."""
import math
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from communities import config
from communities.config import ConfigError
from tests.helpers.mpi import ROOT

SECTIONS = {k: v for k, v in config.Config.model_fields.items()}
# Everything YAML can say: huge ints, floats with inf/nan, any unicode, and nesting.
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**80, 2**80), st.floats(),
                   st.text(max_size=12), st.sampled_from(["..", ".", "a/b", "-1", ".inf", "1e400", "~", "&a [*a]"]))
scalars = st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.one_of(st.text(max_size=6), st.sampled_from(["lr", "start", "end", "name"])), inner, max_size=3),
    max_leaves=8)
keys = st.sampled_from(sorted(config._all_keys(config.Config)) + ["bogus", "train.bogus", "merge.lamda"])
QUICKSTART = (ROOT / "configs" / "quickstart.yaml").read_bytes()


def _config_or_message(path, overrides=()):
    """config.load gives a Config (whose world checks give a Config or a message) or a ConfigError; nothing else."""
    try:
        cfg = config.load(path, list(overrides))
    except ConfigError as exc:
        assert str(exc) and "Traceback" not in str(exc)
        return None
    assert isinstance(cfg, config.Config)
    assert config.from_json(cfg.to_json()) == cfg  # what rank 0 broadcasts validates again on every rank
    try:
        cfg.check_world(8)
    except ConfigError as exc:
        assert str(exc)
    return cfg


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6).strip() \
        .removesuffix("...").strip()


@given(st.dictionaries(keys, scalars, max_size=6))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_configs_give_a_config_or_a_message(overrides):
    """Whatever is thrown at the validator: a valid Config or a ConfigError, never another exception."""
    _config_or_message(ROOT / "configs" / "quickstart.yaml", [f"{k}={_flow(v)}" for k, v in overrides.items()])


def _numeric_keys(model=config.Config, prefix=""):
    """Dotted keys of every int or float field (Optional ones too), nested sections included."""
    import typing

    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
        if isinstance(ann, type) and issubclass(ann, config.BaseModel):
            out += _numeric_keys(ann, f"{prefix}{name}.")
        elif any(a in (int, float) for a in args):
            out.append(f"{prefix}{name}")
    return out


NUMERIC_KEYS = sorted(_numeric_keys())


@pytest.fixture(scope="module")
def resolved_quickstart(tmp_path_factory):
    """The quickstart with every default written out, so that any one key can be overridden alone."""
    path = tmp_path_factory.mktemp("cfg") / "resolved.yaml"
    path.write_text(config.load(ROOT / "configs" / "quickstart.yaml").to_yaml())
    return path


@given(key=st.sampled_from(NUMERIC_KEYS), value=st.one_of(
    st.floats(), st.integers(), st.integers(-2**80, 2**80),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 2**32, 2**64, -1, 10**400])))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_extreme_numbers_give_a_config_or_a_message(resolved_quickstart, key, value):
    """inf, nan and huge ints in any numeric key: a message naming the key, or a config every rank accepts."""
    text = {float("inf"): ".inf", float("-inf"): "-.inf"}.get(value, ".nan" if value != value else repr(value))
    try:
        config.load(resolved_quickstart, [f"{key}={text}"])
    except ConfigError as exc:
        assert key in str(exc) or not (value != value or value in (math.inf, -math.inf)), str(exc)
    else:
        _config_or_message(resolved_quickstart, [f"{key}={text}"])


@given(st.lists(st.text(max_size=30), max_size=4))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_override_strings_give_a_config_or_a_message(overrides):
    _config_or_message(ROOT / "configs" / "quickstart.yaml", overrides)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node, parts = out, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value
    return out


@given(st.dictionaries(keys, scalars, max_size=8))
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_random_whole_files_give_a_config_or_a_message(tmp_path, flat):
    path = tmp_path / "random.yaml"
    path.write_text(yaml.safe_dump(_nest(flat), allow_unicode=True), encoding="utf-8")
    _config_or_message(path)


@given(st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8")),
    # near-valid files: the quickstart with a few bytes replaced, inserted or cut off
    st.tuples(st.integers(0, len(QUICKSTART)), st.binary(min_size=0, max_size=4), st.integers(0, 4)).map(
        lambda c: QUICKSTART[:c[0]] + c[1] + QUICKSTART[c[0] + c[2]:]),
))
@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_random_bytes_as_a_config_file_give_a_config_or_a_message(tmp_path, data):
    """Binary, non-UTF-8, truncated or corrupted files: a ConfigError naming the file, or a valid config."""
    path = tmp_path / "random.yaml"
    path.write_bytes(data)
    try:
        config.load(path)
    except ConfigError as exc:
        assert "random.yaml" in str(exc)


@pytest.mark.parametrize("override, needle", [
    ("data.alpha=0", "data.alpha"), ("merge.alpha=1.5", "merge.alpha"), ("merge.lam=0.5", "merge.lam"),
    ("signature.dim=1", "signature.dim"), ("strategy=federated", "strategy"), ("data.purity=2", "data.purity"),
    ("train.batch_size=0", "train.batch_size"), ("clustering.linkage=median", "clustering.linkage"),
    ("partners.p_cross.end=5", "p_cross.end"), ("partners.temperature.start=0", "temperature"),
    ("trainn.lr=1", "did you mean 'train'"), ("merge.rulee=swap", "did you mean 'merge.rule'"),
    ("data.dataset=imagenet", "data.dataset"), ("model.hidden=[0]", "model.hidden"),
])
def test_each_bad_value_names_its_key(override, needle):
    with pytest.raises(ConfigError) as exc:
        config.load(ROOT / "configs" / "quickstart.yaml", [override])
    assert needle in str(exc.value)


@pytest.mark.parametrize("override, world, needle", [
    ("data.groups=4", 3, "data.groups=4"), ("world_size=8", 4, "world_size=8"),
    ("faults.nan_rank=9", 8, "faults.nan_rank=9"),
])
def test_world_dependent_checks(override, world, needle):
    extra = ["world_size=null"] if "world" not in override else []
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [override] + extra)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        cfg.check_world(world)


def test_validate_cli_exit_codes_and_debug():
    base = [sys.executable, "-m", "communities", "validate", "configs/quickstart.yaml"]
    bad = subprocess.run(base + ["merge.lam=0"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "merge.lam" in bad.stderr and "Traceback" not in bad.stderr
    dbg = subprocess.run(base + ["merge.lam=0", "--debug"], cwd=ROOT, capture_output=True, text=True)
    assert dbg.returncode == 2 and "Traceback" in dbg.stderr
    missing = subprocess.run(base[:-1] + ["nope.yaml"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr
    ok = subprocess.run(base, cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "name: quickstart" in ok.stdout


# mpi4py's lowercase communicator methods pickle what they send and unpickle what they receive.
PICKLING = {"send", "recv", "sendrecv", "bcast", "gather", "scatter", "allgather", "alltoall", "reduce", "allreduce",
            "isend", "irecv", "ibsend", "issend", "bsend", "ssend", "mprobe", "improbe", "scan", "exscan",
            "ibcast", "igather", "iscatter", "iallgather", "ialltoall", "ireduce", "iallreduce"}
# Communicator-making calls: ``node = self.comm.Split_type(...)`` makes ``node`` a communicator too.
MAKES_COMM = {"Split", "Split_type", "Dup", "Create", "Create_group", "Create_cart", "Create_graph", "Clone",
              "Merge", "Accept", "Connect", "Get_parent", "Spawn", "Create_dist_graph", "Create_dist_graph_adjacent"}


def _pickling_calls(source: str, filename: str = "<src>"):
    """``(line, receiver.method)`` for each lowercase mpi4py object call made on a communicator.

    A receiver is a communicator when its last name is ``comm``/``*_comm`` (``self.comm``, ``world.comm``,
    ``node_comm``), ``COMM_WORLD``/``COMM_SELF``, or a name assigned from a communicator-making call. The
    World wrapper's own lowercase methods (``world.sendrecv(``, ``self.world.allgather(``) are not mpi4py
    calls: they wrap the uppercase buffer calls, which comm.py's own scan covers.
    """
    import ast

    tree = ast.parse(source, filename)
    made = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Attribute) and node.value.func.attr in MAKES_COMM:
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                made.add(ast.unparse(target))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PICKLING:
            receiver = ast.unparse(node.func.value)
            last = receiver.rsplit(".", 1)[-1]
            if last.lower() == "comm" or last.lower().endswith("_comm") or last in ("COMM_WORLD", "COMM_SELF") \
                    or receiver in made:
                found.append((node.lineno, f"{receiver}.{node.func.attr}"))
    return found


def test_the_pickle_scan_finds_what_it_should():
    bad = """
from mpi4py import MPI
MPI.COMM_WORLD.bcast(x)
self.comm.allgather(row)
world.comm.sendrecv(a, dest=1)
node_comm.recv(source=0)
node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
node.gather(x)
req = comm.irecv(source=1)
"""
    assert [c for _, c in _pickling_calls(bad)] == [
        "MPI.COMM_WORLD.bcast", "self.comm.allgather", "world.comm.sendrecv", "node_comm.recv", "node.gather",
        "comm.irecv"]
    fine = """
world.sendrecv(send, recv, peer)
self.world.allgather(row)
self.world.bcast_text(text)
self.comm.Sendrecv(a, dest=1, recvbuf=b, source=1)
MPI.COMM_WORLD.Bcast(buf)
cfg.comm.timeout
node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
node.Free()
"""
    assert _pickling_calls(fine) == []


def test_nothing_from_another_rank_is_unpickled():
    """No module uses mpi4py's pickle-based lowercase calls on a communicator, only the uppercase buffer ones."""
    import re

    modules = sorted((ROOT / "communities").rglob("*.py"))
    assert len(modules) > 10
    offenders = [f"{path.relative_to(ROOT)}:{line}: {call}(" for path in modules
                 for line, call in _pickling_calls(path.read_text(encoding="utf-8"), str(path))]
    assert not offenders, "pickle-based mpi4py calls:\n" + "\n".join(offenders)
    # comm.py, the MPI layer, calls mpi4py through self.comm only: every such call is an uppercase one
    calls = set(re.findall(r"self\.comm\.([A-Za-z_]+)\(", (ROOT / "communities" / "runtime" / "comm.py").read_text()))
    assert calls and all(c[0].isupper() for c in calls), calls


def test_overwrite_never_empties_a_directory_that_is_not_a_run(tmp_path):
    """--overwrite with name '..' (now refused by the validator) or a stray output.root must not delete a repo."""
    from communities.results import ResultsError, RunWriter

    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "setup.py").write_text("precious\n")
    (repo / "results").mkdir()
    with pytest.raises(ResultsError, match="refusing to --overwrite .*repo.* does not look like a run directory"):
        RunWriter(repo / "results" / "..", overwrite=True)
    assert (repo / "setup.py").read_text() == "precious\n" and (repo / "src").is_dir()
    # a run directory (meta.json or config.yaml), or one holding only run files (died before config.yaml), is cleared
    for marker in ("meta.json", "config.yaml", "partition.json"):
        run = tmp_path / f"run_{marker}"
        (run / "rounds" / "round_0001").mkdir(parents=True)
        (run / marker).write_text("{}")
        (run / "job.sbatch").write_text("#!/bin/bash\n")
        RunWriter(run, overwrite=True).close()
        assert sorted(p.name for p in run.iterdir()) == ["job.sbatch", "rounds"]
        assert not any((run / "rounds").iterdir())


def test_name_dotdot_is_refused_before_anything_is_deleted(tmp_path):
    """The whole path: ``communities run cfg name=.. --overwrite`` used to empty output.root's parent."""
    (tmp_path / "keep.txt").write_text("keep\n")
    (tmp_path / "results").mkdir()
    for name in ("..", ".", "../results2", "a/b"):
        res = subprocess.run([sys.executable, "-m", "communities", "validate", "configs/quickstart.yaml",
                              f"name={name}", f"output.root={tmp_path / 'results'}"],
                             cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 2 and "name" in res.stderr and "plain file name" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    run = subprocess.run([sys.executable, "-m", "communities", "run", "configs/quickstart.yaml", "name=..",
                          f"output.root={tmp_path / 'results'}", "--overwrite"], cwd=ROOT, capture_output=True,
                         text=True, env=_clean_env())
    assert run.returncode == 2 and "plain file name" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert (tmp_path / "keep.txt").read_text() == "keep\n" and (tmp_path / "results").is_dir()


def _clean_env() -> dict:
    """This environment without any launcher's variables (the test may itself run under srun or mpiexec)."""
    import os

    return {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "MPI_LOCAL"))} | {"OMP_NUM_THREADS": "1"}
