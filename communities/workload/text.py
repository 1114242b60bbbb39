"""Text corpora for the language-model workload: byte-level text from local files, or nanoGPT's token files.

Why bytes: no tokenizer to ship or download, a vocabulary of 256, and bits per byte
that compare across corpora. Three sources:

- ``pystdlib``: the running interpreter's standard library sources (``.py`` files), a
  real corpus on every machine. Two Python versions give two corpora; the ranks'
  fingerprint check refuses a run whose ranks run different interpreters.
- ``text``: every regular file under ``data.root`` (hidden files and directories skipped).
- ``tokens``: nanoGPT's ``train.bin`` and ``val.bin`` (uint16 token ids) under
  ``data.root``, read by ``np.memmap``: a rank reads the windows of its own shard only.

A file's split is a hash of its relative path (``is_held_out``), so it does not move
when files are added; a small corpus, whose few hashes may fall far from the requested
share, holds out the files with the next-lowest hashes too (``held_out_files``). Its
*domain* is its first directory (``domain_of``): packages of
the standard library, directories of a text tree. An example is a window of
``context`` tokens and the same window shifted by one (the next tokens). Windows never
cross a domain boundary, so every training window has one domain; the partitions
``iid`` (windows dealt round-robin) and ``by_domain`` (whole domains per group of ranks,
balanced by bytes) are ``partition``'s.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError
from .dataset import Dataset, Shard, TextMeta, group_of_rank

SOURCES = ("pystdlib", "text", "tokens")
TOP = "(top)"  # the domain of files directly under the root
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------- files


def stdlib_root() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str, suffix: str = "") -> List[str]:
    """Relative paths ('/'-separated, sorted) of the regular files under ``root`` ending in ``suffix``; hidden
    entries, ``__pycache__`` and installed packages (``site-packages``) skipped."""
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        for f in files:
            if f.startswith(".") or not f.endswith(suffix):
                continue
            path = os.path.join(here, f)
            if os.path.isfile(path):
                out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(out)


def path_hash(relpath: str) -> float:
    """A 64-bit hash of a file's path, in [0, 1): where it falls decides the file's split."""
    return int.from_bytes(hashlib.blake2b(relpath.encode("utf-8"), digest_size=8).digest(), "little") / 2.0**64


def is_held_out(relpath: str, fraction: float) -> bool:
    """Whether a file belongs to the held-out split by its hash alone: its path's hash below ``fraction``. A pure
    function of the path, so adding or removing other files never moves it."""
    return path_hash(relpath) < fraction


TOP_UP_BELOW = 0.5  # held-out files holding less than this part of data.test_fraction's bytes are topped up


def held_out_files(files: Sequence[str], sizes: Sequence[int], fraction: float) -> List[bool]:
    """Which files are held out: those ``is_held_out`` names; where they hold less than half the requested share
    of the bytes (a small corpus: of 17 files at 0.1, none may fall under the hash), the files with the
    next-lowest hashes too, until the held-out files hold at least ``fraction`` of the bytes. The file with the
    highest hash always stays for training. In a large corpus the hash rule alone decides, so adding files moves
    none; in a small one a new file with a low hash may take the place of one held out before."""
    order = sorted(range(len(files)), key=lambda k: (path_hash(files[k]), files[k]))
    held = [False] * len(files)
    total, share = sum(sizes), 0
    by_hash = sum(1 for k in order if is_held_out(files[k], fraction))
    for k in order[:by_hash]:
        held[k], share = True, share + sizes[k]
    if share < TOP_UP_BELOW * fraction * total:
        for k in order[by_hash: len(files) - 1]:
            if share >= fraction * total:
                break
            held[k], share = True, share + sizes[k]
    return held


def domain_of(relpath: str) -> str:
    """A file's domain: its first directory (a package of the standard library), or ``(top)``."""
    head, sep, _ = relpath.partition("/")
    return head if sep else TOP


# --------------------------------------------------------------------------- windows


def windows(stream: np.ndarray, context: int) -> Tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each (n, context): consecutive non-overlapping windows and the same shifted by one.
    Views of ``stream`` (of a memmap, nothing is read)."""
    n = max((len(stream) - 1) // context, 0)
    return stream[: n * context].reshape(n, context), stream[1: n * context + 1].reshape(n, context)


def spaced(n: int, keep: Optional[int]) -> np.ndarray:
    """At most ``keep`` indices of ``range(n)``, evenly spaced (all of them when keep is None or >= n)."""
    if keep is None or keep >= n:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, keep).round().astype(np.int64))


def read_bytes(root: str, files: Sequence[str], context: int, test_fraction: float, max_bytes: Optional[int],
               *, test_windows: Optional[int], name: str, source: str):
    """A byte corpus as a ``data.Dataset``: the training windows of every domain (each domain's files concatenated
    in path order, cut to its share of ``max_bytes``), and at most ``test_windows`` windows of the held-out files."""
    blobs = []
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as fh:
                blobs.append(fh.read())
        except OSError as exc:
            raise DataError(f"data.dataset={name!r}: cannot read {os.path.join(root, rel)!r} ({exc.strerror})") \
                from None
    sizes = [len(b) for b in blobs]
    held_out = held_out_files(files, sizes, test_fraction)
    by_domain: dict = {}
    held: List[bytes] = []
    for rel, blob, out in zip(files, blobs, held_out):
        if out:
            held.append(blob)
        else:
            by_domain.setdefault(domain_of(rel), []).append(blob)
    streams = {d: np.frombuffer(b"".join(parts), dtype=np.uint8) for d, parts in by_domain.items()}
    total = sum(len(s) for s in streams.values())
    if max_bytes is not None and total > max_bytes:  # every domain keeps its share, so none vanishes
        streams = {d: s[: max(int(len(s) * max_bytes / total), context + 1)] for d, s in streams.items()}
    names = tuple(sorted(d for d, s in streams.items() if len(s) > context))
    xs, ys, ids = [], [], []
    for k, d in enumerate(names):
        x, y = windows(streams[d], context)
        xs.append(x)
        ys.append(y)
        ids.append(np.full(len(x), k, dtype=np.int64))
    test_stream = np.frombuffer(b"".join(held), dtype=np.uint8)
    x_test, y_test = windows(test_stream, context)
    if not names:
        raise DataError(f"data.dataset={name!r}: {source} gives no training window of data.lm.context={context} "
                        f"bytes ({len(files)} files, {total} training bytes, {len(test_stream)} held-out bytes at "
                        f"data.test_fraction={test_fraction}); add text or shorten the context")
    if len(x_test) == 0:
        raise DataError(_no_held_out_window(name, source, files=files, sizes=sizes, held_out=held_out,
                                            context=context, fraction=test_fraction))
    keep = spaced(len(x_test), test_windows)
    split = (f"{sum(held_out)} of {len(files)} files held out, {len(test_stream) / max(sum(sizes), 1):.1%} of the "
             f"bytes at data.test_fraction={test_fraction}")
    meta = TextMeta(names, np.concatenate(ids), np.array([len(x) * context for x in xs], dtype=np.int64), 1.0,
                    f"{source} ({split})")
    return Dataset(np.concatenate(xs), np.concatenate(ys), np.ascontiguousarray(x_test[keep]),
                   np.ascontiguousarray(y_test[keep]), name, classes=256, text=meta)


def _no_held_out_window(name: str, source: str, *, files: Sequence[str], sizes: Sequence[int],
                        held_out: List[bool], context: int, fraction: float) -> str:
    """What to do when the held-out files give no window: the data.test_fraction that would, or more files."""
    total, share = sum(sizes), sum(s for s, h in zip(sizes, held_out) if h)
    what = (f"data.dataset={name!r}: no held-out window of data.lm.context={context} bytes at data.test_fraction="
            f"{fraction} in {source} ({sum(held_out)} of {len(files)} files held out, {share} of {total} bytes)")
    got = 0
    for k in sorted(range(len(files)), key=lambda k: (path_hash(files[k]), files[k]))[: min(len(files) - 1, 64)]:
        got += sizes[k]
        larger = math.ceil(1000 * got / total) / 1000  # a fraction that holds out these files, checked
        if larger < 1 and got > context:
            bytes_out = sum(s for s, h in zip(sizes, held_out_files(files, sizes, larger)) if h)
            if bytes_out > context:
                return (f"{what}: raise data.test_fraction to {larger:g} ({bytes_out} bytes held out), shorten "
                        "data.lm.context, or add text")
    return (f"{what}: the split holds out whole files and keeps one for training, and the files give no window "
            f"of {context + 1} bytes that way: split the text into more files, or shorten data.lm.context")


def load_pystdlib(context: int, test_fraction: float, max_bytes: Optional[int], test_windows: Optional[int]):
    """The interpreter's standard library (``.py`` files) as a byte corpus."""
    root = stdlib_root()
    files = list_files(root, ".py")
    if not files:
        raise DataError(f"data.dataset='pystdlib': no .py file under {root!r} (the interpreter's standard library); "
                        "use data.dataset=text with data.root")
    version = ".".join(map(str, sys.version_info[:3]))
    return read_bytes(root, files, context, test_fraction, max_bytes, test_windows=test_windows, name="pystdlib",
                      source=f"the Python {version} standard library at {root}")


def load_text(root: Optional[str], context: int, test_fraction: float, max_bytes: Optional[int],
              test_windows: Optional[int]):
    """Every regular file under ``data.root`` as a byte corpus."""
    where = _root(root, "text")
    files = list_files(where)
    if not files:
        raise DataError(f"data.root={root!r}: no file to read for data.dataset='text'")
    return read_bytes(where, files, context, test_fraction, max_bytes, test_windows=test_windows, name="text",
                      source=f"the files under {where}")


def load_tokens(root: Optional[str], context: int, vocab: Optional[int], bytes_per_token: Optional[float],
                test_windows: Optional[int]):
    """nanoGPT's ``train.bin`` / ``val.bin`` (uint16 token ids) as windows of memmaps: nothing read here but the
    largest id when ``data.lm.vocab`` is not given, in chunks."""
    where = _root(root, "tokens")
    arrays = []
    for f in ("train.bin", "val.bin"):
        path = os.path.join(where, f)
        if not os.path.isfile(path):
            raise DataError(f"data.root={root!r}: data.dataset='tokens' needs {f} there (nanoGPT's uint16 token "
                            f"files; {path!r} is missing)")
        if os.path.getsize(path) % 2:
            raise DataError(f"{path!r} holds an odd number of bytes: not a uint16 token file")
        arrays.append(np.memmap(path, dtype=np.uint16, mode="r"))
    train, val = arrays
    largest = max(_max_chunked(train), _max_chunked(val))
    if vocab is None:
        vocab = largest + 1
    elif largest >= vocab:
        raise DataError(f"data.lm.vocab={vocab}, but the token files hold id {largest}")
    x, y = windows(train, context)
    xt, yt = windows(val, context)
    if len(x) == 0 or len(xt) == 0:
        raise DataError(f"data.root={root!r}: train.bin or val.bin is shorter than one window of "
                        f"data.lm.context={context} tokens")
    keep = spaced(len(xt), test_windows)
    meta = TextMeta(("tokens",), np.zeros(len(x), dtype=np.int64), np.array([len(x) * context]), bytes_per_token,
                    f"the token files under {where}")
    return Dataset(x, y, np.ascontiguousarray(xt[keep]), np.ascontiguousarray(yt[keep]), "tokens", classes=int(vocab),
                   text=meta)


def _root(root: Optional[str], dataset: str) -> str:
    if root is None:
        raise DataError(f"data.dataset={dataset!r} reads from data.root, which is not set")
    where = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(where):
        raise DataError(f"data.root={root!r} is not a directory (data.dataset={dataset!r})")
    return where


def _max_chunked(a: np.ndarray, chunk: int = 1 << 24) -> int:
    return int(max((a[lo: lo + chunk].max() for lo in range(0, len(a), chunk)), default=0))


def sampled_digest(h, a: np.ndarray, blocks: int = 64, block: int = 1 << 15) -> None:
    """Feed ``h`` the shape and ``blocks`` evenly spaced blocks of a memmapped array: a fingerprint that reads
    64 blocks of 32,768 values (4 MiB of a uint16 file) of a file of any size; a different file of the same size
    almost surely differs there."""
    h.update(str(a.shape).encode())
    flat = a.reshape(-1)
    for lo in spaced(max(len(flat) - block, 1), blocks):
        h.update(np.ascontiguousarray(flat[lo: lo + block]).tobytes())


# --------------------------------------------------------------------------- partitions


def domain_groups(domain_bytes: np.ndarray, groups: int) -> np.ndarray:
    """The group of every domain: largest first, each to the lightest group so far (ties: the lowest group).
    Whole domains, so the groups are as balanced by bytes as the domains allow."""
    load = np.zeros(groups, dtype=np.int64)
    out = np.zeros(len(domain_bytes), dtype=np.int64)
    for d in sorted(range(len(domain_bytes)), key=lambda k: (-int(domain_bytes[k]), k)):
        g = int(np.argmin(load))
        out[d] = g
        load[g] += int(domain_bytes[d])
    return out


def partition(meta: TextMeta, world: int, kind: str, groups: int):
    """All N shards of a corpus's training windows (``dataset.Shard``s): ``iid`` deals the windows round-robin;
    ``by_domain`` gives each of ``groups`` contiguous blocks of ranks whole domains (``domain_groups``) and deals
    each group's windows round-robin among its ranks."""
    n = len(meta.window_domain)
    if n < world:
        raise DataError(f"the corpus has {n} training windows, fewer than the {world} replicas; lower "
                        "data.lm.context or add text")
    if kind == "iid":
        return [Shard(np.arange(r, n, world, dtype=np.int64), None) for r in range(world)]
    if kind != "by_domain":
        raise DataError(f"data.partition={kind!r} does not apply to a text corpus: iid or by_domain")
    if groups > world or groups > len(meta.domains):
        raise DataError(f"data.groups={groups} exceeds the world size {world} or the corpus's "
                        f"{len(meta.domains)} domains ({', '.join(meta.domains[:8])}"
                        f"{', ...' if len(meta.domains) > 8 else ''})")
    of_domain = domain_groups(meta.domain_bytes, groups)
    window_group = of_domain[meta.window_domain]
    rank_group = np.array([group_of_rank(r, world, groups) for r in range(world)])
    shards = []
    for r in range(world):
        g = int(rank_group[r])
        mine = np.flatnonzero(window_group == g)
        members = np.flatnonzero(rank_group == g)
        k = int(np.flatnonzero(members == r)[0])
        shards.append(Shard(mine[k:: len(members)].astype(np.int64), g))
    for r, s in enumerate(shards):
        if s.indices.size == 0:
            raise DataError(f"data.partition='by_domain': rank {r} gets no window (group {s.group}); lower "
                            "data.groups or the world size")
    return shards


def describe_domains(meta: TextMeta, shards, groups: Optional[int]) -> dict:
    """partition.json's record of the domains: each one's bytes and group, and each rank's windows per domain."""
    out = {"domains": list(meta.domains), "domain_tokens": meta.domain_bytes.tolist(),
           "bytes_per_token": meta.bytes_per_token, "source": meta.source,
           "shard_domains": [np.bincount(meta.window_domain[s.indices], minlength=len(meta.domains)).tolist()
                             for s in shards]}
    if groups:
        out["domain_groups"] = domain_groups(meta.domain_bytes, groups).tolist()
    return out
