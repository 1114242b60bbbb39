"""Datasets and partitions.

Every rank loads the same dataset and computes the same partition from the same
seed; it then keeps its own shard. The train/test split is shared.

Datasets: ``digits`` (bundled with scikit-learn), ``mnist1d`` (generated locally),
``synthetic`` (a Gaussian mixture), or a user's ``module:function`` (docs/guides/own-model-and-data.md)
returning ``(x_train, y_train, x_test, y_test)`` (numpy arrays or torch tensors),
``(train_set, test_set)`` (torch ``Dataset``s of ``(x, y)`` pairs, read once into
arrays), or a dict with the four arrays (or ``train``/``test``) and, to declare
which ranks belong together (for the ARI of the communities against them),
``groups`` (one id per rank) or ``example_groups`` (one id per training example;
a rank's group is the most common one in its shard). The function gets only the
keywords it accepts of ``seed``, ``root`` (``data.root``), ``rank`` and
``world_size``; one that takes ``rank`` or ``world_size`` is a *sharded reader*:
it returns this rank's own training shard, and no partition is applied.
Partitions: ``iid``, ``dirichlet`` (alpha), ``label_groups`` (planted groups of
ranks with disjoint label sets, ``purity`` of each shard from its group's labels).
``arrange`` is what every rank (and ``communities export``, through ``prepare``) does
with the loaded dataset: partition, the concept shift of planted groups (``data.shift``,
shift.py) and the local test split each rank holds out of its own shard
(``data.local_test_fraction``). The ranks compare fingerprints of the data as loaded
(before the shift: a pure function of them, the config and the seed).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..errors import DataError
from . import plugins, stratified_split
from . import shift as concept_shift
from . import text as corpora
from .dataset import Dataset, Shard, TextMeta, group_of_rank

# --------------------------------------------------------------------------- datasets


def _split(x, y, test_fraction, seed):
    return stratified_split.train_test_split(x, y, test_fraction, seed)


def _digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (features, labels), read from the file its wheel ships without importing it (1.3 s
    of a rank's start-up: ``stratified_split``); scikit-learn's own loader where the file is not there."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")  # finds the package without running its __init__
    where = list(spec.submodule_search_locations or []) if spec is not None else []
    path = os.path.join(where[0], "datasets", "data", "digits.csv.gz") if where else ""
    if path and os.path.isfile(path):
        with gzip.open(path, mode="rt", encoding="utf-8") as fh:
            table = np.loadtxt(fh, delimiter=",")
        return table[:, :-1], table[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    return d.data, d.target


def load_digits(test_fraction: float, seed: int) -> Dataset:
    features, labels = _digits_arrays()
    xtr, xte, ytr, yte = _split(features.astype(np.float32), labels.astype(np.int64), test_fraction, seed)
    return Dataset(xtr, ytr, xte, yte, "digits")


MNIST1D_MAX_SAMPLES = 640_000  # 512,000 training examples: 500 per replica at N = 1,024, as quickstart's 8 ranks get


def load_mnist1d(seed: int, samples: Optional[int] = None, root: Optional[str] = None) -> Dataset:
    """MNIST-1D from its generator (by default 5,000 samples: 4000 train / 1000 test, 40 features).

    ``samples`` is the generator's ``num_samples`` (train + test, split 80/20; None: its
    default). With ``root`` (``data.root``) the generated arrays are cached there, so one
    process of one run generates them and every other rank and later run reads them:
    the generator is sequential: 50 s of one core for 200,000 samples (390 MiB at its peak).
    ``make_dataset`` reseeds numpy's global state; callers seed after this.
    """
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise DataError("data.dataset='mnist1d' needs the mnist1d package: "
                        "pip install 'communities[mnist1d]'") from None
    args = get_dataset_args()
    if samples is not None:
        args.num_samples = int(samples)

    def generate() -> Tuple[np.ndarray, ...]:
        d = make_dataset(args)
        return (d["x"].astype(np.float32), d["y"].astype(np.int64),
                d["x_test"].astype(np.float32), d["y_test"].astype(np.int64))

    x, y, x_test, y_test = generate() if root is None else _cached(root, "mnist1d", _generator_key(args), generate)
    return Dataset(x, y, x_test, y_test, "mnist1d")


def _generator_key(args) -> str:
    """The generator's arguments (its seed among them) and the package's version, as a short digest."""
    import json
    from importlib import metadata

    try:
        version = metadata.version("mnist1d")
    except metadata.PackageNotFoundError:  # pragma: no cover - installed without metadata
        version = "?"
    spec = {k: v for k, v in sorted(vars(args).items()) if k != "url"}
    text = json.dumps({"mnist1d": version, **spec}, sort_keys=True, default=str)
    return f"{args.num_samples}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _cached(root: str, name: str, key: str, generate) -> Tuple[np.ndarray, ...]:
    """``ARRAY_KEYS`` arrays read from ``root/name-key.npz``, generated and written there (atomically) if absent.

    An exclusive ``flock`` on a lock file beside it makes the ranks of a run (and runs
    side by side) wait for the one that generates instead of each generating it.
    """
    import fcntl
    import secrets

    root = os.path.abspath(os.path.expanduser(root))
    path = os.path.join(root, f"{name}-{key}.npz")
    if os.path.exists(path):
        return _read_cache(path)
    try:
        os.makedirs(root, exist_ok=True)
        lock = open(os.path.join(root, f".{name}-{key}.lock"), "a")
    except OSError as exc:
        raise DataError(f"data.root={root!r} is not writable ({exc.strerror}): data.dataset={name!r} caches its "
                        f"generated set there ({os.path.basename(path)}); choose a writable directory") from None
    with lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        except OSError:  # a filesystem without flock: the atomic write below still keeps the file whole
            pass
        if os.path.exists(path):  # another process generated it while this one waited
            return _read_cache(path)
        arrays = generate()
        try:
            # a cache a team may share: the mode open() gives (0666 less the umask), not mkstemp's 0600
            tmp = os.path.join(root, f".{name}-{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                with os.fdopen(fd, "wb") as fh:
                    np.savez(fh, **dict(zip(ARRAY_KEYS, arrays)))
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as exc:
            raise DataError(f"data.root={root!r} is not writable ({exc.strerror}): data.dataset={name!r} caches its "
                            f"generated set there ({os.path.basename(path)}); choose a writable directory") from None
    return arrays


def _read_cache(path: str) -> Tuple[np.ndarray, ...]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return tuple(z[k] for k in ARRAY_KEYS)
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"the cached dataset {path!r} cannot be read ({exc}); delete it to generate it again") from None


def load_synthetic(cfg, test_fraction: float, seed: int) -> Dataset:
    """A Gaussian mixture: one cluster of ``n_features`` dims per class, ``class_sep`` apart."""
    rng = np.random.default_rng([seed, 17])
    n, f, c = cfg.n_samples, cfg.n_features, cfg.n_classes
    centers = rng.normal(size=(c, f))
    centers *= cfg.class_sep / np.maximum(np.linalg.norm(centers, axis=1, keepdims=True), 1e-12) * np.sqrt(f) / 2
    y = rng.integers(0, c, size=n)
    x = centers[y] + cfg.noise * rng.normal(size=(n, f))
    xtr, xte, ytr, yte = _split(x.astype(np.float32), y.astype(np.int64), test_fraction, seed)
    return Dataset(xtr, ytr, xte, yte, "synthetic")


SHARDED_KEYWORDS = ("rank", "world_size")  # a function that takes either reads its own shard
ARRAY_KEYS = ("x_train", "y_train", "x_test", "y_test")
GROUP_KEYS = ("groups", "example_groups")


def load_user(spec: str, seed: int = 0, root: Optional[str] = None, rank: int = 0, world_size: int = 1) -> Dataset:
    """The dataset a user's ``module:function`` returns, called with the keywords it accepts."""
    key = "data.dataset"
    fn = plugins.resolve(spec, key, DataError)
    offered = {"seed": seed, "root": root, "rank": rank, "world_size": world_size}
    kwargs = plugins.keywords(fn, offered, spec, key, plugins.DATASET_SIGNATURE, error=DataError)
    sharded = plugins.names_any(fn, SHARDED_KEYWORDS)
    out = plugins.call(fn, kwargs, spec, key, DataError)
    declared = {}
    if isinstance(out, dict):
        sets = "train" in out or "test" in out
        names = ("train", "test") if sets else ARRAY_KEYS
        extra = sorted(set(out) - set(names) - set(GROUP_KEYS))
        missing = [k for k in names if k not in out]
        if extra or missing:
            raise DataError(f"data.dataset={spec!r} returned a dict " + (f"without {missing}" if missing else
                            f"with unknown key(s) {extra}") + "; keys: x_train, y_train, x_test, y_test (or train "
                            "and test, two torch Datasets), and optionally groups (one per rank) or example_groups "
                            "(one per training example)")
        if "groups" in out and "example_groups" in out:
            raise DataError(f"data.dataset={spec!r}: declare groups (per rank) or example_groups, not both")
        declared = {k: _int_vector(spec, k, out[k]) for k in GROUP_KEYS if k in out}
        out = tuple(out[k] for k in names)
    if isinstance(out, (tuple, list)) and len(out) == 2:
        halves = (("the training set", out[0]), ("the test set", out[1]))
        for which, dataset in halves:
            _check_set(spec, which, dataset)
        out = sum((_read_set(spec, which, dataset) for which, dataset in halves), ())
    if not isinstance(out, (tuple, list)) or len(out) != 4:
        raise DataError(f"data.dataset={spec!r} must return (x_train, y_train, x_test, y_test), (train_set, "
                        f"test_set) or a dict with those keys, got {_kind(out)}")
    arrays = []
    for name, a in zip(ARRAY_KEYS, out):
        try:
            arr = np.asarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a)
        except Exception as exc:
            raise DataError(f"data.dataset={spec!r}: {name} is not an array ({type(exc).__name__}: {exc})") from None
        # strings or objects would fail in astype with numpy's message, or (bytes) turn into garbage numbers
        if arr.dtype.kind not in "biuf":
            raise DataError(f"data.dataset={spec!r}: {name} holds {arr.dtype} values ({arr.dtype.kind!r}); "
                            "features and labels must be numbers")
        arrays.append(arr)
    xtr, ytr, xte, yte = arrays
    for name, y in (("y_train", ytr), ("y_test", yte)):
        if y.dtype.kind == "f" and not (np.isfinite(y).all() and np.array_equal(y, np.round(y))):
            raise DataError(f"data.dataset={spec!r}: {name} holds non-integer labels; labels are class indices")
    ds = validate(Dataset(xtr.astype(np.float32), ytr.astype(np.int64), xte.astype(np.float32),
                          yte.astype(np.int64), spec, declared.get("groups"), declared.get("example_groups"),
                          sharded=sharded))
    if ds.example_groups is not None and len(ds.example_groups) != len(ds.y_train):
        raise DataError(f"data.dataset={spec!r}: example_groups has {len(ds.example_groups)} entries for "
                        f"{len(ds.y_train)} training examples")
    return ds


def _kind(value) -> str:
    return f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else type(value).__name__


def _check_set(spec: str, which: str, dataset) -> None:
    from torch.utils.data import Dataset as TorchDataset

    if not isinstance(dataset, TorchDataset):
        raise DataError(f"data.dataset={spec!r} returned two values, but {which} is {_kind(dataset)}, not a torch "
                        "Dataset; return (x_train, y_train, x_test, y_test) or (train_set, test_set)")


def _read_set(spec: str, which: str, dataset) -> Tuple[np.ndarray, np.ndarray]:
    """A torch ``Dataset`` of ``(x, y)`` pairs read once into two arrays (features, labels)."""
    from torch.utils.data import DataLoader

    xs, ys = [], []
    try:
        for batch in DataLoader(dataset, batch_size=1024, shuffle=False):
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise TypeError(f"an item is {_kind(batch)}, not an (x, y) pair")
            xs.append(np.asarray(batch[0]))
            ys.append(np.asarray(batch[1]))
    except Exception as exc:
        raise DataError(f"data.dataset={spec!r}: reading {which} failed ({type(exc).__name__}: {exc}); its items "
                        "must be (features, label) pairs of tensors, arrays or numbers (a torchvision dataset "
                        "needs transform=ToTensor())") from None
    if not xs:
        raise DataError(f"data.dataset={spec!r}: {which} is empty")
    return np.concatenate(xs), np.concatenate(ys)


def _int_vector(spec: str, key: str, value) -> np.ndarray:
    arr = np.asarray(value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value)
    if arr.ndim != 1 or arr.dtype.kind not in "iub" or arr.size == 0:
        raise DataError(f"data.dataset={spec!r}: {key} must be a non-empty 1-D sequence of integer ids, "
                        f"got shape {arr.shape} {arr.dtype}")
    return arr.astype(np.int64)


def declared_groups(ds: Dataset, shards: List[Shard]) -> Optional[List[int]]:
    """The group of every rank that a user dataset declared (per rank, or per example: a shard's most common)."""
    if ds.rank_groups is not None:
        if len(ds.rank_groups) != len(shards):
            raise DataError(f"data.dataset={ds.name!r}: groups has {len(ds.rank_groups)} entries for "
                            f"{len(shards)} ranks (one per rank)")
        return [int(g) for g in ds.rank_groups]
    if ds.example_groups is not None:
        out = []
        for s in shards:
            ids, counts = np.unique(ds.example_groups[s.indices], return_counts=True)
            out.append(int(ids[np.argmax(counts)]) if ids.size else -1)
        return out
    return None


def validate(ds: Dataset) -> Dataset:
    """Shapes and labels a classifier can train on; raises DataError naming the dataset."""
    where = f"data.dataset={ds.name!r}"
    if ds.sequence:
        if ds.y_train.shape != ds.x_train.shape or ds.y_test.shape != ds.x_test.shape or ds.x_train.ndim != 2:
            raise DataError(f"{where}: token windows and their next tokens must share one shape (n, context)")
        return ds
    if ds.x_train.ndim < 2 or ds.x_test.ndim < 2:
        raise DataError(f"{where}: x_train and x_test need shape (n, features...), "
                        f"got {ds.x_train.shape} and {ds.x_test.shape}")
    if ds.y_train.ndim != 1 or ds.y_test.ndim != 1:
        raise DataError(f"{where}: y_train and y_test must be 1-D label vectors, "
                        f"got {ds.y_train.shape} and {ds.y_test.shape}")
    if len(ds.x_train) != len(ds.y_train) or len(ds.x_test) != len(ds.y_test):
        raise DataError(f"{where}: x and y lengths differ (train {len(ds.x_train)} vs {len(ds.y_train)}, "
                        f"test {len(ds.x_test)} vs {len(ds.y_test)})")
    if ds.x_train.shape[1:] != ds.x_test.shape[1:]:
        raise DataError(f"{where}: train features {ds.x_train.shape[1:]} differ from test features "
                        f"{ds.x_test.shape[1:]}")
    if len(ds.y_train) == 0 or len(ds.y_test) == 0:
        raise DataError(f"{where}: empty train or test set")
    if min(ds.y_train.min(), ds.y_test.min()) < 0:
        raise DataError(f"{where}: labels must be integers >= 0")
    if not (np.isfinite(ds.x_train).all() and np.isfinite(ds.x_test).all()):
        raise DataError(f"{where}: features hold NaN or Inf")
    return ds


def load(cfg, seed: int, rank: int = 0, world_size: int = 1) -> Dataset:
    """The dataset named by ``cfg`` (a DataConfig), standardised with train statistics.

    A sharded reader's dataset is not standardised here: its statistics are the whole
    training set's, which no rank holds (``moments`` of every shard, summed over ranks).
    """
    if cfg.dataset == "digits":
        ds = load_digits(cfg.test_fraction, seed)
    elif cfg.dataset == "mnist1d":
        samples = cfg.samples
        if getattr(cfg, "samples_per_replica", None) is not None:  # weak scaling: the data grow with the world
            samples = -(-int(cfg.samples_per_replica) * int(world_size) * 5 // 4)
        ds = load_mnist1d(seed, samples, cfg.root)
    elif cfg.dataset == "synthetic":
        ds = load_synthetic(cfg.synthetic, cfg.test_fraction, seed)
    elif cfg.dataset == "pystdlib":
        ds = corpora.load_pystdlib(cfg.lm.context, cfg.test_fraction, cfg.lm.max_bytes, cfg.lm.test_windows)
    elif cfg.dataset == "text":
        ds = corpora.load_text(cfg.root, cfg.lm.context, cfg.test_fraction, cfg.lm.max_bytes, cfg.lm.test_windows)
    elif cfg.dataset == "tokens":
        ds = corpora.load_tokens(cfg.root, cfg.lm.context, cfg.lm.vocab, cfg.lm.bytes_per_token, cfg.lm.test_windows)
    else:
        root = None if cfg.root is None else os.path.abspath(os.path.expanduser(cfg.root))
        ds = load_user(cfg.dataset, seed, root, rank, world_size)
    ds = validate(ds)
    if cfg.standardize and not ds.sharded and not ds.sequence:  # token ids are not features to scale
        mu = ds.x_train.mean(axis=0, keepdims=True)
        sd = ds.x_train.std(axis=0, keepdims=True)
        standardize_(ds, mu, sd)
    return ds


def standardize_(ds: Dataset, mu: np.ndarray, sd: np.ndarray) -> None:
    """Features scaled to zero mean and unit variance by these per-feature statistics (constant features kept)."""
    sd[sd < 1e-6] = 1.0
    ds.x_train = ((ds.x_train - mu) / sd).astype(np.float32)
    ds.x_test = ((ds.x_test - mu) / sd).astype(np.float32)


def moments(x: np.ndarray) -> np.ndarray:
    """``[n, sum of x per feature..., sum of x**2 per feature...]`` in float64: summed over shards, the whole set's."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    return np.concatenate([[len(x)], flat.sum(axis=0), np.square(flat).sum(axis=0)])


def standardize_by_moments_(ds: Dataset, total: np.ndarray) -> None:
    """``standardize_`` with statistics from ``moments`` summed over every shard."""
    n, f = total[0], (len(total) - 1) // 2
    mu = total[1: 1 + f] / n
    sd = np.sqrt(np.maximum(total[1 + f:] / n - mu * mu, 0.0))
    shape = (1,) + ds.x_train.shape[1:]
    standardize_(ds, mu.reshape(shape), sd.reshape(shape))


def fingerprint(ds: Dataset) -> Tuple[str, str]:
    """BLAKE2b digests (hex) of the training set and of the test split: ranks compare them at start-up."""
    out = []
    for arrays in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        h = hashlib.blake2b(digest_size=16)
        for a in arrays:
            if isinstance(a.base, np.memmap) or isinstance(a, np.memmap):  # a token file: sampled, never read whole
                corpora.sampled_digest(h, a)
                continue
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        out.append(h.hexdigest())
    return out[0], out[1]


def own_group(ds: Dataset, rank: int, world_size: int) -> Optional[int]:
    """A sharded reader's declared group for this rank (its groups entry, or its examples' most common)."""
    if ds.rank_groups is not None:
        if len(ds.rank_groups) != world_size:
            raise DataError(f"data.dataset={ds.name!r}: groups has {len(ds.rank_groups)} entries for "
                            f"{world_size} ranks (one per rank)")
        return int(ds.rank_groups[rank])
    if ds.example_groups is not None:
        ids, counts = np.unique(ds.example_groups, return_counts=True)
        return int(ids[np.argmax(counts)])
    return None


# --------------------------------------------------------------------------- partitions

SHARDED = "sharded"  # partition.json's partition of a sharded reader: each rank read its own shard


def partition(y: np.ndarray, world: int, kind: str, seed: int, alpha: float = 0.5, *, groups: int = 1,
              purity: float = 1.0) -> List[Shard]:
    """All N shards (disjoint index sets covering the training set). Same result on every rank."""
    y = np.asarray(y)
    n_classes = int(y.max()) + 1
    rng = np.random.default_rng([seed, 29])
    if kind == "iid":
        perm = rng.permutation(len(y))
        return [Shard(np.sort(p), None) for p in np.array_split(perm, world)]
    if kind == "dirichlet":
        owners: List[List[int]] = [[] for _ in range(world)]
        for c in range(n_classes):
            idx = rng.permutation(np.flatnonzero(y == c))
            share = rng.dirichlet(np.full(world, alpha))
            cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
            for r, part in enumerate(np.split(idx, cuts)):
                owners[r].extend(part.tolist())
        shards = [Shard(np.sort(np.array(o, dtype=np.int64)), None) for o in owners]
        return _ensure_nonempty(shards, rng)
    if kind == "label_groups":
        if groups > world:
            raise DataError(f"data.groups={groups} exceeds the world size {world}")
        if groups > n_classes:
            raise DataError(f"data.groups={groups} exceeds the number of classes {n_classes}")
        rank_group = np.array([group_of_rank(r, world, groups) for r in range(world)])
        owners = [[] for _ in range(world)]
        for c in range(n_classes):
            g = c % groups
            idx = rng.permutation(np.flatnonzero(y == c))
            n_own = int(round(purity * len(idx)))
            inside = np.flatnonzero(rank_group == g)
            outside = np.flatnonzero(rank_group != g)
            for member, part in zip(inside, np.array_split(idx[:n_own], len(inside))):
                owners[member].extend(part.tolist())
            if len(outside):
                for other, part in zip(outside, np.array_split(idx[n_own:], len(outside))):
                    owners[other].extend(part.tolist())
            else:
                owners[inside[0]].extend(idx[n_own:].tolist())
        shards = [Shard(np.sort(np.array(o, dtype=np.int64)), int(rank_group[r])) for r, o in enumerate(owners)]
        return _ensure_nonempty(shards, rng)
    raise DataError(f"data.partition={kind!r} is not one of iid, dirichlet, label_groups")


def _ensure_nonempty(shards: List[Shard], rng) -> List[Shard]:
    for s, shard in enumerate(shards):
        if shard.indices.size == 0:
            donor = max(range(len(shards)), key=lambda r: shards[r].indices.size)
            if shards[donor].indices.size < 2:
                raise DataError("too few training examples to give every rank a shard")
            take = shards[donor].indices[-1:]
            shards[donor] = Shard(shards[donor].indices[:-1], shards[donor].group)
            shards[s] = Shard(take, shard.group)
    return shards


def rows(a: np.ndarray, indices) -> torch.Tensor:
    """``a[indices]`` as a tensor: a memmapped token file reads those rows only; uint16 ids become int32 (torch
    computes little on uint16)."""
    out = np.asarray(a[indices if isinstance(indices, slice) else np.asarray(indices, dtype=np.int64)])
    return torch.from_numpy(out.astype(np.int32) if out.dtype == np.uint16 else np.ascontiguousarray(out))


def describe(shards: List[Shard], y: np.ndarray, kind: str, n_test: int,
             label_counts: Optional[List[List[int]]] = None, *, local_test_sizes: Optional[List[int]] = None,
             shift: str = "none", text: Optional[TextMeta] = None, n_groups: int = 0) -> dict:
    """The ``partition.json`` record (a sharded reader's: ``label_counts`` gathered from every rank; ``shift`` and
    ``local_test_sizes`` only when those are on; a text corpus's domains, its label counts left out: a vocabulary
    of counts per rank says little and weighs much)."""
    if text is not None:
        label_counts = [[] for _ in shards]
    elif label_counts is None:
        n_classes = int(np.max(y)) + 1
        label_counts = [np.bincount(y[s.indices], minlength=n_classes).tolist() for s in shards]
    groups = None if shards[0].group is None else np.array([s.group for s in shards], dtype=np.int64).tolist()
    sizes = [int(s.indices.size) for s in shards]
    out = {
        "partition": kind,
        "n_classes": len(label_counts[0]),
        "n_train": sum(sizes) if kind == SHARDED else int(len(y)),
        "n_test": int(n_test),
        "groups": groups,
        "shard_sizes": sizes,
        "label_counts": label_counts,
    }
    if shift != "none":
        out["shift"] = shift
    if local_test_sizes is not None and any(local_test_sizes):
        out["local_test_sizes"] = [int(n) for n in local_test_sizes]
    if text is not None:
        out.update(corpora.describe_domains(text, shards, n_groups if kind == "by_domain" else None))
    return out


# --------------------------------------------------------------------------- the pipeline


def hold_out(shards: List[Shard], fraction: float, seed: int) -> Tuple[List[Shard], List[np.ndarray]]:
    """(training shards, local test indices): each rank keeps ``fraction`` of its own shard apart, seeded per rank.

    ``fraction`` 0 returns the shards unchanged and empty test sets. Otherwise every
    rank holds out ``round(fraction * n)`` of its n examples, at least one, and
    keeps at least one to train on (``split_local``).
    """
    if fraction <= 0:
        return shards, [np.zeros(0, dtype=np.int64) for _ in shards]
    train, tests = [], []
    for r, s in enumerate(shards):
        kept, test = split_local(s.indices, fraction, seed, r)
        tests.append(test)
        train.append(Shard(kept, s.group))
    return train, tests


def split_local(indices: np.ndarray, fraction: float, seed: int, rank: int) -> Tuple[np.ndarray, np.ndarray]:
    """(training, local test) indices of rank ``rank``'s shard ``indices``: ``hold_out`` for one rank, which is all a
    sharded reader's rank can compute (it holds only its own shard)."""
    n = indices.size
    if fraction <= 0:
        return indices, np.zeros(0, dtype=np.int64)
    if n < 2:
        raise DataError(f"data.local_test_fraction={fraction}: rank {rank}'s shard holds {n} example(s), too few "
                        "to hold out a local test split and still train")
    k = min(max(int(round(fraction * n)), 1), n - 1)
    perm = np.random.default_rng([seed, 31, rank]).permutation(n)
    return np.sort(indices[perm[k:]]), np.sort(indices[perm[:k]])


@dataclass
class Prepared:
    """What every rank derives from the data config and the seed: the (shifted) dataset and all N shards."""

    dataset: Dataset
    shards: List[Shard]  # training indices (the local test split held out) and the group of each rank
    local_tests: List[np.ndarray]  # each rank's local test indices into dataset.x_train (empty: none)


def shifted(ds: Dataset, shards: List[Shard], kind: str, groups: int, seed: int) -> Dataset:
    """The dataset under ``data.shift``: each training example in its owner's group, the test split pooled."""
    owner = np.zeros(len(ds.y_train), dtype=np.int64)
    for s in shards:
        owner[s.indices] = int(s.group or 0)
    side = concept_shift.image_side(int(np.prod(ds.input_shape)), ds.name)
    n_classes = ds.n_classes
    xtr, ytr = concept_shift.apply(kind, ds.x_train, ds.y_train, owner, groups, seed=seed, n_classes=n_classes,
                                   side=side)
    pooled = concept_shift.pooled_test_groups(len(ds.y_test), groups, seed)
    xte, yte = concept_shift.apply(kind, ds.x_test, ds.y_test, pooled, groups, seed=seed, n_classes=n_classes,
                                   side=side)
    return Dataset(xtr, ytr, xte, yte, ds.name, ds.rank_groups, ds.example_groups)


def arrange(ds: Dataset, cfg, seed: int, world: int) -> Prepared:
    """A loaded dataset (not a sharded reader's) partitioned over ``world`` ranks by ``cfg`` (a DataConfig), the
    planted groups shifted, the local tests held out: what every rank computes alike, for all N ranks."""
    if ds.text is not None:
        shards = corpora.partition(ds.text, world, cfg.partition, cfg.groups)
        shards, local_tests = hold_out(shards, cfg.local_test_fraction, seed)
        return Prepared(ds, shards, local_tests)
    shards = partition(ds.y_train, world, cfg.partition, seed, cfg.alpha, groups=cfg.groups, purity=cfg.purity)
    declared = declared_groups(ds, shards)
    if declared is not None:  # the user's own notion of which ranks belong together
        shards = [Shard(s.indices, g) for s, g in zip(shards, declared)]
    if cfg.shift != "none":  # the groups are the contiguous blocks of data.groups, whatever the partition
        shards = [Shard(s.indices, group_of_rank(r, world, cfg.groups)) for r, s in enumerate(shards)]
        ds = shifted(ds, shards, cfg.shift, cfg.groups, seed)
    shards, local_tests = hold_out(shards, cfg.local_test_fraction, seed)
    return Prepared(ds, shards, local_tests)


def prepare(cfg, seed: int, world: int) -> Prepared:
    """Load ``cfg`` (a DataConfig) and ``arrange`` it over ``world`` ranks (``communities export``'s pipeline)."""
    ds = load(cfg, seed, 0, world)
    if ds.sharded:
        raise DataError(f"data.dataset={cfg.dataset!r} is a sharded reader (it takes rank or world_size): only each "
                        "rank holds its own shard, so every rank's data cannot be rebuilt in one process")
    return arrange(ds, cfg, seed, world)
