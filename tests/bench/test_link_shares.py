"""The incast rows of `pdserve bench transfer --testbed`: the arithmetic of their shares
(`link_shares.py`: bytes delivered read off samples, each sender's part of them, Jain's
index), the bench's refusal of bad input, and its receiver process never left behind."""

from __future__ import annotations

import multiprocessing

import pytest

from pdserve.bench import link_bench, link_receiver, link_shares
from pdserve.testbed.topology import LinkShape, Topology
from pdserve.transfer.tcp import TcpOptions


def test_bytes_at_interpolates_between_samples_and_holds_outside_them() -> None:
    samples = [(0.0, 0), (1.0, 100), (3.0, 300)]
    assert link_shares.bytes_at(samples, -1.0) == 0.0
    assert link_shares.bytes_at(samples, 0.5) == pytest.approx(50.0)
    assert link_shares.bytes_at(samples, 2.0) == pytest.approx(200.0)
    assert link_shares.bytes_at(samples, 9.0) == 300.0
    assert link_shares.bytes_at([], 1.0) == 0.0
    assert link_shares.bytes_at([(1.0, 5), (1.0, 7)], 1.0) == 5.0  # at the first sample


def test_shares_sum_to_one_and_split_evenly_when_nothing_moved() -> None:
    assert link_shares.shares([1.0, 3.0]) == [0.25, 0.75]
    assert link_shares.shares([0.0, 0.0, 0.0]) == [pytest.approx(1 / 3)] * 3


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert link_shares.jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert link_shares.jain([9.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert link_shares.jain([3.0, 1.0]) == pytest.approx(16 / 20)
    assert link_shares.jain([]) == 1.0


def test_the_contended_stretch_ends_with_the_first_sender_done() -> None:
    assert link_shares.contended_at([2.5, 1.5, 3.0]) == 1.5


def test_the_bench_refuses_zero_senders_before_making_anything() -> None:
    with pytest.raises(ValueError, match="--senders"):
        link_bench.main([1.0], LinkShape(), [1], 1, False, senders=[0])



def test_a_receiver_whose_start_is_interrupted_is_killed_at_once(monkeypatch) -> None:
    """Ctrl-C while the parent waits for the child's endpoint: the child (still starting; it
    would fail later, its namespace does not exist) is gone when the error comes out."""
    def interrupted(self, conn, proc) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(link_receiver.Receiver, "__init__", interrupted)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(KeyboardInterrupt), \
            link_receiver.receiver(Topology(("d0",), prefix="pdsnone-"), TcpOptions(), 4):
        pass
    assert {p.pid for p in multiprocessing.active_children()} <= before
