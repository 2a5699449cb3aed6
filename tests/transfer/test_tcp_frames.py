"""A write cut into frames, and control messages that do not wait behind queued bulk data."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.tcp import TcpOptions, TcpTransport
from pdserve.transfer.tcp.chunks import plan
from pdserve.transfer.tcp.send_queue import SendQueue
from tests.transfer.test_tcp import OPTS, SECRET, finish, pool


def _covered(chunks, num_blocks: int, first: int, end: int) -> list[tuple[int, int]]:
    return [(b, layer) for c in chunks for b in range(num_blocks)[c.blocks]
            for layer in range(c.first, c.end)]


@pytest.mark.parametrize(("blocks", "first", "end", "budget"), [
    (7, 0, 30, 100 * 30),  # whole blocks, several a frame
    (3, 0, 30, 10 * 30 * 7),  # everything in one frame
    (2, 4, 30, 100 * 5),  # one block and five layers a frame
    (5, 0, 3, 1),  # a budget below one slice: one slice a frame
    (4, 0, 8, 0),  # no budget: one frame
])
def test_frames_cover_each_slice_once_in_order_within_the_budget(blocks, first, end,
                                                                 budget) -> None:
    layer_nbytes = 100
    chunks = plan(blocks, first, end, layer_nbytes, budget)
    assert _covered(chunks, blocks, first, end) == [
        (b, layer) for b in range(blocks) for layer in range(first, end)]
    for c in chunks:
        size = len(range(blocks)[c.blocks]) * (c.end - c.first) * layer_nbytes
        assert budget == 0 or size <= max(budget, layer_nbytes)


def test_the_queue_hands_out_urgent_jobs_first_and_resumes_bulk_at_the_head() -> None:
    q = SendQueue(limit=4)
    assert q.put(("write", "a"), urgent=False) and q.put(("write", "b"), urgent=False)
    assert q.put(("control", 1), urgent=True)
    assert q.get() == ("control", 1)
    assert q.get() == ("write", "a")
    q.resume(("write", "a-rest"))
    assert q.put(("control", 2), urgent=True)
    assert [q.get(), q.get(), q.get()] == [("control", 2), ("write", "a-rest"), ("write", "b")]
    assert all(q.put(("control", i), urgent=True) for i in range(4))
    assert not q.put(("control", 5), urgent=True), "a full queue refuses"
    q.stop()
    assert q.get() is None


def test_a_control_message_overtakes_writes_queued_before_it() -> None:
    src, dst = pool(4096, seed=3), pool(4096)
    writes = [list(range(i, i + 512)) for i in range(0, 4096, 512)]  # 16 MiB each
    with TcpTransport(secret=SECRET, options=OPTS) as w, \
            TcpTransport(secret=SECRET, options=OPTS) as r:
        w.register(src)
        r.register(dst)
        for tid, blocks in enumerate(writes):
            r.allow_writes(tid, w.local, blocks)
        w.send(r.local, b"hello")
        while not r.receive():
            pass
        handles = [w.write(tid, b, r.local, b) for tid, b in enumerate(writes)]
        w.send(r.local, b"urgent")
        while not r.receive():
            pass
        last = writes[-1]
        assert not torch.equal(dst.data[last], src.data[last]), \
            "the control message waited behind every queued write"
        assert [finish(w, h) for h in handles] == ["done"] * len(writes)
        assert torch.equal(dst.data, src.data)


def test_a_negative_frame_time_is_refused() -> None:
    with pytest.raises(ValueError, match=r"frame_s must be >= 0 \(0: whole writes\)"):
        TcpOptions(frame_s=-0.001)


def test_the_pace_keeps_the_last_rate_of_a_full_sender(monkeypatch) -> None:
    """Between transfers the kernel's sample is app-limited (the tail, a control message):
    the link report then gives the last rate read while the sender filled the link."""
    from pdserve.transfer.tcp import frame_pace
    from pdserve.transfer.tcp.tcp_info import TcpInfo
    samples = iter([TcpInfo(0, True, 100, 50, 0), TcpInfo(120_000_000, False, 100, 50, 1 << 20),
                    TcpInfo(3_000_000, True, 100, 50, 2 << 20)])
    monkeypatch.setattr(frame_pace, "tcp_info", lambda sock: next(samples))
    pace = frame_pace.FramePace(0.002)
    pace.observe(None)
    assert pace.full_rate == 0 and pace.bytes == frame_pace.START  # nothing acknowledged yet
    pace.observe(None)
    assert pace.full_rate == 120_000_000 and pace.bytes == 240_000
    pace.observe(None)  # the tail of the transfer: sized down, the full rate kept
    assert pace.full_rate == 120_000_000 and pace.bytes == frame_pace.MIN_BYTES
