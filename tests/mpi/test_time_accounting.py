"""Honest time accounting (issue 17): the split partitions each rank's wall time, and waiting is idle.

One rank is made four times slower (faults.speed: it sleeps three times each batch's
own time after the batch). Whatever the strategy, the fast ranks then spend most
of their time waiting for it: in a pairwise exchange, a gradient or weight
Allreduce, a signature gather or a log gather. Each of those waits must show as
idle, and no second may be counted twice.
"""
import json

import pytest

from communities.results import TIME_CATEGORIES
from tests.helpers.mpi import tiny_batch

pytestmark = pytest.mark.timeout(900)

SLOW = ["faults.speed={0: 4.0}", "model.hidden=[256,256]", "train.batch_size=64", "train.budget=20"]
STRATEGIES = ["community", "gossip", "ring", "isolated", "local_sgd", "diloco", "allreduce", "ifca"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run per strategy, in one batch (one start-up for them all)."""
    return tiny_batch(tmp_path_factory, "split", 4, {s: [f"strategy={s}", *SLOW] for s in STRATEGIES})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_split_partitions_the_wall_and_waiting_for_a_slow_rank_is_idle(runs, strategy):
    s = json.loads((runs[strategy] / "summary.json").read_text())
    per = s["time_split_per_rank"]
    assert set(per) == {"wall", *TIME_CATEGORIES}
    for r in range(4):
        parts = sum(per[c][r] for c in TIME_CATEGORIES)
        assert abs(parts - per["wall"][r]) <= 0.02 * per["wall"][r], (r, {c: per[c][r] for c in per})
        assert min(per[c][r] for c in TIME_CATEGORIES) >= 0.0
    fast_idle = [per["idle"][r] / per["wall"][r] for r in (1, 2, 3)]
    # a rank 4x slower leaves the others idle about 3/4 of the time on an idle machine; other jobs on the 2 cores
    # (4 ranks oversubscribed) took one fast rank of ifca down to 0.34 once: the bound is what no accounting bug
    # (idle counted as training, or not at all) would pass
    assert min(fast_idle) > 0.25, fast_idle
    assert per["idle"][0] / per["wall"][0] < min(fast_idle)  # the slow rank is the one they wait for
