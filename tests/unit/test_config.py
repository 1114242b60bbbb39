"""Config: YAML + dotted overrides, validation with messages that name key, value and range."""
import pytest

from communities import config
from communities.config import ConfigError


def test_quickstart_validates():
    cfg = config.load("configs/quickstart.yaml")
    assert cfg.name == "quickstart" and cfg.data.groups == 4 and cfg.strategy == "community"


def test_overrides_are_typed_and_nested():
    cfg = config.load("configs/quickstart.yaml", ["train.lr=0.2", "merge.rule=clock", "partners.p_cross.end=0.5",
                                                  "model.hidden=[8, 8]"])
    assert cfg.train.lr == 0.2 and cfg.merge.rule == "clock"
    assert cfg.partners.p_cross.end == 0.5 and cfg.model.hidden == [8, 8]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trian.lr=0.1", "did you mean 'train'"),
        ("train.lrr=0.1", "did you mean 'train.lr'"),
        ("merge.lam=0.5", "merge.lam"),
        ("signature.dim=1", "signature.dim"),
        ("merge.alpha=1.5", "merge.alpha"),
        ("strategy=allreduce2", "strategy"),
        ("train.lr=fast", "train.lr"),
        ("clustering.metric=cosine", None),
    ],
)
def test_bad_values_name_the_key(override, needle):
    if needle is None:
        config.load("configs/quickstart.yaml", [override])
        return
    with pytest.raises(ConfigError) as exc:
        config.load("configs/quickstart.yaml", [override])
    assert needle in str(exc.value)


def test_ward_with_cosine_is_ward_on_unit_rows():
    """The default linkage is ward: a user who asks for cosine distances gets Ward's tree of the unit rows."""
    import numpy as np

    from communities.core import clustering

    cfg = config.load("configs/quickstart.yaml", ["clustering.metric=cosine"])
    assert (cfg.clustering.linkage, cfg.clustering.metric) == ("ward", "cosine")
    S = np.random.default_rng(0).normal(size=(12, 6))
    Z, d = clustering.build_tree(S, "ward", "cosine")
    Z_units, _ = clustering.build_tree(S / np.linalg.norm(S, axis=1, keepdims=True), "ward", "euclidean")
    np.testing.assert_allclose(Z, Z_units, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(d, clustering._pdist(clustering._rows(S, "cosine"), "cosine"), atol=1e-12)


def test_too_few_draws_for_the_level_is_refused():
    with pytest.raises(ConfigError, match="clustering.draws=9"):
        config.load("configs/quickstart.yaml", ["clustering.alpha=0.05", "clustering.draws=9"])
    config.load("configs/quickstart.yaml", ["clustering.alpha=0.05", "clustering.draws=19"])
    config.load("configs/quickstart.yaml", ["clustering.alpha=null", "clustering.draws=9"])  # no test, no draws


def test_world_checks():
    cfg = config.load("configs/quickstart.yaml", ["world_size=null"])
    with pytest.raises(ConfigError, match="data.groups=4"):
        cfg.check_world(3)
    cfg.check_world(8)
    with pytest.raises(ConfigError, match="world_size=8"):
        config.load("configs/quickstart.yaml").check_world(4)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        config.load(bad)


def test_json_round_trip_is_identical():
    cfg = config.load("configs/quickstart.yaml", ["seed=7"])
    again = config.from_json(cfg.to_json())
    assert again == cfg and again.to_json() == cfg.to_json()


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.path=value"):
        config.load("configs/quickstart.yaml", ["train.lr"])


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", "/tmp", "a\\b", "", "x" * 256, "ünï"])
def test_name_must_be_one_plain_file_name(name):
    """``output.root/name`` is what --overwrite clears: 'name: ..' would empty the directory above results/."""
    with pytest.raises(ConfigError, match=r"^.*name: .*plain file name"):
        config.load("configs/quickstart.yaml", [f"name={name!r}"])


@pytest.mark.parametrize("name", ["quickstart", "a.b-c_1", "...", ".hidden", "x" * 255])
def test_plain_names_are_fine(name):
    assert config.load("configs/quickstart.yaml", [f"name={name!r}"]).name == name


def test_seed_is_bounded_for_numpy_and_scikit_learn():
    assert config.load("configs/quickstart.yaml", [f"seed={2**32 - 1}"]).seed == 2**32 - 1
    for seed in (2**32, 2**64, -1):
        with pytest.raises(ConfigError, match=r"seed.*2\*\*32"):
            config.load("configs/quickstart.yaml", [f"seed={seed}"])


@pytest.mark.parametrize("override", ["train.lr=.inf", "train.lr=.nan", "train.lr=-.inf", "faults.hostile_scale=.inf",
                                      "faults.hostile_scale=.nan", "comm.timeout=.inf", "partners.p_cross.start=.nan",
                                      "faults.slow_max=1e400"])
def test_inf_and_nan_are_rejected(override):
    with pytest.raises(ConfigError, match=override.split("=")[0] + ".*finite"):
        config.load("configs/quickstart.yaml", [override])


def test_nullable_and_finite_values_still_validate():
    cfg = config.load("configs/quickstart.yaml", ["faults.nan_rank=null", "signature.layer=null", "threads=null",
                                                  "examples.pass_count=null", "world_size=null", "train.lr=1e-300"])
    assert cfg.faults.nan_rank is None and cfg.threads is None and cfg.train.lr == 1e-300


@pytest.mark.parametrize("path", sorted(__import__("pathlib").Path("configs").glob("*.yaml")))
def test_shipped_configs_validate(path):
    config.load(path)


def test_binary_file_is_named(tmp_path):
    for data in (b"\xff\xfe\x00\x01binary", "name: caf\xe9\n".encode("latin-1"), bytes(range(256))):
        bad = tmp_path / "binary.yaml"
        bad.write_bytes(data)
        with pytest.raises(ConfigError, match="binary.yaml"):
            config.load(bad)


@pytest.mark.parametrize("text, key, lines", [
    ("seed: 1\nseed: 2\n", "seed", "line 1 and line 2"),
    ("train:\n  lr: 0.1\n  momentum: 0.5\n  lr: 0.2\n", "train.lr", "line 2 and line 4"),
    ("train: {lr: 0.1, lr: 0.2}\n", "train.lr", "line 1 and line 1"),
    ("partners:\n  p_cross:\n    start: 0.1\n    start: 0.2\n", "partners.p_cross.start", "line 3 and line 4"),
    ("train: {}\ntrain: {}\n", "train", "line 1 and line 2"),
])
def test_duplicate_keys_are_named_with_the_file(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        config.load(path)
    assert f"duplicate key {key!r}" in str(exc.value) and "dup.yaml" in str(exc.value) and lines in str(exc.value)


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("train: &t {lr: 0.1, budget: 5}\nmerge:\n  ema: &e {start: 0.1, end: 0.5}\n"
                    "clustering:\n  k: {start: 2, end: 1}\n")
    assert config.load(path).train.lr == 0.1


@pytest.mark.parametrize("text, needle", [
    ("seed: 2020-13-45\n", "month"),                     # PyYAML raises ValueError, not YAMLError
    ("train: " + "[" * 3000 + "\n", "nested too deeply"),  # RecursionError in PyYAML
    ("a: &a [*a]\n", "refers to itself"),
    ("data: !!set {a, b}\n", "data"),
    ("seed: !!binary aGVsbG8=\n", "seed"),
])
def test_yaml_oddities_give_a_message(tmp_path, text, needle):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        config.load(path)
    assert needle in str(exc.value) and "odd.yaml" in str(exc.value)


def test_alias_bombs_stop_early(tmp_path):
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 leaves
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="bomb.yaml"):
        config.load(path)


@pytest.mark.parametrize("override, check", [
    ("merge.ema.end=0.4", lambda c: (c.merge.ema.start, c.merge.ema.end, c.merge.ema.horizon) == (0.1, 0.4, 100)),
    ("clustering.k.start=3", lambda c: (c.clustering.k.start, c.clustering.k.end) == (3, 1)),
    ("partners.temperature.horizon=50",
     lambda c: (c.partners.temperature.shape, c.partners.temperature.horizon, c.partners.temperature.end)
     == ("exp", 50, 20.0)),
    ("partners.p_cross.shape=linear",  # the file writes this schedule: the override merges into the file's
     lambda c: (c.partners.p_cross.start, c.partners.p_cross.horizon, c.partners.p_cross.shape)
     == (0.02, 80, "linear")),
])
def test_an_override_of_one_schedule_field_keeps_the_others(override, check):
    assert check(config.load("configs/quickstart.yaml", [override]))


def test_a_schedule_written_in_the_file_is_taken_as_written(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("merge: {ema: {end: 0.4}}\n")
    with pytest.raises(ConfigError, match="merge.ema.start: Field required"):
        config.load(path)


@pytest.mark.parametrize("override", ["seed=true", "train.budget=yes", "train.lr=false", "world_size=true",
                                      "model.hidden=[8, true]", "faults.nan_rank=no", "clustering.k.start=true"])
def test_booleans_are_refused_where_numbers_are_expected(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: must be a number, not a boolean"):
        config.load("configs/quickstart.yaml", [override])


def test_booleans_still_set_boolean_keys():
    cfg = config.load("configs/quickstart.yaml", ["data.standardize=false", "consensus.stop=no"])
    assert cfg.data.standardize is False and cfg.consensus.stop is False


def test_name_and_injected_disk_faults_may_change_on_resume():
    a = config.load("configs/quickstart.yaml").model_dump()
    b = config.load("configs/quickstart.yaml", ["name=renamed", "faults.disk_full_at=3"]).model_dump()
    assert config.differences(a, b) == []
    c = config.load("configs/quickstart.yaml", ["faults.nan_rank=1"]).model_dump()
    assert config.differences(a, c) == ["faults.nan_rank: checkpoint has None, config has 1"]
