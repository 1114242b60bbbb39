"""The exchange's payload: its layout, its pack/unpack round trip, and merges bitwise those of ``interpolate_``.

No MPI: a fake world hands each side the bytes the other side sent (recorded in a
first pass), so both sides of one exchange run in this process.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from communities.core import merge
from communities.engine.mixing import exchange
from communities.engine.mixing.exchange import Header, PairExchange, Payload, swap_and_merge_chunked
from communities.runtime.traffic import Traffic


class Wire:
    """A stand-in for ``World``: records what is sent, and answers with ``inbox``, message by message."""

    rank = 0

    def __init__(self, inbox=None):
        self.inbox, self.sent, self.bytes_sent, self.messages = inbox, [], 0, 0

    def sendrecv(self, send, recv, peer, tag=0):
        raw = send.reshape(-1).view(torch.uint8).clone()
        out = recv.reshape(-1).view(torch.uint8)
        out.copy_(self.inbox[self.messages] if self.inbox is not None else torch.zeros_like(out))
        self.sent.append(raw)
        self.bytes_sent += raw.numel()
        self.messages += 1

    def sendrecv_array(self, send, peer, tag=0):
        return np.asarray(self.inbox[self.messages]) if self.inbox is not None else send


def side(seed, p=1001, moments=True, seen=True, n=6):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(p, generator=g)
    state = [torch.randn(p // 2, generator=g), torch.randn(p - p // 2, generator=g)] if moments else []
    seen_at = np.arange(n, dtype=np.int64) * (seed + 1) - 1 if seen else None
    return flat, state, seen_at


def run_pair(a, whole_max, chunk=None, moments=True, seen=True, p=1001):
    """Both sides of one payload swap; returns ((flat, got, wire) for side 0, the same for side 1, the inputs)."""
    inputs = [side(s, p, moments, seen) for s in (0, 1)]

    def one(i, inbox):
        flat = inputs[i][0].clone()
        state = [v.clone() for v in inputs[i][1]]
        seen_at = None if inputs[i][2] is None else inputs[i][2].copy()
        wire = Wire(inbox)
        pair = PairExchange(wire, flat.numel(), flat.dtype, whole_max=whole_max)
        if chunk is not None:
            pair.buffers.chunk = chunk
        got = pair.swap(Payload(flat, state=state, seen_at=seen_at), 1 - i, a)
        return flat, got, wire

    first = [one(i, None)[2].sent for i in (0, 1)]  # what each side sends (it does not depend on what it gets)
    return one(0, first[1]), one(1, first[0]), inputs


def test_the_layout_packs_the_parts_back_to_back_and_moves_the_bytes_of_separate_messages():
    flat, state, seen_at = side(0, p=1001)
    pl = Payload(flat, state=state, seen_at=seen_at)
    s = pl.sections
    assert [(k, v.offset) for k, v in s.items()] == [("weights", 0), ("state", 4004), ("seen_at", 8008)]
    assert pl.nbytes == 1001 * 4 + 1001 * 4 + 6 * 8  # no padding: as many bytes as the three Sendrecvs of old
    assert Payload(flat).nbytes == 4004 and Payload(flat).extras == 0


@pytest.mark.parametrize("whole_max,chunk", [(1 << 30, None), (1 << 30, 128), (100, 128), (100, None)])
@pytest.mark.parametrize("a", [0.5, 0.3, 1.0, 0.0])
def test_both_sides_merge_bitwise_as_interpolate_and_get_the_partners_parts(whole_max, chunk, a):
    (f0, g0, w0), (f1, g1, w1), inputs = run_pair(a, whole_max, chunk)
    for flat, got, wire, mine, theirs in ((f0, g0, w0, inputs[0], inputs[1]), (f1, g1, w1, inputs[1], inputs[0])):
        ref = mine[0].clone()
        merge.interpolate_(ref, theirs[0], a)
        assert torch.equal(flat, ref)
        assert torch.equal(got.state, torch.cat(theirs[1])) and torch.equal(got.my_state, torch.cat(mine[1]))
        assert np.array_equal(got.seen_at, theirs[2])
        assert wire.bytes_sent == Payload(mine[0], state=mine[1], seen_at=mine[2]).nbytes
        assert wire.messages == (1 if whole_max > 100 else len(range(0, 1001, chunk or 1001)) + 1)
        true = float(torch.dist(mine[0].double(), theirs[0].double()))
        assert got.distance == pytest.approx(true, rel=1e-6)


def test_a_payload_received_whole_gives_the_distance_of_the_chunked_swap_bit_for_bit():
    (f0, g0, _), _, inputs = run_pair(0.5, 1 << 30, chunk=128, moments=False, seen=False)
    flat = inputs[0][0].clone()
    wire = Wire([inputs[1][0][lo: lo + 128].view(torch.uint8).clone() for lo in range(0, 1001, 128)])
    pair = PairExchange(wire, flat.numel(), flat.dtype)
    pair.buffers.chunk = 128
    d = swap_and_merge_chunked(wire, flat, 1, 0.5, pair.buffers)
    assert torch.equal(flat, f0) and d == g0.distance and wire.messages == 8


def test_weights_alone_are_sent_from_where_they_lie_and_a_lie_replaces_them():
    flat, _, _ = side(0)
    lie = torch.full_like(flat, 7.0)
    wire = Wire()
    got = PairExchange(wire, flat.numel(), flat.dtype).swap(Payload(flat.clone(), outgoing=lie), 1, 0.5)
    assert torch.equal(wire.sent[0].view(torch.float32), lie) and got.state is None and got.seen_at is None


def test_an_unaligned_part_is_copied_out_not_viewed():
    flat = torch.randn(3, dtype=torch.float16)  # 6 bytes of weights: the float32 moments start unaligned
    state = [torch.randn(3)]
    pl = Payload(flat, state=state, seen_at=np.array([4, -1], dtype=np.int64))
    assert pl.sections["state"].offset == 6 and pl.nbytes == 6 + 12 + 16
    wire = Wire()
    pair = PairExchange(wire, 3, flat.dtype)
    got = pair.swap(pl, 1, 0.0)
    assert torch.equal(got.my_state, state[0]) and np.array_equal(got.seen_at, [0, 0])
    assert np.array_equal(wire.sent[0][18:].numpy().view(np.int64), [4, -1])


def test_header_refuses_partners_whose_optimizer_moments_differ():
    mine = Header(1.0, 0.5, 10, 20, False)
    wire = Wire([Header(1.0, 0.5, 10, 30, False).to_array()])
    with pytest.raises(RuntimeError, match="optimizers differ"):
        PairExchange(wire, 10, torch.float32).swap_headers(mine, 1)
    wire = Wire([Header(1.0, 0.5, 10, 0, False).to_array()])  # no moments on one side: nothing travels, no error
    assert PairExchange(wire, 10, torch.float32).swap_headers(mine, 1).state == 0


# --------------------------------------------------------------------------- both ends at once


class ThreadWire(Traffic):
    """One end of an in-process pair whose two ends run in two threads: what one sends, the other receives.

    ``parts``: offers ``sendrecv_parts`` (as ``World`` does), recording where each message's bytes lay."""

    def __init__(self, rank, inbox, outbox, parts=True):
        super().__init__()
        self.rank, self.inbox, self.outbox, self.messages = rank, inbox, outbox, []
        if not parts:
            self.sendrecv_parts = None

    def _swap(self, tag, payload):
        self.outbox.put((tag, payload))
        got_tag, got = self.inbox.get(timeout=60)
        assert got_tag == tag, (got_tag, tag)
        return got

    def sendrecv(self, send, recv, peer, tag=0):
        raw = send.reshape(-1).view(torch.uint8)
        self.messages.append([raw.data_ptr()])
        recv.reshape(-1).view(torch.uint8).copy_(self._swap(tag, raw.clone()))
        self.bytes_sent += raw.numel()

    def sendrecv_parts(self, parts, recv, peer, tag=0):
        raws = [t.reshape(-1).view(torch.uint8) for t in parts]
        self.messages.append([r.data_ptr() for r in raws])
        recv.reshape(-1).view(torch.uint8).copy_(self._swap(tag, torch.cat(raws)))
        self.bytes_sent += sum(r.numel() for r in raws)

    def sendrecv_array(self, send, peer, tag=0):
        got = self._swap(tag, np.array(send, copy=True))
        self.bytes_sent += send.nbytes
        return got


def both_ends(fn, parts=True):
    """``fn(wire)`` on both ends of a pair at once; their results, side 0 first."""
    queues = [queue.Queue(), queue.Queue()]
    wires = [ThreadWire(i, queues[i], queues[1 - i], parts) for i in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(fn, w) for w in wires]
        return [f.result(timeout=120) for f in futures]


BIG = exchange.SHARE_MIN + 1001  # two chunks and more: each side computes the distance over its half


@pytest.mark.parametrize("whole_max", [1 << 30, 1000])
@pytest.mark.parametrize("a", [0.5, 0.3, 1.0])
def test_a_big_model_splits_the_distance_between_the_sides_who_log_the_same_one(a, whole_max):
    inputs = [side(s, p=BIG, moments=False, seen=False)[0] for s in (0, 1)]

    def run(wire):
        flat = inputs[wire.rank].clone()
        pair = PairExchange(wire, flat.numel(), flat.dtype, whole_max=whole_max)
        assert pair.halves(BIG, 1 - wire.rank) == ((0, BIG // 2 // exchange.CHUNK * exchange.CHUNK) if wire.rank == 0
                                                   else (BIG // 2 // exchange.CHUNK * exchange.CHUNK, BIG))
        got = pair.swap(Payload(flat), 1 - wire.rank, a)
        return flat, got.distance, wire

    (f0, d0, w0), (f1, d1, w1) = both_ends(run)
    exact = float(torch.dist(inputs[0].double(), inputs[1].double()))
    assert d0 == d1 and d0 == pytest.approx(exact, rel=1e-6)  # the same bits on both sides
    for flat, mine, theirs, wire in ((f0, inputs[0], inputs[1], w0), (f1, inputs[1], inputs[0], w1)):
        want = mine.clone()
        merge.interpolate_(want, theirs, a)
        assert torch.equal(flat, want)
        assert wire.bytes_sent == BIG * 4 and wire.bytes_monitoring == 8  # the halves' sums: monitoring


def test_the_distance_of_a_big_model_has_the_same_bits_received_whole_or_in_chunks():
    inputs = [side(s, p=BIG, moments=False, seen=False)[0] for s in (0, 1)]
    dists = {}
    for whole_max in (1 << 30, 1000):
        def run(wire, whole_max=whole_max):
            flat = inputs[wire.rank].clone()
            return PairExchange(wire, BIG, flat.dtype, whole_max=whole_max).swap(Payload(flat), 1 - wire.rank,
                                                                                   0.5).distance
        dists[whole_max] = both_ends(run)
    assert dists[1 << 30] == dists[1000]


def test_a_liar_logs_the_distance_of_its_weights_and_its_partner_that_of_the_lie():
    inputs = [side(s, p=BIG, moments=False, seen=False)[0] for s in (0, 1)]
    lie = inputs[0] + 1.0

    def run(wire):
        flat = inputs[wire.rank].clone()
        payload = Payload(flat, outgoing=lie if wire.rank == 0 else None)
        return flat, PairExchange(wire, BIG, flat.dtype).swap(payload, 1 - wire.rank, 0.5).distance

    (f0, d0), (f1, d1) = both_ends(run)
    assert d0 == pytest.approx(float(torch.dist(inputs[0].double(), inputs[1].double())), rel=1e-6)
    assert d1 == pytest.approx(float(torch.dist(inputs[1].double(), lie.double())), rel=1e-6)
    want0, want1 = inputs[0].clone(), inputs[1].clone()
    merge.interpolate_(want0, inputs[1], 0.5)
    merge.interpolate_(want1, lie, 0.5)
    assert torch.equal(f0, want0) and torch.equal(f1, want1)


@pytest.mark.parametrize("parts", [True, False])
def test_big_parts_go_from_where_they_lie_small_ones_packed_and_moments_merge_in_place_bitwise(parts):
    big = exchange.PART_MIN // 4  # float32 elements of a part sent as it lies
    g = torch.Generator().manual_seed(3)
    inputs = []
    for _ in (0, 1):
        flat = torch.randn(big + 5, generator=g)
        moments = [torch.randn(big, generator=g), torch.randn(7, generator=g), torch.randn(3, generator=g),
                   torch.randn(big + 1, generator=g)]
        inputs.append((flat, moments, np.arange(5, dtype=np.int64) * (len(inputs) + 2)))

    def run(wire):
        flat, moments, seen = (t.clone() for t in inputs[wire.rank][:2]), None, inputs[wire.rank][2].copy()
        flat, moments = next(flat), [m.clone() for m in inputs[wire.rank][1]]
        payload = Payload(flat, state=moments, seen_at=seen)
        got = PairExchange(wire, flat.numel(), flat.dtype).swap(payload, 1 - wire.rank, 0.3)
        got.merge_state_(0.3)
        return flat, moments, got, wire, [m.data_ptr() for m in moments]

    for rank, (flat, moments, got, wire, ptrs) in enumerate(both_ends(run, parts)):
        mine, theirs = inputs[rank], inputs[1 - rank]
        packed = torch.cat(mine[1])
        merge.interpolate_(packed, torch.cat(theirs[1]), 0.3)  # what the packed merge gave, moment by moment
        assert torch.equal(torch.cat(moments), packed)
        assert np.array_equal(got.seen_at, theirs[2])
        want = mine[0].clone()
        merge.interpolate_(want, theirs[0], 0.3)
        assert torch.equal(flat, want)
        (sent,) = wire.messages
        if parts:  # weights and the two big moments from where they lie; the small ones and seen_at packed
            assert sent[0] == flat.data_ptr() and sent[1] == ptrs[0] and sent[3] == ptrs[3] and len(sent) == 5
            assert sent[2] not in ptrs and sent[4] not in ptrs
        else:
            assert len(sent) == 1  # a world without sendrecv_parts: the whole payload packed
