"""Bad input gets one clear message naming the key (or file, or ranks), before any rank trains."""
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from communities import config
from communities.config import ConfigError

from .conftest import ROOT, run_engine

SECTIONS = {k: v for k, v in config.Config.model_fields.items()}
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=8), st.lists(st.integers(-5, 5), max_size=3))
keys = st.sampled_from(sorted(config._all_keys(config.Config)) + ["bogus", "train.bogus", "merge.lamda"])


@given(st.dictionaries(keys, scalars, max_size=6))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_configs_give_a_config_or_a_message(overrides):
    """Whatever is thrown at the validator: a valid Config or a ConfigError, never another exception."""
    items = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
             for k, v in overrides.items()]
    try:
        cfg = config.load(ROOT / "configs" / "quickstart.yaml", items)
    except ConfigError as exc:
        assert str(exc) and "Traceback" not in str(exc)
    else:
        assert isinstance(cfg, config.Config)
        try:
            cfg.check_world(8)
        except ConfigError as exc:
            assert str(exc)


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
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [override] + (["world_size=null"] if "world" not in override else []))
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


@pytest.mark.timeout(300)
def test_models_that_differ_across_ranks_are_named_at_start(tmp_path, tiny_config):
    res = run_engine(3, tiny_config, tmp_path, "model.name=tests.user_fns:model_differs_on_rank_1", check=False)
    assert res.returncode == 2 and "ranks [1] disagree" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()


@pytest.mark.timeout(300)
def test_user_model_with_wrong_output_shape(tmp_path, tiny_config):
    res = run_engine(2, tiny_config, tmp_path, "model.name=tests.user_fns:wrong_logits", check=False)
    assert res.returncode == 2 and "returns shape" in res.stderr


def test_nothing_from_another_rank_is_unpickled():
    """The MPI layer only uses mpi4py's uppercase (buffer) calls, never the pickle-based lowercase ones."""
    import re

    src = (ROOT / "communities" / "comm.py").read_text()
    calls = set(re.findall(r"self\.comm\.([A-Za-z_]+)\(", src))
    pickled = {"send", "recv", "sendrecv", "bcast", "gather", "scatter", "allgather", "alltoall", "reduce",
               "allreduce", "isend", "irecv", "scan", "exscan"}
    assert calls and not (calls & pickled), calls
    for path in (ROOT / "communities").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"COMM_WORLD\.(send|recv|bcast|gather|allgather|allreduce)\(", text), path
