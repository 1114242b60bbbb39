"""data.samples: MNIST-1D's sample count, generated once and cached under data.root."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from communities.config import apply_overrides, from_dict
from communities.errors import ConfigError, DataError
from communities.workload import data

mnist1d = pytest.importorskip("mnist1d.data")


@pytest.fixture
def counted(monkeypatch):
    """Counts the generator's calls (slowed a little, so that concurrent loaders overlap)."""
    calls = []
    real = mnist1d.make_dataset

    def make_dataset(args=None, template=None):
        calls.append(args.num_samples)
        time.sleep(0.2)
        return real(args, template)
    monkeypatch.setattr(mnist1d, "make_dataset", make_dataset)
    return calls


def arrays(ds):
    return ds.x_train, ds.y_train, ds.x_test, ds.y_test


def test_the_sample_count_reaches_the_generator():
    ds = data.load_mnist1d(0, samples=300)
    assert len(ds.y_train) == 240 and len(ds.y_test) == 60 and ds.input_shape == (40,)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64


def test_generated_once_then_read_back_with_the_same_arrays(tmp_path, counted):
    root = str(tmp_path / "cache")
    first = data.load_mnist1d(0, samples=200, root=root)
    again = data.load_mnist1d(1, samples=200, root=root)  # the run's seed does not key it: the generator's does
    assert counted == [200]
    plain = data.load_mnist1d(0, samples=200)
    for a, b, c in zip(arrays(first), arrays(again), arrays(plain)):
        assert a.dtype == b.dtype == c.dtype and np.array_equal(a, b) and np.array_equal(a, c)
    files = sorted(os.listdir(root))
    assert [f for f in files if f.endswith(".npz")] == [f for f in files if f.startswith("mnist1d-200-")]
    assert not [f for f in files if f.endswith(".tmp")]
    data.load_mnist1d(0, samples=300, root=root)  # other arguments: another file
    assert counted == [200, 200, 300]
    assert len([f for f in os.listdir(root) if f.endswith(".npz")]) == 2


def test_concurrent_loaders_wait_for_the_one_that_generates(tmp_path, counted):
    out = [None] * 4

    def load(k):
        out[k] = data.load_mnist1d(0, samples=200, root=str(tmp_path))
    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert counted == [200]
    assert all(np.array_equal(o.x_train, out[0].x_train) for o in out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_root_is_refused_by_name_and_a_readonly_cache_still_reads(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(DataError, match=r"data.root=.*ro.* is not writable"):
            data.load_mnist1d(0, samples=200, root=str(ro))
    finally:
        ro.chmod(0o700)
    data.load_mnist1d(0, samples=200, root=str(ro))  # written while writable
    ro.chmod(0o500)
    try:
        assert len(data.load_mnist1d(0, samples=200, root=str(ro)).y_train) == 160
    finally:
        ro.chmod(0o700)


def test_a_damaged_cache_is_named(tmp_path):
    data.load_mnist1d(0, samples=200, root=str(tmp_path))
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"not a zip")
    with pytest.raises(DataError, match="delete it"):
        data.load_mnist1d(0, samples=200, root=str(tmp_path))


def test_the_config_key_reaches_the_loader(tmp_path):
    cfg = from_dict(apply_overrides({}, ["data.dataset=mnist1d", "data.samples=250", f"data.root={tmp_path}",
                                         "data.standardize=false"]))
    ds = data.load(cfg.data, cfg.seed)
    assert len(ds.y_train) == 200 and list(tmp_path.glob("mnist1d-250-*.npz"))
    assert from_dict(apply_overrides({}, ["data.dataset=mnist1d"])).data.samples is None


@pytest.mark.parametrize("overrides,match", [
    (["data.samples=1000"], "needs data.dataset=mnist1d"),
    (["data.dataset=synthetic", "data.samples=1000"], "data.synthetic.n_samples"),
    (["data.dataset=mnist1d", "data.samples=50"], "greater than or equal to 100"),
    (["data.dataset=mnist1d", "data.samples=1000000"], "less than or equal to 640000"),
    (["data.dataset=mnist1d", "data.samples=true"], "not a boolean"),
])
def test_the_config_key_is_validated(overrides, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(apply_overrides({}, overrides))


def test_samples_per_replica_grows_the_data_with_the_world(tmp_path):
    """Weak scaling: every replica holds data.samples_per_replica training examples, whatever the world size."""
    from communities.errors import ConfigError

    cfg = from_dict(apply_overrides({}, ["data.dataset=mnist1d", "data.samples_per_replica=40", f"data.root={tmp_path}",
                                         "data.standardize=false"]))
    for world in (4, 8):
        ds = data.load(cfg.data, cfg.seed, 0, world)
        assert len(ds.y_train) == 40 * world  # 50 x world generated, 80% of them training examples
    for overrides, match in ((["data.samples_per_replica=40"], "needs data.dataset=mnist1d"),
                             (["data.dataset=mnist1d", "data.samples_per_replica=40", "data.samples=1000"],
                              "both size the data")):
        with pytest.raises(ConfigError, match=match):
            from_dict(apply_overrides({}, overrides))
    with pytest.raises(ConfigError, match="asks the mnist1d generator for 800,000 samples"):
        from_dict(apply_overrides({}, ["data.dataset=mnist1d", "data.samples_per_replica=640"])).check_world(1000)
