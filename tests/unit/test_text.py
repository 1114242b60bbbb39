"""Text corpora (workload/text.py): the path-hash split, domains, windows, the domain groups and partitions, the
``text`` and ``tokens`` loaders, the sampled fingerprint of a token file, and the config's refusals of a language
model's combinations."""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from communities import config
from communities.config import ConfigError
from communities.errors import DataError
from communities.workload import data
from communities.workload import text as corpora

# --------------------------------------------------------------------------- the split


def _paths(n: int, prefix: str = "pkg") -> list:
    return [f"{prefix}{i % 7}/sub{i % 3}/file_{i}.py" for i in range(n)]


def test_the_split_is_a_pure_function_of_the_path():
    paths = _paths(500)
    first = {p: corpora.is_held_out(p, 0.25) for p in paths}
    assert first == {p: corpora.is_held_out(p, 0.25) for p in reversed(paths)}  # same answer, any order


def test_adding_files_to_a_directory_moves_no_file(tmp_path):
    root = tmp_path / "tree"
    for i in range(40):
        (root / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"d{i % 4}" / f"f{i}.txt").write_text("x")
    before = {p: corpora.is_held_out(p, 0.3) for p in corpora.list_files(str(root))}
    for i in range(40, 200):  # five times as many files, in the same directories and new ones
        (root / f"d{i % 6}").mkdir(exist_ok=True)
        (root / f"d{i % 6}" / f"f{i}.txt").write_text("y")
    after = {p: corpora.is_held_out(p, 0.3) for p in corpora.list_files(str(root))}
    assert len(after) == 200 and {p: after[p] for p in before} == before


@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.5])
def test_the_split_holds_out_about_the_asked_fraction(fraction):
    paths = _paths(20_000)
    share = np.mean([corpora.is_held_out(p, fraction) for p in paths])
    # binomial standard deviation at n = 20,000 is at most 0.0035: 0.02 is more than 5 of them
    assert abs(share - fraction) < 0.02


def test_the_split_is_nested_in_the_fraction():
    """A file held out at fraction f is held out at any larger fraction: raising data.test_fraction only adds."""
    paths = _paths(2000)
    small = {p for p in paths if corpora.is_held_out(p, 0.1)}
    large = {p for p in paths if corpora.is_held_out(p, 0.3)}
    assert small < large
    assert not any(corpora.is_held_out(p, 0.0) for p in paths)


def test_domain_of():
    assert corpora.domain_of("json/decoder.py") == "json"
    assert corpora.domain_of("email/mime/text.py") == "email"
    assert corpora.domain_of("os.py") == corpora.TOP == "(top)"


def test_list_files_skips_hidden_entries_caches_and_installed_packages(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/c.txt", ".hidden.py", ".git/d.py", "pkg/__pycache__/e.py",
                "site-packages/f.py", "pkg/.g.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass\n")
    assert corpora.list_files(str(tmp_path), ".py") == ["a.py", "pkg/b.py"]
    assert corpora.list_files(str(tmp_path)) == ["a.py", "pkg/b.py", "pkg/c.txt"]


# --------------------------------------------------------------------------- windows


def test_windows_are_views_and_targets_are_inputs_shifted_by_one():
    stream = np.arange(23, dtype=np.uint8)
    x, y = corpora.windows(stream, 5)
    assert x.shape == y.shape == (4, 5)  # (23 - 1) // 5: the last window's target needs one more token
    assert x.tolist()[0] == [0, 1, 2, 3, 4] and y.tolist()[0] == [1, 2, 3, 4, 5]
    assert np.array_equal(y[:, :-1], x[:, 1:]) and np.array_equal(y[:-1, -1], x[1:, 0])
    assert np.array_equal(x.reshape(-1), stream[:20]) and np.array_equal(y.reshape(-1), stream[1:21])
    assert np.shares_memory(x, stream) and np.shares_memory(y, stream)
    x, y = corpora.windows(np.arange(6, dtype=np.uint8), 5)
    assert x.shape == (1, 5) and y.tolist() == [[1, 2, 3, 4, 5]]
    for short in (5, 1, 0):  # no window: its targets would run past the stream
        x, y = corpora.windows(np.arange(short, dtype=np.uint8), 5)
        assert x.shape == y.shape == (0, 5)


def test_spaced():
    assert corpora.spaced(7, None).tolist() == list(range(7))
    assert corpora.spaced(7, 7).tolist() == list(range(7)) == corpora.spaced(7, 100).tolist()
    assert corpora.spaced(10, 1).tolist() == [0]
    assert corpora.spaced(11, 3).tolist() == [0, 5, 10]
    for n, keep in itertools.product((2, 9, 100, 1001), (2, 3, 8, 64)):
        got = corpora.spaced(n, keep)
        assert len(got) == min(n, keep) and got[0] == 0 and got[-1] == n - 1
        assert np.all(np.diff(got) > 0) and got.dtype == np.int64
    assert corpora.spaced(0, 4).tolist() == []


# --------------------------------------------------------------------------- domain groups


def _brute_force_makespan(sizes, groups: int) -> int:
    assign = np.array(list(itertools.product(range(groups), repeat=len(sizes))))  # every split at once
    loads = np.stack([((assign == g) * sizes).sum(1) for g in range(groups)])
    return int(loads.max(0).min())


def test_domain_groups_keep_domains_whole_deterministic_and_balanced():
    rng = np.random.default_rng(0)
    for trial in range(300):
        groups = int(rng.integers(1, 5))
        sizes = rng.integers(1, 10_000, size=int(rng.integers(groups, 9))) * (
            rng.integers(1, 50, size=1) if trial % 3 else 1)
        if trial % 5 == 0:
            sizes[0] *= 100  # one domain larger than all the others together
        out = corpora.domain_groups(sizes, groups)
        assert out.shape == sizes.shape and np.array_equal(out, corpora.domain_groups(sizes.copy(), groups))
        assert set(out.tolist()) == set(range(groups))  # no group is left empty while it has domains to take
        load = np.bincount(out, weights=sizes, minlength=groups)
        # Greedy by decreasing size: when the heaviest group got its last domain p, the group was the lightest,
        # so load <= (total - p) / G + p; if p is not the group's first, every group held a domain >= p before
        # it, so p <= total / (G + 1) and load <= 2 x mean; if it is the first, load = p <= the largest domain
        assert load.max() <= max(sizes.max(), 2 * sizes.sum() / groups)
        # ... and Graham's bound for longest-processing-time-first: within 4/3 - 1/(3G) of the best split
        if groups ** len(sizes) <= 4096:
            assert load.max() <= (4 / 3 - 1 / (3 * groups)) * _brute_force_makespan(sizes, groups) + 1e-9


def test_domain_groups_ties_go_to_the_lowest_group():
    assert corpora.domain_groups(np.array([5, 5, 5, 5]), 2).tolist() == [0, 1, 0, 1]
    # 9 to group 0, both 4s to group 1 (4 < 9), then 1 to group 1 (8 < 9)
    assert corpora.domain_groups(np.array([1, 9, 4, 4]), 2).tolist() == [1, 0, 1, 1]


# --------------------------------------------------------------------------- partitions


def _meta(counts, context: int = 4) -> corpora.TextMeta:
    """A corpus whose domain k has counts[k] windows (domain ids interleaved, as no loader would: the partition
    must not depend on contiguity)."""
    ids = np.concatenate([np.full(c, k, dtype=np.int64) for k, c in enumerate(counts)])
    ids = ids[np.random.default_rng(1).permutation(len(ids))]
    return corpora.TextMeta(tuple(f"d{k}" for k in range(len(counts))), ids,
                            np.array(counts, dtype=np.int64) * context, 1.0, "test")


@pytest.mark.parametrize("world", [1, 3, 8])
def test_iid_covers_every_window_exactly_once(world):
    meta = _meta([30, 7, 12, 1])
    shards = corpora.partition(meta, world, "iid", groups=1)
    assert len(shards) == world and all(s.group is None for s in shards)
    every = np.concatenate([s.indices for s in shards])
    assert len(every) == 50 and np.array_equal(np.sort(every), np.arange(50))
    sizes = [len(s.indices) for s in shards]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("world, groups", [(4, 2), (6, 3), (5, 2), (8, 4), (4, 1), (3, 3)])
def test_by_domain_gives_each_domain_to_one_group(world, groups):
    meta = _meta([40, 25, 20, 11, 9, 30])
    shards = corpora.partition(meta, world, "by_domain", groups)
    every = np.concatenate([s.indices for s in shards])
    assert np.array_equal(np.sort(every), np.arange(len(meta.window_domain)))  # disjoint and complete
    for r, s in enumerate(shards):
        assert s.group == data.group_of_rank(r, world, groups)
    for d in range(len(meta.domains)):
        holders = {shards[r].group for r in range(world) if np.any(meta.window_domain[shards[r].indices] == d)}
        assert len(holders) == 1, (d, holders)
    assert corpora.partition(meta, world, "by_domain", groups)[0].indices.tolist() == shards[0].indices.tolist()
    record = corpora.describe_domains(meta, shards, groups)
    assert np.sum(record["shard_domains"], axis=0).tolist() == [40, 25, 20, 11, 9, 30]


def test_partition_refusals_name_the_key():
    meta = _meta([10, 10, 10])
    with pytest.raises(DataError, match=r"data\.groups=4 exceeds .* 3 domains \(d0, d1, d2\)"):
        corpora.partition(meta, 4, "by_domain", 4)
    with pytest.raises(DataError, match=r"data\.groups=3 exceeds the world size 2"):
        corpora.partition(meta, 2, "by_domain", 3)
    with pytest.raises(DataError, match=r"30 training windows, fewer than the 31 replicas; lower data\.lm\.context"):
        corpora.partition(meta, 31, "iid", 1)
    with pytest.raises(DataError, match=r"data\.partition='dirichlet'"):
        corpora.partition(meta, 2, "dirichlet", 1)
    # a group of more ranks than its domains have windows: some rank would train on nothing
    with pytest.raises(DataError, match=r"rank \d gets no window .*data\.groups"):
        corpora.partition(_meta([40, 1]), 4, "by_domain", 2)


# --------------------------------------------------------------------------- the text loader


def _held_out_name(want: bool, fraction: float, domain: str, start: int = 0) -> str:
    for i in itertools.count(start):
        rel = f"{domain}/f{i}.txt"
        if corpora.is_held_out(rel, fraction) == want:
            return rel
    raise AssertionError  # pragma: no cover


def _tree(root, sizes, fraction: float = 0.3, held_size: int = 300):
    """Under root: per domain (a directory, or '' for the top) a training file of the given size whose bytes
    name the domain, and one held-out file per domain; hidden files besides. Returns {domain: training bytes}.
    (The held-out files must hold half the requested share of the bytes, or the split tops them up.)"""
    out = {}
    for k, (domain, size) in enumerate(sizes.items()):
        rel = _held_out_name(False, fraction, domain) if domain else "top_train.txt"
        assert not corpora.is_held_out(rel, fraction)
        blob = bytes((k * 50 + i % 40) for i in range(size))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(blob)
        out[domain or corpora.TOP] = blob
        held = _held_out_name(True, fraction, domain or "heldtop")
        (root / held).parent.mkdir(parents=True, exist_ok=True)
        (root / held).write_bytes(b"H" * held_size)
    (root / ".secret").write_bytes(b"\xff" * 5000)
    (root / ".git").mkdir()
    (root / ".git" / "objects").write_bytes(b"\xff" * 5000)
    return out


def test_the_text_loader_reads_domains_splits_and_windows(tmp_path):
    train = _tree(tmp_path, {"a": 3001, "b": 1001, "": 201})
    ds = corpora.load_text(str(tmp_path), 10, 0.3, None, None)
    meta = ds.text
    assert ds.sequence and ds.n_classes == 256 and ds.name == "text"
    assert meta.domains == ("(top)", "a", "b") and meta.bytes_per_token == 1.0
    assert meta.domain_bytes.tolist() == [200, 3000, 1000]
    assert ds.x_train.dtype == np.uint8 and ds.x_train.shape == ds.y_train.shape == (420, 10)
    for k, d in enumerate(meta.domains):  # each domain's windows are its training file, in order
        x, y = ds.x_train[meta.window_domain == k], ds.y_train[meta.window_domain == k]
        assert x.reshape(-1).tobytes() == train[d][: x.size] and y.reshape(-1).tobytes() == train[d][1: x.size + 1]
    # the test split is the held-out files only, nothing hidden
    assert set(ds.x_test.reshape(-1).tolist()) == {ord("H")} and len(ds.x_test) == (3 * 300 - 1) // 10
    assert 255 not in ds.x_train
    few = corpora.load_text(str(tmp_path), 10, 0.3, None, 7)
    assert len(few.x_test) == 7 and np.array_equal(few.x_test, ds.x_test[corpora.spaced(len(ds.x_test), 7)])


def test_max_bytes_cuts_each_domain_to_its_share(tmp_path):
    _tree(tmp_path, {"a": 3000, "b": 1000}, held_size=1000)
    ds = corpora.load_text(str(tmp_path), 10, 0.3, 2000, None)
    # a keeps 3000 x 2000 / 4000 = 1500 bytes, b 500: 149 and 49 windows of 10 (one byte for the last target)
    assert ds.text.domain_bytes.tolist() == [1490, 490]
    # big keeps int(20000 x 1024 / 20040) = 1021 bytes: 102 windows; tiny's share (2 bytes) is under one window, and
    # it keeps one (context + 1 bytes): no domain vanishes
    _tree(tmp_path / "small", {"big": 20_000, "tiny": 40}, held_size=2000)
    small = corpora.load_text(str(tmp_path / "small"), 10, 0.3, 1024, None)
    assert small.text.domains == ("big", "tiny") and small.text.domain_bytes.tolist() == [1020, 10]


def test_text_loader_refusals_name_the_key(tmp_path):
    with pytest.raises(DataError, match=r"data\.dataset='text' reads from data\.root, which is not set"):
        corpora.load_text(None, 10, 0.3, None, None)
    with pytest.raises(DataError, match=r"data\.root=.*is not a directory"):
        corpora.load_text(str(tmp_path / "nope"), 10, 0.3, None, None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data\.root=.*no file to read"):
        corpora.load_text(str(tmp_path / "empty"), 10, 0.3, None, None)
    _tree(tmp_path / "t", {"a": 100})
    with pytest.raises(DataError, match=r"no training window of data\.lm\.context=200"):
        corpora.load_text(str(tmp_path / "t"), 200, 0.3, None, None)
    only_train = tmp_path / "o"
    only_train.mkdir()
    (only_train / _held_out_name(False, 0.3, "a").replace("/", "_")).write_bytes(b"x" * 500)
    assert not any(corpora.is_held_out(p, 0.3) for p in corpora.list_files(str(only_train)))
    with pytest.raises(DataError, match=r"no held-out window .*data\.test_fraction=0\.3"):
        corpora.load_text(str(only_train), 10, 0.3, None, None)


def _named(at_least: float, count: int):
    """``count`` file names whose path hash is at least ``at_least`` (none held out by the hash alone below it)."""
    names = (f"doc{i:03d}.txt" for i in itertools.count())
    return list(itertools.islice((n for n in names if corpora.path_hash(n) >= at_least), count))


def test_a_small_corpus_holds_out_near_the_requested_share_of_bytes(tmp_path):
    """17 plain-text files, 300 KB in all, at data.test_fraction 0.1: none falls under the hash, so the files with
    the lowest hashes are held out until they hold 10% of the bytes."""
    rng = np.random.default_rng(0)
    names = _named(0.1, 17)
    sizes = rng.integers(12_000, 24_000, size=17)
    sizes = (sizes * 300_000 / sizes.sum()).astype(int)
    for name, size in zip(names, sizes):
        (tmp_path / name).write_bytes(bytes(rng.integers(97, 123, size=int(size), dtype=np.uint8)))
    assert not any(corpora.is_held_out(n, 0.1) for n in names)  # the hash alone: nothing held out
    ds = corpora.load_text(str(tmp_path), 64, 0.1, None, None)
    held = corpora.held_out_files(names, sizes.tolist(), 0.1)
    share = sizes[held].sum() / sizes.sum()
    assert 0.1 <= share < 0.1 + sizes.max() / sizes.sum()  # reached, by at most one file more
    by_hash = sorted(names, key=corpora.path_hash)
    assert [n for n, h in zip(names, held) if h] == sorted(by_hash[: sum(held)])  # the lowest hashes
    assert len(ds.x_test) == (sizes[held].sum() - 1) // 64 > 0
    assert f"{sum(held)} of 17 files held out" in ds.text.source and "data.test_fraction=0.1" in ds.text.source


def test_a_large_corpus_keeps_the_hash_rule_and_adding_files_moves_none():
    names = [f"pkg{i % 7}/m{i}.py" for i in range(400)]
    sizes = [1000 + 37 * (i % 11) for i in range(400)]
    held = corpora.held_out_files(names, sizes, 0.1)
    assert held == [corpora.is_held_out(n, 0.1) for n in names]  # near 10% already: nothing topped up
    more = corpora.held_out_files(names + ["pkg9/new.py"], sizes + [5000], 0.1)
    assert more[:-1] == held


def test_no_held_out_window_says_what_to_do(tmp_path):
    names = _named(0.9, 4)  # no hash under 0.9 either: the split is by the next-lowest hashes
    first, *rest = sorted(names, key=corpora.path_hash)
    (tmp_path / first).write_bytes(b"a" * 10)  # the lowest hash: held out, and too short for a window of 64
    for name in rest:
        (tmp_path / name).write_bytes(b"b" * 1000)
    with pytest.raises(DataError) as err:
        corpora.load_text(str(tmp_path), 64, 0.001, None, None)
    text = str(err.value)
    assert "no held-out window of data.lm.context=64 bytes at data.test_fraction=0.001" in text
    fraction = float(re.search(r"raise data\.test_fraction to ([0-9.]+)", text).group(1))
    assert len(corpora.load_text(str(tmp_path), 64, fraction, None, None).x_test) > 0  # the advice works
    one = tmp_path / "one"
    one.mkdir()
    (one / "only.txt").write_bytes(b"c" * 5000)  # one file stays for training: nothing can be held out
    with pytest.raises(DataError, match="split the text into more files"):
        corpora.load_text(str(one), 64, 0.1, None, None)


# --------------------------------------------------------------------------- the tokens loader


def _token_files(root, train, val):
    root.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype=np.uint16).tofile(root / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(root / "val.bin")


def test_the_tokens_loader_maps_the_files(tmp_path):
    train = np.random.default_rng(0).integers(0, 300, size=1001)
    train[500] = 4000  # the largest id
    _token_files(tmp_path, train, np.arange(161) % 50)
    ds = corpora.load_tokens(str(tmp_path), 16, None, None, None)
    assert ds.n_classes == 4001 and ds.sequence and ds.text.domains == ("tokens",)
    assert ds.text.bytes_per_token is None
    for a in (ds.x_train, ds.y_train):  # views of the file, not loaded
        assert isinstance(a, np.memmap) and not a.flags.owndata and a.dtype == np.uint16
    assert ds.x_train.shape == (62, 16) and ds.x_test.shape == (10, 16)
    assert np.array_equal(ds.x_train.reshape(-1), train[:992]) and np.array_equal(ds.y_train.reshape(-1),
                                                                                  train[1:993])
    rows = data.rows(ds.x_train, [3, 0, 61])
    assert rows.dtype == torch.int32 and rows.shape == (3, 16)
    assert rows.tolist() == ds.x_train[[3, 0, 61]].astype(np.int64).tolist()
    assert data.rows(ds.y_train, slice(0, 2)).dtype == torch.int32
    assert data.rows(np.zeros((2, 3), dtype=np.uint8), [1]).dtype == torch.uint8  # bytes stay bytes
    given = corpora.load_tokens(str(tmp_path), 16, 5000, 3.5, 4)
    assert given.n_classes == 5000 and given.text.bytes_per_token == 3.5 and len(given.x_test) == 4


def test_tokens_loader_refusals_name_the_key(tmp_path):
    _token_files(tmp_path, np.arange(100) % 7, np.arange(40))
    with pytest.raises(DataError, match=r"data\.lm\.vocab=39, but the token files hold id 39"):
        corpora.load_tokens(str(tmp_path), 8, 39, None, None)
    corpora.load_tokens(str(tmp_path), 8, 40, None, None)
    with pytest.raises(DataError, match=r"data\.lm\.context=64"):
        corpora.load_tokens(str(tmp_path), 64, None, None, None)
    (tmp_path / "val.bin").unlink()
    with pytest.raises(DataError, match=r"data\.root=.*needs val\.bin"):
        corpora.load_tokens(str(tmp_path), 8, None, None, None)
    (tmp_path / "val.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd number of bytes"):
        corpora.load_tokens(str(tmp_path), 8, None, None, None)


def test_the_fingerprint_of_a_token_file_is_sampled(tmp_path):
    """A file of 3 M tokens: the digest reads 64 blocks of 32 K tokens of each array. One token changed inside a
    sampled block changes it; one changed between the blocks does not (it is not read: the cost is the blocks',
    whatever the file's size)."""
    n, block = 3_000_001, 1 << 15
    tokens = np.random.default_rng(0).integers(0, 50_000, size=n).astype(np.uint16)
    _token_files(tmp_path, tokens, np.arange(1000))

    def digest():
        return data.fingerprint(corpora.load_tokens(str(tmp_path), 100, 65_536, None, None))

    class Counted:
        fed = 0

        def update(self, b: bytes) -> None:
            self.fed += len(b)

    counted = Counted()
    corpora.sampled_digest(counted, corpora.load_tokens(str(tmp_path), 100, 65_536, None, None).x_train)
    assert counted.fed <= 64 * block * 2 + 100  # 64 blocks (4 MiB) and the shape, whatever the file's size
    assert counted.fed < (tmp_path / "train.bin").stat().st_size
    base_train, base_test = digest()
    starts = corpora.spaced(max((n - 1) - block, 1), 64)  # x_train's sampled blocks (its first n - 1 tokens)
    # x_train[i] is token i, y_train[i] token i + 1: a token read by neither digest lies after a block's end in
    # both; the gap between the first two blocks holds such tokens
    unread = int(starts[0] + block + 1)
    assert unread + 1 < starts[1]
    for where, changes in ((unread, False), (int(starts[1]) + 5, True), (int(starts[-1]), True)):
        changed = tokens.copy()
        changed[where] ^= 1
        changed.tofile(tmp_path / "train.bin")
        train_fp, test_fp = digest()
        assert (train_fp != base_train) == changes and test_fp == base_test, where
    tokens.tofile(tmp_path / "train.bin")
    assert digest() == (base_train, base_test)


def test_a_byte_corpus_fingerprint_reads_every_byte(tmp_path):
    _tree(tmp_path, {"a": 3000, "b": 1000})
    before = data.fingerprint(corpora.load_text(str(tmp_path), 10, 0.3, None, None))
    path = tmp_path / _held_out_name(False, 0.3, "a")
    blob = bytearray(path.read_bytes())
    blob[1234] ^= 1
    path.write_bytes(bytes(blob))
    after = data.fingerprint(corpora.load_text(str(tmp_path), 10, 0.3, None, None))
    assert after[0] != before[0] and after[1] == before[1]


# --------------------------------------------------------------------------- config refusals

LM = """
name: lm
data:
  dataset: pystdlib
  partition: by_domain
  groups: 2
  lm: {context: 32, max_bytes: 200000}
model:
  name: gpt
  gpt: {layers: 1, heads: 1, embed: 16}
train: {optimizer: adamw, lr: 0.01, unit: steps, steps_per_unit: 3, budget: 6, schedule: cosine, warmup: 0.1}
"""


@pytest.fixture
def lm_config(tmp_path):
    path = tmp_path / "lm.yaml"
    path.write_text(LM)
    return path


def test_the_language_model_config_validates(lm_config, tmp_path):
    cfg = config.load(lm_config)
    assert cfg.model.name == "gpt" and cfg.data.lm.context == 32 and cfg.train.schedule == "cosine"
    config.load(lm_config, ["data.dataset=text", f"data.root={tmp_path}"])
    config.load(lm_config, ["data.dataset=tokens", f"data.root={tmp_path}", "data.lm.vocab=300",
                            "data.lm.bytes_per_token=4.2", "data.partition=iid"])


@pytest.mark.parametrize("overrides, keys", [
    (["data.dataset=digits", "data.partition=iid"], ["model.name='gpt'", "data.dataset"]),
    (["model.name=mlp"], ["data.dataset='pystdlib'", "model.name='mlp'"]),
    (["model.name=cnn1d"], ["model.name='cnn1d'"]),
    (["data.partition=label_groups"], ["data.partition='label_groups'", "data.dataset='pystdlib'"]),
    (["data.partition=dirichlet"], ["data.partition='dirichlet'"]),
    (["data.dataset=digits", "model.name=mlp"], ["data.partition='by_domain'", "'digits'"]),
    (["data.dataset=text"], ["data.dataset='text'", "data.root"]),
    (["data.dataset=tokens"], ["data.dataset='tokens'", "data.root"]),
    (["examples.track=true"], ["data.dataset='pystdlib'", "examples.track"]),
    (["train.vectorize=on"], ["data.dataset='pystdlib'", "train.vectorize=on"]),
    (["privacy.enabled=true"], ["privacy.enabled"]),
    (["signature.kind=logits"], ["signature.kind='logits'"]),
    (["data.shift=rotation"], ["data.shift='rotation'"]),
    (["data.lm.vocab=300"], ["data.lm.vocab", "data.dataset='pystdlib'"]),
    (["model.gpt.embed=10", "model.gpt.heads=3"], ["model.gpt.embed=10", "model.gpt.heads=3"]),
    (["train.schedule=linear"], ["train.schedule"]),
    (["train.warmup=1.0"], ["train.warmup"]),
    (["data.lm.context=1"], ["data.lm.context"]),
    (["data.dataset=tokens", "data.root=."], ["data.partition='by_domain'", "data.dataset='tokens'"]),
])
def test_language_model_refusals_name_the_key(lm_config, overrides, keys):
    with pytest.raises(ConfigError) as exc:
        config.load(lm_config, overrides)
    for key in keys:
        assert key in str(exc.value), (key, str(exc.value))


def test_the_tokens_dataset_loads_through_the_config(tmp_path, lm_config):
    _token_files(tmp_path / "tok", np.arange(1000) % 97, np.arange(300) % 97)
    cfg = config.load(lm_config, ["data.dataset=tokens", f"data.root={tmp_path / 'tok'}", "data.partition=iid",
                                  "data.lm.test_windows=3"])
    ds = data.load(cfg.data, cfg.seed)
    assert ds.sequence and ds.n_classes == 97 and ds.x_train.dtype == np.uint16 and ds.x_test.shape == (3, 32)
    prepared = data.arrange(ds, cfg.data, cfg.seed, 4)
    assert sorted(np.concatenate([s.indices for s in prepared.shards]).tolist()) == list(range(len(ds.x_train)))
    with pytest.raises(DataError, match=r"data\.lm\.vocab=50"):
        data.load(config.load(lm_config, ["data.dataset=tokens", f"data.root={tmp_path / 'tok'}",
                                          "data.partition=iid", "data.lm.vocab=50"]).data, cfg.seed)


def test_a_resume_may_not_move_the_lr_schedule(lm_config):
    """train.budget may change on a resume, except under a schedule, which runs over the budget."""
    saved = config.load(lm_config).model_dump()
    longer = config.load(lm_config, ["train.budget=12"]).model_dump()
    assert any(d.startswith("train.budget") and "schedule" in d for d in config.differences(saved, longer))
    flat = config.load(lm_config, ["train.schedule=constant", "train.warmup=0"]).model_dump()
    flat_longer = config.load(lm_config, ["train.schedule=constant", "train.warmup=0", "train.budget=12"]).model_dump()
    assert config.differences(flat, flat_longer) == []
