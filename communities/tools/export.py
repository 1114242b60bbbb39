"""``communities export RUN --round R (--k K | --height H)``: any round's community models, after the run.

Why: the dendrogram of every round is saved, so a user can pick a round and a
level after the fact, as they would read them off ``communities inspect``.
This cuts round R's saved linkage (``rounds/round_RRRR/Z.npy``) with scipy's
``fcluster`` (``maxclust`` K, or ``distance`` H), refined by Lloyd steps on the
round's signatures as the engine's cuts are (``clustering.refine``), averages the members' weight
snapshots of that round (``snapshots/round_RRRR/``, written by runs with
``output.round_snapshots: true``) into one model per community, scores each on
its members' local test data (mean over members) and on the shared test split,
and writes::

    RUN/exports/round_RRRR_kK/   (or _hH)
        community_<c>.pt         the model's state_dict (torch)
        communities.json         members and scores, as models/communities.json

The mean is taken in float64 and cast to the weights' dtype, as the engine does
for the models it delivers, so the export of the round a run ended on gives the
engine's ``models/community_<c>.pt`` bit for bit (for the same partition).
The data are rebuilt from the run's ``config.yaml`` (the same seeded pipeline
as the ranks: ``workload.data.prepare``). Needs torch; no MPI.
Exit status: 0 done, 2 a missing or damaged file, a round that does not exist,
or a bad argument.
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import List, Optional

import numpy as np

from ..errors import EXIT_USER, UserError


def community_labels(Z: np.ndarray, k: Optional[int] = None, height: Optional[float] = None,
                     rows: Optional[np.ndarray] = None) -> np.ndarray:
    """Round labels of a cut of the linkage Z: k communities (maxclust) or at a height (distance), refined by
    Lloyd steps on ``rows`` where given (the round's signatures in the clustering's geometry, as the engine's
    cuts are with ``clustering.refine``)."""
    from ..core import clustering

    if k is None and height is None:
        raise ValueError("community_labels needs k or a height")
    labels = clustering.cut_maxclust(Z, k) if k is not None else clustering.cut_distance(Z, float(height or 0.0))
    if rows is not None and labels.max() >= 1:
        labels = clustering.refine(rows, labels, clustering.REFINE_STEPS)
    return labels


def load_snapshots(run_dir: Path, round_index: int, n: int):
    """The N ranks' weights of one round as an (N, P) tensor; ResultsError naming a missing or damaged file."""
    import torch

    from ..engine.record.round_snapshots import SNAPSHOTS_DIR, snapshot_path
    from ..results import ResultsError

    rows: List[torch.Tensor] = []
    for rank in range(n):
        path = snapshot_path(run_dir, round_index, rank)
        if not path.is_file():
            hint = "" if (Path(run_dir) / SNAPSHOTS_DIR).is_dir() else \
                " (the run wrote no snapshots: run it with output.round_snapshots=true)"
            raise ResultsError(f"{path}: missing{hint}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            flat = state["flat"]
            if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
                raise ValueError("'flat' is not a 1-D tensor")
        except Exception as exc:  # a truncated zip, a wrong layout
            raise ResultsError(f"{path}: damaged snapshot ({type(exc).__name__}: {exc})") from None
        if rows and flat.shape != rows[0].shape:
            raise ResultsError(f"{path}: {flat.numel()} weights, but rank 0's snapshot has {rows[0].numel()}")
        rows.append(flat)
    return torch.stack(rows)


def community_means(weights, labels: np.ndarray):
    """{label: the mean of its members' rows}, summed in float64 and cast back (the engine's rounding)."""
    import torch

    out = {}
    for c in sorted(set(int(x) for x in labels)):
        members = torch.as_tensor(np.flatnonzero(labels == c))
        out[c] = weights[members].double().sum(0).div_(len(members)).to(weights.dtype)
    return out


def export(run_dir: Path, round_index: int, k: Optional[int] = None, height: Optional[float] = None,
           out: Optional[Path] = None) -> dict:
    """Build, score and write round ``round_index``'s community models; returns the communities.json record."""
    import torch

    from .. import config as config_mod
    from ..results import ResultsError, atomic_write_bytes, atomic_write_json, load_round, read_run
    from ..workload import data, models, train

    run_dir = Path(run_dir)
    run = read_run(run_dir)
    n = run.world_size
    by_index = {int(p.name.split("_", 1)[1]): p for p in run.round_paths if p.name.split("_", 1)[1].isdigit()}
    if round_index not in by_index:
        have = f"rounds {min(by_index)}..{max(by_index)}" if by_index else "no complete round"
        raise ResultsError(f"{run_dir / 'rounds' / f'round_{round_index:04d}'}: no such round (the run has {have})")
    rnd = load_round(by_index[round_index])
    cfg = config_mod.from_dict(run.config, source=str(run_dir / "config.yaml"))
    from ..core import clustering

    # refined as the engine's cuts are (a cka signature's geometry needs its distances, which no round keeps)
    rows = clustering.geometry(np.asarray(rnd.signatures, dtype=np.float64), cfg.clustering.metric) \
        if cfg.clustering.refine and cfg.signature.kind != "cka" else None
    labels = community_labels(np.asarray(rnd.Z, dtype=np.float64), k, height, rows)
    weights = load_snapshots(run_dir, round_index, n)
    means = community_means(weights, labels)

    prepared = data.prepare(cfg.data, cfg.seed, n)
    ds = prepared.dataset
    torch.manual_seed(0)  # the architecture only: every weight is overwritten
    model = models.build(cfg.model, ds.input_shape, ds.n_classes)
    flat, _ = models.flatten_(model)
    if flat.numel() != weights.shape[1]:
        raise ResultsError(f"{run_dir / 'snapshots'}: {weights.shape[1]} weights per rank, but the model of "
                           f"{run_dir / 'config.yaml'} has {flat.numel()}")
    x_test, y_test = data.rows(ds.x_test, slice(None)), data.rows(ds.y_test, slice(None))

    def score(w, x, y):
        flat.copy_(w)
        return train.evaluate(model, x, y)

    level = f"k{k}" if k is not None else f"h{height:g}"
    out = Path(out) if out is not None else run_dir / "exports" / f"round_{round_index:04d}_{level}"
    entries = []
    for c, w in means.items():
        members = np.flatnonzero(labels == c)
        local = []
        for m in members:
            idx = prepared.local_tests[m]  # (rows: a token file's memmap reads these windows only)
            local.append(score(w, data.rows(ds.x_train, idx), data.rows(ds.y_train, idx))[0] if idx.size
                         else float("nan"))
        test_acc, test_loss = score(w, x_test, y_test)
        flat.copy_(w)
        buf = io.BytesIO()
        torch.save({key: v.detach().clone() for key, v in model.state_dict().items()}, buf)
        atomic_write_bytes(out / f"community_{c}.pt", buf.getvalue())
        finite = [a for a in local if np.isfinite(a)]
        entries.append({"community": c, "members": members.tolist(), "file": f"community_{c}.pt",
                        "local_test_acc": float(np.mean(finite)) if finite else None,
                        "local_test_acc_members": [float(a) if np.isfinite(a) else None for a in local],
                        "test_acc": test_acc, "test_loss": test_loss})
    record = {"kind": "export", "round": round_index, "t": int(rnd.info["t"]), "k": k, "height": height,
              "labels": labels.tolist(), "models": entries}
    atomic_write_json(out / "communities.json", record)
    record["_out"] = str(out)
    return record


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="communities export",
        description="Build one model per community of a round's dendrogram from the ranks' weight snapshots "
        "(output.round_snapshots), score each on its members' local test data and the shared test split, and "
        "write them to RUN/exports/round_RRRR_kK/ (or _hH).")
    p.add_argument("run_dir", type=Path, metavar="RUN", help="results/<name> of a run with round snapshots")
    p.add_argument("--round", dest="round_index", type=int, required=True, metavar="R",
                   help="the round: the NNNN of rounds/round_NNNN")
    level = p.add_mutually_exclusive_group(required=True)
    level.add_argument("--k", type=int, metavar="K", help="cut the tree into K communities (fcluster maxclust)")
    level.add_argument("--height", type=float, metavar="H", help="cut the tree at linkage height H (fcluster "
                       "distance)")
    p.add_argument("--out", type=Path, metavar="DIR", help="where to write (default RUN/exports/round_RRRR_kK)")
    return p


def main_export(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USER
    if args.k is not None and args.k < 1:
        print(f"communities export: error: --k {args.k}: a cut has at least 1 community", file=sys.stderr)
        return EXIT_USER
    if args.height is not None and not args.height > 0:
        print(f"communities export: error: --height {args.height}: a linkage height is > 0", file=sys.stderr)
        return EXIT_USER
    try:
        record = export(args.run_dir, args.round_index, args.k, args.height, args.out)
    except UserError as exc:
        print(f"communities export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER
    print(f"round {record['round']} (t={record['t']}): {len(record['models'])} communities -> {record['_out']}")
    for e in record["models"]:
        local = "-" if e["local_test_acc"] is None else f"{e['local_test_acc']:.4f}"
        print(f"  community {e['community']}: ranks {e['members']}  local test acc {local}  "
              f"shared test acc {e['test_acc']:.4f}")
    return 0

