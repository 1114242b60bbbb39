"""Run under mpiexec -n 2: two trackers swap their hardest examples through the real exchange.

Checks, on each rank, that what arrived is exactly what the peer sent: features
bit for bit (against the shared pool), labels, ids, confidence and visited sets;
and that hand-over conserves the examples (no id lost or held twice). Prints one
line "ok <sent> <received>" per rank; any failure raises (mpi4py aborts the job).
"""
import sys

import numpy as np
import torch

from communities.config import ExamplesConfig
from communities.core import example_table
from communities.engine.replica import examples as example_tracker
from communities.runtime.comm import World

handover = sys.argv[1] == "handover"
world = World(timeout=60)
rank, peer = world.rank, 1 - world.rank
rng = np.random.default_rng(0)
x_pool = rng.standard_normal((200, 3, 5)).astype(np.float32)
y_pool = rng.integers(0, 4, 200)
cfg = ExamplesConfig(track=True, pass_hard=True, pass_fraction=0.2, handover=handover, pass_which="unseen")
ids = np.arange(rank * 100, rank * 100 + 100)
tr = example_tracker.ExampleTracker(cfg, ids, x_pool=x_pool, y_pool=y_pool, world=2, rank=rank, seed=0,
                                     device="cpu", n_classes=4)
conf = np.random.default_rng(rank + 10).random(100)
tr.table.update_confidence(np.arange(100), conf, 0.0)
tr.trained(np.arange(0, 100, 3))
mine = tr.table.hardest(count=tr.pass_count(peer, 1.0), prefer=peer)
sent_ids = tr.table.ids[mine].copy()
sent_conf = tr.table.confidence[mine].copy()
sent_vis = tr.table.visited[mine].copy()

# what the peer will send: exchange the expectation through MPI as plain buffers, to compare afterwards
n_theirs = int(world.sendrecv_array(np.array([sent_ids.size]), peer, tag=20)[0])
exp_ids = world.sendrecv_array(sent_ids, peer, tag=21)
exp_conf = world.sendrecv_array(sent_conf, peer, tag=22)
exp_vis = world.sendrecv_array(sent_vis, peer, tag=23)

before = world.allreduce_scalar(len(tr))
got = tr.exchange(world, peer)
assert got == {"sent": sent_ids.size, "received": n_theirs}, got
rows = np.flatnonzero(np.isin(tr.table.ids, exp_ids))
order = np.argsort(tr.table.ids[rows])
rows = rows[order]
srt = np.argsort(exp_ids)
assert np.array_equal(tr.table.ids[rows], exp_ids[srt])
assert np.array_equal(tr.table.confidence[rows], exp_conf[srt])
assert np.array_equal(tr.table.visited[rows], exp_vis[srt])
assert np.array_equal(tr.table.labels[rows], y_pool[exp_ids[srt]])
assert torch.equal(tr.x[torch.as_tensor(rows)], torch.as_tensor(x_pool[exp_ids[srt]])), "features changed in transit"
assert torch.equal(tr.y, torch.as_tensor(tr.table.labels)), "labels and table rows out of step"
assert torch.equal(tr.x, torch.as_tensor(x_pool[tr.table.ids])), "features and table rows out of step"
assert (tr.table.status[rows] == example_table.ACTIVE).all()
after = world.allreduce_scalar(len(tr))
if handover:
    assert not np.isin(sent_ids, tr.table.ids).any(), "handed-over examples are still here"
    assert after == before, (before, after)
    held = world.allgather(np.pad(tr.table.ids, (0, 200 - len(tr)), constant_values=-1))
    flat = held[held >= 0]
    assert np.array_equal(np.sort(flat), np.arange(200)), "an example was lost or duplicated"
else:
    assert np.isin(sent_ids, tr.table.ids).all(), "keep-copy mode dropped the sender's copy"
    assert after == before + sent_ids.size + n_theirs
print(f"ok {sent_ids.size} {n_theirs}", flush=True)
