"""The built-in datasets' split and digits, read without scikit-learn, are scikit-learn's bit for bit."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.workload import data, stratified_split

sklearn_split = pytest.importorskip("sklearn.model_selection").train_test_split


def _theirs(x, y, fraction, seed):
    try:
        return sklearn_split(x, y, test_size=fraction, random_state=seed, stratify=y)
    except ValueError:
        return None


def _mine(x, y, fraction, seed):
    try:
        return stratified_split.train_test_split(x, y, fraction, seed)
    except ValueError:
        return None


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 300), classes=st.integers(1, 9), fraction=st.floats(0.02, 0.95),
       seed=st.integers(0, 2**32 - 1), sorted_labels=st.booleans(), data_seed=st.integers(0, 2**16))
def test_the_split_is_scikit_learns_bit_for_bit(n, classes, fraction, seed, sorted_labels, data_seed):
    y = np.random.default_rng(data_seed).integers(0, classes, size=n)
    if sorted_labels:
        y = np.sort(y)
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    mine, theirs = _mine(x, y, fraction, seed), _theirs(x, y, fraction, seed)
    assert (mine is None) == (theirs is None)  # a split scikit-learn refuses is refused here too
    if mine is not None:
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and np.array_equal(a, b)


def test_refusals_name_the_cause():
    with pytest.raises(ValueError, match=r"classes \[3\] have 1"):
        stratified_split.train_test_split(np.zeros(5), np.array([0, 0, 1, 1, 3]), 0.4, 0)
    with pytest.raises(ValueError, match="must be in"):
        stratified_split.split_sizes(10, 1.0)
    with pytest.raises(ValueError, match="cannot hold each of the 3 classes"):
        stratified_split.train_test_split(np.zeros(6), np.array([0, 0, 1, 1, 2, 2]), 0.2, 0)


def test_digits_are_scikit_learns_and_loading_them_imports_no_scikit_learn():
    from sklearn.datasets import load_digits

    features, labels = data._digits_arrays()
    theirs = load_digits()
    assert np.array_equal(features, theirs.data) and features.dtype == theirs.data.dtype
    assert np.array_equal(labels, theirs.target) and labels.dtype == theirs.target.dtype
    code = ("import sys; from communities.workload import data; data.load_digits(0.2, 0); "
            "data.load_synthetic(type('S', (), dict(n_samples=100, n_features=4, n_classes=3, class_sep=2.0, "
            "noise=1.0))(), 0.2, 0); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
