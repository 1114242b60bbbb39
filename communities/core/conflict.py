"""Whether the communities should merge: the decision rule of ``consensus.mode: auto``, a function of arrays.

Why: one consensus model is the wrong answer when groups of ranks hold
conflicting data (concept shift), and the right one when they merely hold
different parts of one task (label skew, IID shards). The members' own
validation data tell the two apart: a merge across communities that conflict
makes the model worse *on the examples both partners train on*, beyond what any
merge costs.

At each merge a rank scores, on its local validation examples of the classes
its partner also trains on, its model just before the merge and the merged model
just after it (and the partner's model alone). It keeps per-example sums, apart
for merges across the communities weighed (``cross``) and inside one
(``intra``, the control: what merging itself costs). At each signature round the ranks
allgather their sums, so every rank holds the same (N, F) matrix and takes the
same decision from the same bytes. Over the totals since the first round:

    rise(kind) = (loss after - loss before) / loss before, over that kind's merges
    harm       = rise(cross) - max(rise(intra), 0)   (rise(intra) = 0 without intra merges)

and the verdict is ``freeze`` once at least ``min_merges`` cross-merge sides
were scored and ``harm > threshold``; ``undecided`` otherwise (keep annealing).
The control only ever subtracts a *cost*: when merges inside a community raise
the loss too (young models), that much of the cross merges' rise is not blamed
on the communities; when they lower it, cross merges must raise the loss by
themselves to count as harm (merges across label-skewed communities help, only
less than merges inside one: that is not conflict).

Measured (issue 15; digits and MNIST-1D, 8 and 16 ranks, the first round's
communities weighed, totals up to each of the first rounds): with conflicting
groups (a label permutation per group) cross merges raised the loss by 0.07 to
3.0 of its value while intra merges lowered it (-0.05 to -0.25); with label skew
(Dirichlet 0.1) cross merges lowered it (-0.28 to -0.84); IID shards had no
cross merge at all (one community). Hence a threshold of 0.05 at first. At 1,024
replicas (issue 40; MNIST-1D, 125 examples a replica, conflicting groups) cross
merges raised the loss by 0.034-0.040 at round 1, under 0.05: annealing went on,
the groups mixed, the freeze came at round 11 and cost 1.8 points against the
oracle. Language domains that share a syntax, which should not freeze, gave
0.0004. Hence the default 0.02.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Optional

import numpy as np

KINDS = ("cross", "intra")
# per kind: merge sides scored, validation examples scored, and per-example sums over them of the loss and of
# the correct predictions of the model before the merge, after it, and of the partner's model alone
MEASURES = ("merges", "examples", "loss_before", "loss_after", "loss_partner", "correct_before", "correct_after",
            "correct_partner")
FIELDS = tuple(f"{k}_{m}" for k in KINDS for m in MEASURES)
WIDTH = len(FIELDS)


def empty() -> np.ndarray:
    """One rank's evidence row with nothing recorded yet."""
    return np.zeros(WIDTH, dtype=np.float64)


def record(row: np.ndarray, kind: str, *, examples: int, loss_before: float, loss_after: float, loss_partner: float,
           correct_before: float, correct_after: float, correct_partner: float) -> None:
    """Add one merge side to ``row`` (in place); losses and corrects are sums over the ``examples`` scored."""
    base = KINDS.index(kind) * len(MEASURES)
    row[base: base + len(MEASURES)] += (1.0, examples, loss_before, loss_after, loss_partner, correct_before,
                                        correct_after, correct_partner)


def rise(before: float, after: float) -> float:
    """Relative change of a loss sum: (after - before) / before (0 when both are 0)."""
    if before > 0:
        return (after - before) / before
    return 0.0 if after <= 0 else float("inf")


@dataclass(frozen=True)
class Verdict:
    """What the evidence says, the same on every rank."""

    decision: str  # "freeze" | "undecided"
    cross_merges: int  # merge sides across communities scored so far
    intra_merges: int
    cross_rise: Optional[float]  # relative loss rise by cross merges (None: none scored)
    intra_rise: Optional[float]
    harm: Optional[float]  # cross_rise - max(intra_rise, 0)
    cross_acc_before: Optional[float]  # accuracy on the scored examples before / after cross merges
    cross_acc_after: Optional[float]
    cross_acc_partner: Optional[float]  # the partner's model alone on them

    def to_dict(self) -> Dict[str, object]:
        """As JSON holds it: a figure that is not finite is null."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def totals(rows: np.ndarray) -> Dict[str, float]:
    """Column sums of evidence rows (N, F) or one row (F,), by field name."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, WIDTH)
    return dict(zip(FIELDS, rows.sum(axis=0).tolist()))


def decide(rows: np.ndarray, threshold: float, min_merges: int) -> Verdict:
    """The verdict of the evidence ``rows`` (every rank's sums, or their totals since the first round)."""
    t = totals(rows)

    def of(kind: str):
        n = t[f"{kind}_examples"]
        if n <= 0:
            return None, None, None, None
        return (rise(t[f"{kind}_loss_before"], t[f"{kind}_loss_after"]), t[f"{kind}_correct_before"] / n,
                t[f"{kind}_correct_after"] / n, t[f"{kind}_correct_partner"] / n)

    cross_rise, acc_before, acc_after, acc_partner = of("cross")
    intra_rise = of("intra")[0]
    harm = None if cross_rise is None else cross_rise - max(intra_rise or 0.0, 0.0)
    cross = int(t["cross_merges"])
    freeze = harm is not None and cross >= min_merges and harm > threshold
    return Verdict("freeze" if freeze else "undecided", cross, int(t["intra_merges"]), cross_rise, intra_rise, harm,
                   acc_before, acc_after, acc_partner)


def known_classes(label_counts: np.ndarray, share: float = 0.5) -> np.ndarray:
    """(N, C) bool: the classes each rank trains on, those holding at least ``share / C`` of its shard.

    A rank's validation examples of a class its partner barely saw say nothing about whether the two
    conflict (label skew is not conflict): only the classes the partner knows are scored.
    """
    counts = np.asarray(label_counts, dtype=np.float64)
    n = counts.sum(axis=1, keepdims=True)
    c = counts.shape[1]
    return counts >= np.maximum(share * n / c, 1.0)
