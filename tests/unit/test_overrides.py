"""From a file and its overrides to a config: mappings merge, interpolation (environment variables), run names."""
from __future__ import annotations

import pytest

from communities import config
from communities.config import ConfigError
from tests.helpers.mpi import ROOT

QUICK = ROOT / "configs" / "quickstart.yaml"
MNIST = ROOT / "configs" / "mnist1d.yaml"


def test_a_mapping_override_merges_into_what_the_file_says():
    """mnist1d.yaml writes p_cross {start: 0.05, end: 1.0, shape: cosine, begin: 10, horizon: 100}."""
    file = config.load(MNIST).partners.p_cross
    assert (file.shape, file.begin, file.horizon) == ("cosine", 10, 100)
    merged = config.load(MNIST, ["partners.p_cross={start: 0.1, end: 1.0}"]).partners.p_cross
    assert (merged.start, merged.end, merged.shape, merged.begin, merged.horizon) == (0.1, 1.0, "cosine", 10, 100)
    dotted = config.load(MNIST, ["partners.p_cross.start=0.1"]).partners.p_cross
    assert dotted == merged  # the mapping and the dotted form say the same


def test_a_mapping_override_of_a_section_the_file_leaves_out_merges_into_the_default():
    default = config.Config().merge.ema
    cfg = config.load(QUICK, ["merge.ema={end: 0.4}"])  # quickstart.yaml has no merge.ema
    assert cfg.merge.ema == default.model_copy(update={"end": 0.4})
    nested = config.load(QUICK, ["merge={outer: {enabled: true}}"])
    assert nested.merge.outer.enabled and nested.merge.lam == config.load(QUICK).merge.lam  # the file's lam stays


def test_a_free_form_table_given_whole_is_replaced_and_an_entry_merges():
    cfg = config.load(QUICK, ["faults.speed={1: 3.0}", "faults.speed={0: 2.0}"])
    assert cfg.faults.speed == {0: 2.0}
    cfg = config.load(QUICK, ["faults.speed={1: 3.0}", "faults.speed.0=2.0"])
    assert cfg.faults.speed == {0: 2.0, 1: 3.0}


def test_an_override_through_a_value_names_it():
    with pytest.raises(ConfigError, match="'seed' is a value, not a section"):
        config.load(QUICK, ["seed.x=1"])


def test_environment_variables_in_overrides_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    cfg = config.load(QUICK, ["data.root=${oc.env:SCRATCH}/data"])
    assert cfg.data.root == "/scratch/me/data"
    assert "${" not in cfg.to_json()  # what rank 0 broadcasts and writes is resolved: other nodes need no variable
    path = tmp_path / "c.yaml"
    path.write_text("name: env\ndata:\n  root: ${oc.env:SCRATCH}/cache\noutput:\n  root: ${oc.env:RESULTS,results}\n"
                    "seed: ${oc.env:SEED_FROM_ENV}\n")
    monkeypatch.setenv("SEED_FROM_ENV", "7")
    cfg = config.load(path)
    assert (cfg.data.root, cfg.output.root, cfg.seed) == ("/scratch/me/cache", "results", 7)
    monkeypatch.delenv("SEED_FROM_ENV")
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert "seed: the environment variable SEED_FROM_ENV is not set" in str(err.value)
    assert "${oc.env:SEED_FROM_ENV,DEFAULT}" in str(err.value) and str(path) in str(err.value)


def test_a_plain_dollar_brace_is_a_config_key_and_the_error_says_how_to_read_the_environment(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    with pytest.raises(ConfigError, match=r"data.root: \$\{SCRATCH\} names no config key; an environment variable is "
                                          r"written \$\{oc.env:SCRATCH\}"):
        config.load(QUICK, ["data.root=${SCRATCH}/data"])
    # a config key: resolved after the overrides, against the config as validated (defaults included)
    cfg = config.load(QUICK, ["data.root=/d/${train.lr}", "train.lr=0.2", "output.root=/r/${train.momentum}"])
    assert (cfg.data.root, cfg.output.root) == ("/d/0.2", "/r/0.9")
    assert config.load(QUICK, ["data.root=cost\\${x}"]).data.root == "cost${x}"  # a literal


def test_a_value_that_must_be_given(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: needs\ndata:\n  root: '???'\n")
    with pytest.raises(ConfigError, match=r"data.root: \?\?\? marks a value that must be given"):
        config.load(path)
    assert config.load(path, ["data.root=/data"]).data.root == "/data"
    with pytest.raises(ConfigError, match="data.root: not a valid interpolation"):
        config.load(QUICK, ["data.root=a${b"])


def test_a_schedule_given_a_number_says_what_a_schedule_looks_like():
    with pytest.raises(ConfigError) as err:
        config.load(QUICK, ["clustering.k=3"])
    text = str(err.value)
    assert "clustering.k: takes a schedule" in text and "{start: 4, end: 1, shape: linear" in text
    assert "clustering.k='{start: 3, end: 3}'" in text and "instance of" not in text and "Schedule" not in text
    with pytest.raises(ConfigError, match="merge: takes a section of keys"):
        config.load(QUICK, ["merge=3"])
    assert config.load(QUICK, ["clustering.k={start: 3, end: 3}"]).clustering.k.start == 3


def test_a_name_template_gives_each_run_of_a_sweep_its_own_name():
    names = {config.load(QUICK, ["name=lr{train.lr}_s{seed}", f"train.lr={lr}"]).name for lr in (0.1, 0.2)}
    assert names == {"lr0.1_s0", "lr0.2_s0"}
    # over defaults and overrides alike, values as a directory name can hold them
    cfg = config.load(QUICK, ["name={strategy}-{model.hidden}-{train.weight_decay}-{data.dataset}-{robust.enabled}",
                              "model.hidden=[32, 16]", "train.weight_decay=1e-5", "data.dataset=my_data:blobs"])
    assert cfg.name == "community-32-16-1e-05-my_data.blobs-false"


def test_a_name_template_in_a_file_is_filled_after_the_overrides(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text((QUICK.read_text().replace("name: quickstart", 'name: "sweep_lr{train.lr}_m{merge.rule}"')))
    assert config.load(path, ["train.lr=0.3", "merge.rule=clock"]).name == "sweep_lr0.3_mclock"
    assert config.load(path, ["name=plain"]).name == "plain"  # a name override is taken as written


@pytest.mark.parametrize("template, needle", [
    ("lr{train.lrr}", "{train.lrr} is not a config key"),
    ("x{merge}", "{merge} is a section; name one of its values"),
    ("x{seed", "a brace without its pair"),
    ("x{}", "{} is not a config key"),
])
def test_a_bad_name_template_names_what_is_wrong(template, needle):
    with pytest.raises(ConfigError) as err:
        config.load(QUICK, [f"name={template}"])
    assert needle in str(err.value) and "quickstart.yaml" in str(err.value)
