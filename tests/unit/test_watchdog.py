"""The watchdog's roll call (communities/runtime/watchdog.py): which ranks have not arrived in a collective.

The message is built by a pure function from the answers; the answers themselves cross MPI under mpiexec
(tests/mpi/test_faults_mpi.py stalls a rank before an Allreduce and checks the message names it).
"""
from communities.runtime.watchdog import RollCall, missing_ranks


def test_the_ranks_behind_the_collective_are_named_with_what_they_do():
    answers = {1: (57, ""), 2: (56, ""), 3: (55, "Sendrecv of weights with rank 2"), 4: None}
    msg = missing_ranks(57, answers)
    assert "rank 1" not in msg  # it has arrived
    assert "rank 2 (at collective #56: busy outside MPI: computing or writing)" in msg
    assert "rank 3 (at collective #55: waiting in Sendrecv of weights with rank 2)" in msg
    assert "no answer from rank 4 (frozen, or gone)" in msg


def test_when_everybody_has_arrived_it_says_so():
    assert missing_ranks(9, {1: (9, "Allreduce"), 2: (9, "Allreduce")}) == "every rank that answered has arrived"


def test_collectives_are_counted_on_one_rank_without_a_side_channel():
    from mpi4py import MPI

    roll = RollCall(MPI.COMM_WORLD)
    assert roll.comm is None and roll.ask() == {}  # a world of one has nobody to ask
    assert [roll.enter(), roll.enter()] == [1, 2]
