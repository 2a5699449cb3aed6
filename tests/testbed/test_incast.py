"""Several prefill hosts pushing into one decode host at once (`pdserve bench transfer
--testbed --senders K`'s incast rows): every write lands intact, each sender gets a real
share of d0's link, control messages from every sender get through while the link is full,
and the bench's testbed is gone afterwards, also when the run fails or is interrupted."""

from __future__ import annotations

import pytest

from pdserve.bench import link_incast
from pdserve.testbed import state
from pdserve.testbed.topology import LinkShape
from tests.testbed.conftest import assert_nothing_left, skip_without_namespaces

SHAPE = LinkShape(gbps=1)
SENDERS = 2
EACH = 2  # writes per sender


def test_two_senders_share_the_decode_link_and_every_write_lands_intact() -> None:
    skip_without_namespaces()
    with link_incast.incast_bed(SHAPE, SENDERS) as topology:
        links = state.load(topology.prefix).links
        assert links["d0"].gbps == SHAPE.gbps  # the bottleneck
        assert all(links[h].gbps > SHAPE.gbps for h in ("p0", "p1"))
        row, senders = link_incast.incast(topology, SHAPE, window=True, concurrent=EACH,
                                          repeats=3)
    assert_nothing_left(topology.prefix)
    assert row.intact, row
    assert (row.senders, row.concurrent) == (SENDERS, EACH)
    assert [s.sender for s in senders] == ["p0", "p1"]
    for s in senders:  # a fair share is 1 / 2; starved would be near 0
        assert s.share > 0.5 / SENDERS, senders
        assert s.control_messages > 5, senders
    assert row.control_messages == sum(s.control_messages for s in senders)
    # with the window, a control message waits for a frame, not behind a write's bytes
    one_write_ms = row.ideal_ms / (SENDERS * EACH)
    assert row.control_p50_ms < one_write_ms / 4, row
    # the link stays busy: the last write ends near the ideal, K x N writes at the link's rate
    # (the median burst: one stalled repeat does not decide)
    assert row.last_of_ideal < 1.5, row


@pytest.mark.parametrize("stop", [RuntimeError("a failed run"), KeyboardInterrupt()])
def test_the_incast_testbed_is_removed_when_the_run_stops(stop: BaseException) -> None:
    skip_without_namespaces()
    made = None
    with pytest.raises(type(stop)), link_incast.incast_bed(SHAPE, SENDERS) as topology:
        made = topology
        raise stop
    assert made is not None
    assert_nothing_left(made.prefix)
