"""What every benchmark prints with: plain-text tables, JSON files, this machine's load and memory."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Dict, Optional, Sequence

MB = 1 << 20


def fmt_table(header: Sequence[str], rows: Sequence[Sequence], align: Optional[str] = None) -> str:
    """A plain-text table; ``align`` holds one 'l' or 'r' per column (default: first left, rest right)."""
    cells = [[str(h) for h in header]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    align = align or ("l" + "r" * (len(header) - 1))
    out = []
    for k, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_json(path: Optional[str], obj) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=2) + "\n")
        print(f"wrote {p}")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def proc_status() -> Dict[str, int]:
    """VmRSS/VmHWM of this process in bytes, from /proc/self/status (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def pairwise_strategy(cfg, n: int):
    """The configured strategy, which must draw pairwise partners (``Gossip`` and its subclasses: ``exchanges``)."""
    from ...engine.mixing import strategies
    from ...engine.mixing.gossip import Gossip

    strat = strategies.make(cfg, n)
    assert isinstance(strat, Gossip), f"strategy={cfg.strategy!r} draws no pairwise partners"
    return strat


def machine_load() -> str:
    """CPUs and load average: other jobs on the machine skew every figure here."""
    try:
        load = open("/proc/loadavg").read().split()[:3]
    except OSError:
        load = ["?"] * 3
    return f"{os.cpu_count()} CPUs, load average {' '.join(load)} (1/5/15 min) at start"
