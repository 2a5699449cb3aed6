"""Transfer state machine: ordered, monotonic, terminal DONE and FAILED; exhaustive moves."""

from __future__ import annotations

import itertools
import threading

import pytest

from pdserve.transfer.state import TransferState, TransferStatus

S = TransferState
LIVE = [s for s in S if not s.is_terminal]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _advance(status: TransferStatus, new: TransferState) -> bool:
    return status.advance(new, "boom" if new is S.FAILED else None)


def test_order_and_terminal_states():
    assert S.BOOTSTRAPPING < S.WAITING_FOR_BLOCKS < S.TRANSFERRING < S.DONE < S.FAILED
    assert {s for s in S if s.is_terminal} == {S.DONE, S.FAILED}
    assert all(s.is_terminal == (s >= S.DONE) for s in S)


@pytest.mark.parametrize(("start", "new"), list(itertools.product(LIVE, list(S))))
def test_every_single_move_from_a_live_state(start, new):
    status = TransferStatus(start)
    moved = _advance(status, new)
    assert moved == (new > start)
    assert status.state == max(start, new)
    assert (status.reason == "boom") == (moved and new is S.FAILED)


@pytest.mark.parametrize(("final", "new"), list(itertools.product([S.DONE, S.FAILED], list(S))))
def test_nothing_moves_a_finished_transfer(final, new):
    clock = FakeClock()
    status = TransferStatus(clock=clock)
    _advance(status, final)
    reason, stamps = status.reason, {s: status.entered_at(s) for s in S}
    assert not _advance(status, new)
    assert status.state == final and status.reason == reason
    assert {s: status.entered_at(s) for s in S} == stamps


def test_every_sequence_of_four_moves_is_monotonic():
    for moves in itertools.product(list(S), repeat=4):
        status = TransferStatus()
        expected = S.BOOTSTRAPPING
        for new in moves:
            before = status.state
            _advance(status, new)
            if not expected.is_terminal and new > expected:
                expected = new
            assert status.state == expected >= before, moves


def test_timestamps_record_entered_states_only():
    clock = FakeClock()
    status = TransferStatus(clock=clock)
    assert status.entered_at(S.BOOTSTRAPPING) == 101.0
    status.advance(S.TRANSFERRING)  # skips WAITING_FOR_BLOCKS: blocks were already reserved
    status.advance(S.DONE)
    assert status.entered_at(S.WAITING_FOR_BLOCKS) is None
    assert status.entered_at(S.TRANSFERRING) == 102.0 and status.entered_at(S.DONE) == 103.0
    assert status.entered_at(S.FAILED) is None and status.reason is None


def test_fail_records_the_reason_once():
    status = TransferStatus(S.TRANSFERRING)
    assert status.fail("crc mismatch in block 7")
    assert not status.fail("timeout")
    assert status.state is S.FAILED and status.reason == "crc mismatch in block 7"
    assert "crc mismatch" in repr(status)


def test_reason_goes_with_failed_only():
    status = TransferStatus()
    with pytest.raises(ValueError, match="reason"):
        status.advance(S.FAILED)
    with pytest.raises(ValueError, match="reason"):
        status.advance(S.FAILED, "")
    with pytest.raises(ValueError, match="reason"):
        status.advance(S.DONE, "why")
    assert status.state is S.BOOTSTRAPPING


@pytest.mark.parametrize("terminal", [S.DONE, S.FAILED])
def test_a_transfer_cannot_start_finished(terminal):
    with pytest.raises(ValueError, match="below DONE"):
        TransferStatus(terminal)


def _race(status: TransferStatus, results: list[bool]) -> list[threading.Thread]:
    return [threading.Thread(target=lambda: results.append(status.advance(S.DONE))),
            threading.Thread(target=lambda: results.append(status.fail("late")))]


def test_racing_done_and_fail_leave_one_winner():
    for _ in range(20):
        status = TransferStatus(S.TRANSFERRING)
        results: list[bool] = []
        threads = _race(status, results)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, True]
        assert status.state.is_terminal
        assert (status.reason is None) == (status.state is S.DONE)
