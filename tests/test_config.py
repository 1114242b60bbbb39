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


def test_ward_needs_euclidean():
    with pytest.raises(ConfigError, match="ward"):
        config.load("configs/quickstart.yaml", ["clustering.linkage=ward"])
    config.load("configs/quickstart.yaml", ["clustering.linkage=ward", "clustering.metric=euclidean"])


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
