"""Datasets, partitions and models, without MPI."""
import numpy as np
import pytest
import torch

from communities import config
from communities.workload import data, models


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "label_groups"])
@pytest.mark.parametrize("world", [3, 8])
def test_partitions_are_disjoint_covering_and_deterministic(kind, world):
    y = np.random.default_rng(0).integers(0, 10, size=1000)
    shards = data.partition(y, world, kind, seed=1, alpha=0.3, groups=3)
    allidx = np.concatenate([s.indices for s in shards])
    assert sorted(allidx.tolist()) == list(range(1000))
    assert all(s.indices.size > 0 for s in shards)
    again = data.partition(y, world, kind, seed=1, alpha=0.3, groups=3)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(shards, again))


def test_label_groups_plant_disjoint_label_sets():
    y = np.repeat(np.arange(10), 50)
    shards = data.partition(y, 8, "label_groups", seed=0, groups=4, purity=1.0)
    assert [s.group for s in shards] == [0, 0, 1, 1, 2, 2, 3, 3]
    for s in shards:
        labels = set(np.unique(y[s.indices]).tolist())
        assert labels == {c for c in range(10) if c % 4 == s.group}


def test_label_groups_purity_mixes_in_other_labels():
    y = np.repeat(np.arange(4), 200)
    shards = data.partition(y, 4, "label_groups", seed=0, groups=2, purity=0.8)
    own = [np.mean(y[s.indices] % 2 == s.group) for s in shards]
    assert all(0.75 < o < 0.85 for o in own)


def test_dirichlet_small_alpha_is_skewed():
    y = np.repeat(np.arange(10), 100)
    def skew(a):
        return np.mean([np.max(np.bincount(y[s.indices], minlength=10)) / max(s.indices.size, 1)
                                  for s in data.partition(y, 8, "dirichlet", seed=0, alpha=a)])
    assert skew(0.05) > skew(100.0) + 0.3


def test_builtin_datasets_load():
    cfg = config.DataConfig(dataset="digits")
    ds = data.load(cfg, 0)
    assert ds.x_train.shape[1] == 64 and ds.n_classes == 10 and len(ds.x_test) > 400
    ds = data.load(config.DataConfig(dataset="synthetic"), 0)
    assert ds.x_train.dtype == np.float32 and ds.n_classes == 8


def test_mnist1d_loads_locally():
    pytest.importorskip("mnist1d")
    ds = data.load(config.DataConfig(dataset="mnist1d"), 0)
    assert ds.x_train.shape == (4000, 40) and ds.x_test.shape == (1000, 40)


def bad_shapes():
    return np.zeros((10, 3)), np.zeros(9), np.zeros((5, 3)), np.zeros(5)


def good_user_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 5)), rng.integers(0, 3, 40), rng.normal(size=(10, 5)), rng.integers(0, 3, 10)


def test_user_dataset_errors_name_the_function():
    with pytest.raises(data.DataError, match="lengths differ"):
        data.load(config.DataConfig(dataset="tests.unit.test_data_models:bad_shapes"), 0)
    with pytest.raises(data.DataError, match="test_data_models.py has no 'nothing_here'"):
        data.load(config.DataConfig(dataset="tests.unit.test_data_models:nothing_here"), 0)
    ds = data.load(config.DataConfig(dataset="tests.unit.test_data_models:good_user_data"), 0)
    assert ds.n_classes == 3


def raises():
    raise FileNotFoundError("/data/train.npz")


def string_features():
    x = np.array([["a", "b"]] * 10)
    return x, np.zeros(10, dtype=int), x[:5], np.zeros(5, dtype=int)


def string_labels():
    return np.zeros((10, 2)), np.array(["cat"] * 10), np.zeros((5, 2)), np.array(["dog"] * 5)


def fractional_labels():
    return np.zeros((10, 2)), np.full(10, 0.5), np.zeros((5, 2)), np.zeros(5)


@pytest.mark.parametrize("fn, needle", [
    ("raises", "raises() raised FileNotFoundError: /data/train.npz"),
    ("string_features", "x_train holds <U1 values"),
    ("string_labels", "y_train holds <U3 values"),
    ("fractional_labels", "y_train holds non-integer labels"),
])
def test_a_user_dataset_that_raises_or_returns_strings_is_one_error_naming_it(fn, needle):
    spec = f"tests.unit.test_data_models:{fn}"
    with pytest.raises(data.DataError) as err:
        data.load(config.DataConfig(dataset=spec), 0)
    assert f"data.dataset={spec!r}" in str(err.value) and needle in str(err.value)


def test_flat_buffer_is_the_model():
    m = models.MLP(8, 3, [5], batchnorm=True)
    flat, n_params = models.flatten_(m)
    n_bn = sum(b.numel() for b in m.buffers() if b.is_floating_point())
    assert n_params == sum(p.numel() for p in m.parameters()) and flat.numel() == n_params + n_bn
    flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in m.parameters())
    assert all(float(b.abs().sum()) == 0 for b in m.buffers() if b.is_floating_point())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert float(flat.abs().sum()) > 0  # the optimizer steps the flat buffer


def test_cnn1d_matches_mnist1d_paper_layout():
    m = models.CNN1D(40, 10, channels=25)
    assert m.head.in_features == 125
    assert m(torch.randn(3, 40)).shape == (3, 10)


def test_user_model_output_is_checked():
    with pytest.raises(models.ModelError, match="returns shape"):
        models.check_output(torch.nn.Linear(4, 2), torch.randn(3, 4), 5, "x:y")


def test_a_user_dataset_can_declare_groups_per_rank_or_per_example():
    ds = data.load_user("tests.helpers.user_fns:declared_rank_groups")
    shards = data.partition(ds.y_train, 4, "iid", 0)
    assert data.declared_groups(ds, shards) == [0, 0, 1, 1]
    with pytest.raises(data.DataError, match="groups has 4 entries for 3 ranks"):
        data.declared_groups(ds, data.partition(ds.y_train, 3, "iid", 0))
    ds = data.load_user("tests.helpers.user_fns:declared_example_groups")
    # contiguous shards: ranks 0-1 hold examples 0-149 (group 7), ranks 2-3 the rest (group 9)
    contiguous = [data.Shard(idx, None) for idx in np.array_split(np.arange(300), 4)]
    assert data.declared_groups(ds, contiguous) == [7, 7, 9, 9]
    assert data.declared_groups(data.load_user("tests.helpers.user_fns:not_deterministic"), contiguous) is None


@pytest.mark.parametrize("out, needle", [
    ({"x_train": 1}, "without ['y_train', 'x_test', 'y_test']"),
    ({"x_train": 1, "y_train": 1, "x_test": 1, "y_test": 1, "group": [0]}, "unknown key(s) ['group']"),
    ({"x_train": 1, "y_train": 1, "x_test": 1, "y_test": 1, "groups": [0.5]}, "groups must be a non-empty 1-D"),
])
def test_a_bad_groups_declaration_is_named(monkeypatch, out, needle):
    import types

    mod = types.ModuleType("fake_groups_mod")
    mod.fn = lambda: out
    monkeypatch.setitem(__import__("sys").modules, "fake_groups_mod", mod)
    with pytest.raises(data.DataError, match=__import__("re").escape(needle)):
        data.load_user("fake_groups_mod:fn")
