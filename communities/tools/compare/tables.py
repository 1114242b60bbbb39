"""The tables of a comparison, each a list of columns (a header and how to write a row's cell), rendered as
markdown (compare.md) or as aligned plain text (what ``communities compare`` prints).

A strategy's row is its entry of compare.json's ``strategies`` with its ``label``; a run's row is its entry of
``runs``. Which columns a table has depends on the runs: a language model's losses instead of accuracies,
moving data, privacy, community models (``Kinds``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

from .spec import Target


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], str]


@dataclass(frozen=True)
class Kinds:
    """What the runs of a comparison hold, which decides the columns."""

    lm: bool  # language models: losses (lower is better) instead of accuracies
    moving: bool  # examples passed or retired (examples.*)
    private: bool  # trained with privacy.enabled
    personal: bool  # each rank scored on its local test data (community models)

    @classmethod
    def of(cls, runs: Sequence[dict]) -> "Kinds":
        return cls(lm=any("task" in r for r in runs),
                   moving=any(r.get("data_bytes_mean") or r.get("retired_fraction") is not None for r in runs),
                   private=any(r.get("epsilon") is not None for r in runs),
                   personal=any(r.get("local_test_acc") is not None for r in runs))


def fmt(x: Optional[float], spec: str = "{:.4f}") -> str:
    return "-" if x is None else spec.format(x)


def pm(st: dict, spec: str = "{:.4f}", scale: float = 1.0) -> str:
    """A figure over the seeds (``aggregate._stats``): ``mean ± std``, the mean alone for one seed, ``-`` for none."""
    if st["mean"] is None:
        return "-"
    out = spec.format(st["mean"] * scale)
    if st["std"] is not None:
        out += " ± " + spec.format(st["std"] * scale)
    return out


def markdown(columns: Sequence[Column], rows: Iterable[dict], tail: Optional[Callable[[dict], str]] = None
             ) -> List[str]:
    """The header, the rule and a line per row; ``tail(row)``, where given, follows a row's last ``|``."""
    out = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(c.cell(row) for c in columns) + " |" + (tail(row) if tail else ""))
    return out


def plain(columns: Sequence[Column], rows: Iterable[dict]) -> str:
    """Left-aligned columns two spaces apart, the header first."""
    cells = [[c.header for c in columns]] + [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def strategy_rows(agg: dict) -> List[dict]:
    return [{"label": label, **a} for label, a in agg["strategies"].items()]


# --------------------------------------------------------------------------- strategies (compare.md)


def _to_target_wall(a: dict) -> str:
    tg = a["target"]
    return pm(tg["wall"], "{:.1f}") + ("" if tg["wall_measured"] == tg["reached"] else " (est.)")


def _to_target(a: dict) -> str:
    tg = a["target"]
    return f"{pm(tg['t'], '{:.0f}')} ({tg['reached']}/{tg['of']})"


def _epsilon(a: dict) -> str:
    return pm(a["epsilon"], "{:.2f}") if a["epsilon"]["mean"] is not None else "inf"


LABEL = Column("strategy", lambda a: a["label"])
RUNS = Column("runs", lambda a: f"{a['runs']}/{a['planned']}")
CONSENSUS_ACC = Column("consensus test acc", lambda a: pm(a["consensus_test_acc"]))
WALL = Column("wall s", lambda a: pm(a["wall_time"], "{:.1f}"))


def _mb(key: str, header: str = "MB sent / rank") -> Column:
    return Column(header, lambda a: pm(a[key], "{:.2f}", 1e-6))


def personal_columns() -> List[Column]:
    """Community models: what each rank ends with, scored on its own local test data."""
    return [LABEL, RUNS, Column("delivered", lambda a: ", ".join(a["delivered"]) or "-"),
            Column("mean local-test acc", lambda a: pm(a["local_test_acc"])), CONSENSUS_ACC,
            Column("first-round ARI", lambda a: pm(a["first_round_ari"], "{:.3f}")), _mb("bytes_sent_per_rank"), WALL]


def strategy_columns(target: Target, kinds: Kinds) -> List[Column]:
    """compare.md's main table: quality, cost, and the way to the target, mean ± std over the seeds."""
    quality = ([Column("consensus test loss (nats/token)", lambda a: pm(a["consensus_test_loss"], "{:.3f}")),
                Column("bits/byte", lambda a: pm(a["consensus_test_bpb"], "{:.3f}")),
                Column("next-token acc", lambda a: pm(a["consensus_test_acc"]))] if kinds.lm else
               [CONSENSUS_ACC, Column("best-rank acc", lambda a: pm(a["best_rank_acc"]))])
    return [LABEL, RUNS, *quality, _mb("bytes_sent_per_rank"), WALL,
            Column("idle %", lambda a: pm(a["idle_share"], "{:.0f}", 100)),
            *([Column("tokens/s / rank", lambda a: pm(a["tokens_per_s_per_rank"], "{:.0f}"))] if kinds.lm else []),
            Column(f"reached {target.text()}", lambda a: f"{a['target']['reached']}/{a['target']['of']}"),
            Column("t to target (units)", lambda a: pm(a["target"]["t"], "{:.0f}")),
            Column("MB to target", lambda a: pm(a["target"]["bytes"], "{:.2f}", 1e-6)),
            Column("wall s to target", _to_target_wall),
            *([Column("data MB / rank", lambda a: pm(a["data_bytes_per_rank"], "{:.3f}", 1e-6)),
               Column("retired %", lambda a: pm(a["retired_fraction"], "{:.1f}", 100))] if kinds.moving else []),
            *([Column("epsilon", _epsilon)] if kinds.private else [])]


# --------------------------------------------------------------------------- runs (compare.md)


def _complete(cell: Callable[[dict], str]) -> Callable[[dict], str]:
    """A run's cell, ``-`` for a run that did not complete."""
    return lambda r: cell(r) if "consensus_test_acc" in r else "-"


def run_columns(kinds: Kinds) -> List[Column]:
    """compare.md's list of every planned run, complete or not."""
    quality = ([Column("consensus loss", _complete(lambda r: fmt(r.get("consensus_test_loss")))),
                Column("bits/byte", _complete(lambda r: fmt(r.get("consensus_test_bpb"))))] if kinds.lm else
               [Column("consensus acc", _complete(lambda r: f"{r['consensus_test_acc']:.4f}")),
                Column("best-rank acc", _complete(lambda r: f"{r['best_rank_acc']:.4f}"))])
    t = _complete(lambda r: "-" if r["target"] is None else f"{r['target']['t']:.0f}")
    return [Column("run", lambda r: r["name"]), Column("strategy", lambda r: r["strategy"]),
            Column("seed", lambda r: str(r["seed"])), Column("status", lambda r: r["status"]), *quality,
            Column("MB / rank", _complete(lambda r: f"{r['bytes_sent_mean'] / 1e6:.2f}")),
            Column("wall s", _complete(lambda r: f"{r['wall_time']:.1f}")), Column("t to target", t),
            *([Column("delivered", _complete(lambda r: str(r["delivered"]))),
               Column("local-test acc", _complete(lambda r: fmt(r.get("local_test_acc"))))]
              if kinds.personal else [])]


def run_error(r: dict) -> str:
    """After an incomplete run's row: why it failed, where known."""
    return f" {r['error']}" if "consensus_test_acc" not in r and r.get("error") else ""


# --------------------------------------------------------------------------- what the command prints


def summary_columns(target: Target, personal: bool, lm: bool) -> List[Column]:
    quality = ([Column("consensus loss", lambda a: pm(a["consensus_test_loss"], "{:.3f}")),
                Column("bits/byte", lambda a: pm(a["consensus_test_bpb"], "{:.3f}"))] if lm else
               [Column("consensus acc", lambda a: pm(a["consensus_test_acc"])),
                Column("best-rank acc", lambda a: pm(a["best_rank_acc"]))])
    return [LABEL, RUNS, *quality, _mb("bytes_sent_per_rank", "MB/rank"), WALL,
            *([Column("tokens/s/rank", lambda a: pm(a["tokens_per_s_per_rank"], "{:.0f}"))] if lm else []),
            Column(f"t to {target.text()}", _to_target),
            *([Column("local-test acc", lambda a: pm(a["local_test_acc"])),
               Column("delivered", lambda a: ", ".join(a["delivered"]) or "-")] if personal else [])]
