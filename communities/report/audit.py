"""What a finished run directory vouches for, checked file by file: the chaos soak's verdict on a run.

A run that lost ranks (its writer among them) must still leave a directory as good as a clean run's:

- ``meta.json`` says ``complete``, and every product it lists (``consensus.pt``, the community models)
  matches its size and BLAKE2b digest;
- every complete checkpoint matches its manifest, and no checkpoint directory is left uncommitted;
- no temporaries (``.NAME.XXXX.tmp``, ``rounds/.round_*``) remain;
- every unit is accounted for: each rank's rows in ``metrics.jsonl`` run 1, 2, ... without a gap or a
  repeat, up to its last unit (a lost rank's, up to the unit the survivors went on from);
- every jsonl file parses to its last line.

``audit`` lists what is wrong (empty: intact); ``communities inspect`` is the reader's side of the same checks.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Dict, List

from .. import manifest
from ..results import ResultsError
from .load import check_products

JSONL = ("metrics.jsonl", "merges.jsonl", "consensus.jsonl")


def audit(run: Path) -> List[str]:
    """One line per problem of the finished run directory ``run``; [] when it is complete and intact."""
    run = Path(run)
    try:
        meta = json.loads((run / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return [f"{run / 'meta.json'}: unreadable ({exc})"]
    out: List[str] = []
    if meta.get("status") != "complete":
        out.append(f"{run / 'meta.json'}: status {meta.get('status')!r}, not 'complete'")
    if not (run / "summary.json").exists():
        out.append(f"{run / 'summary.json'}: missing")
    try:
        check_products(run, meta, [])
    except ResultsError as exc:
        out.append(str(exc))
    checkpoints = run / "checkpoints"
    for d in manifest.complete_dirs(checkpoints):
        out += [f"{d}: {p}" for p in manifest.problems(d)]
    if checkpoints.is_dir():
        out += [f"{d}: a checkpoint directory never committed" for d in sorted(checkpoints.glob("u*"))
                if d.is_dir() and not (d / manifest.COMPLETE).exists()]
    out += [f"{p}: a temporary left behind" for p in sorted(run.rglob("*.tmp"))]
    out += [f"{p}: a round never committed" for p in sorted((run / "rounds").glob(".round_*"))]
    rows: Dict[str, list] = {}
    for name in JSONL:
        path = run / name
        if not path.exists():
            out.append(f"{path}: missing")
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text and not text.endswith("\n"):
            out.append(f"{path}: its last line is torn")
            text = text.rpartition("\n")[0]  # the whole lines are read on
        try:
            rows[name] = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            out.append(f"{path}: damaged ({exc})")
    out += _units(rows.get("metrics.jsonl", []), run / "metrics.jsonl")
    return out


def _units(metrics: List[dict], path: Path) -> List[str]:
    """Each rank's units 1..last, once each."""
    by_rank: Dict[int, List[int]] = {}
    for m in metrics:
        by_rank.setdefault(int(m["rank"]), []).append(int(m["t"]))
    out = []
    for r, ts in sorted(by_rank.items()):
        if sorted(ts) != list(range(1, max(ts) + 1)):
            count = Counter(ts)
            missing = [t for t in range(1, max(ts) + 1) if t not in count]
            twice = sorted(t for t, k in count.items() if k > 1)
            out.append(f"{path}: rank {r}'s units are not 1..{max(ts)} once each"
                       + (f" ({len(missing)} missing, from {missing[:5]})" if missing else "")
                       + (f" ({len(twice)} twice, from {twice[:5]})" if twice else ""))
    return out
