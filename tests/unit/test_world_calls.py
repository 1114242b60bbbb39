"""``World``'s calls on a one-process world: every blocking collective is counted by the roll call and watched,
control collectives never add to the training bytes, and the byte counters checkpoint by kind."""
from __future__ import annotations

import numpy as np
import torch

from communities.runtime.comm import World
from communities.runtime.staging import Staging


def test_every_blocking_collective_is_counted_by_the_roll_call():
    w = World(timeout=0)
    calls = [
        lambda: w.allgather(np.zeros(2)),
        lambda: w.allgather_text("x"),
        lambda: w.allreduce_sum_(torch.ones(3)),
        lambda: w.allreduce_scalar(1.0),
        lambda: w.allreduce_array(np.ones(2), "max"),
        lambda: w.alltoall_counts(np.zeros(1, dtype=np.int64)),
        lambda: w.bcast_(torch.ones(2)),
        lambda: w.bcast_array(np.ones(2), (2,), np.float64),
        lambda: w.gather_rows(np.ones((2, 3))),
        lambda: w.barrier(),
    ]
    for call in calls:
        before = w.roll.count
        call()
        assert w.roll.count > before, call
    w.close()


def test_control_collectives_leave_the_training_bytes_alone():
    w = World(timeout=0)
    assert w.allreduce_array(np.array([2.0, 3.0]), "max").tolist() == [2.0, 3.0]
    assert w.alltoall_counts(np.array([4], dtype=np.int64)).tolist() == [4]
    assert w.bcast_text("hello") == "hello"
    assert w.allreduce_scalar(2.5) == 2.5
    assert w.bytes_sent == 0
    w.close()


def test_byte_counters_checkpoint_by_kind_and_an_older_checkpoint_loads():
    w = World(timeout=0)
    w.bytes_sent, w.bytes_control = 10, 7
    state = w.state_dict()
    assert state == {"bytes_sent": 10, "bytes_monitoring": 0, "bytes_data": 0, "bytes_control": 7,
                     "bytes_in_process": 0, "bytes_in_group": 0}
    w.load_state_dict({"bytes_sent": 3, "bytes_monitoring": 2, "bytes_data": 1})  # before bytes_control was kept
    assert (w.bytes_sent, w.bytes_monitoring, w.bytes_data, w.bytes_control) == (3, 2, 1, 0)
    with w.metered("data"):
        w.bytes_sent += 5
    assert (w.bytes_sent, w.bytes_data) == (3, 6)
    with w.inside_group():  # training bytes that stayed in a data-parallel group: counted twice over, by kind
        w.bytes_sent += 4
    assert (w.bytes_sent, w.bytes_in_group) == (7, 4)
    with w.metered("monitoring"), w.inside_group():  # metered: neither counter keeps it
        w.bytes_sent += 9
    assert (w.bytes_sent, w.bytes_in_group, w.bytes_monitoring) == (7, 4, 11)
    w.close()


def test_cpu_tensors_go_to_mpi_as_they_are():
    t = torch.arange(4.0)
    with Staging().buffer(t, "reduce") as buf:
        buf[0] = 9.0  # MPI writes the tensor's own memory
    assert t[0].item() == 9.0
