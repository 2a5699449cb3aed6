"""Merging a disaggregated request's legs, one batch at a time: what reaches the client."""

from __future__ import annotations

from pdserve.legs.protocol import TokenEvent
from pdserve.router.dispatch import _relayed


def ev(i: int, **kw) -> TokenEvent:
    return TokenEvent(i, [100 + i], i, "x", **kw)


def test_prefill_token0_goes_on_and_ends_the_request_only_if_it_finished_it() -> None:
    out, failure = _relayed("prefill", [ev(0, final=True)])
    assert out == [ev(0, final=False)] and failure is None
    out, failure = _relayed("prefill", [ev(0, finish_reason="stop", final=True)])
    assert out[0].final and failure is None


def test_a_prefill_error_is_dropped() -> None:
    assert _relayed("prefill", [ev(0, error="lost", final=True)]) == ([], None)


def test_decode_batch_goes_on_up_to_its_final_event() -> None:
    batch = [ev(0), ev(1), ev(2, finish_reason="length", final=True), ev(3)]
    assert _relayed("decode", batch) == (batch[:3], None)


def test_decode_drops_prefill_finished_and_stops_at_an_error() -> None:
    done = ev(0, final=True, extra={"prefill_finished": True})
    assert _relayed("decode", [done]) == ([], None)
    out, failure = _relayed("decode", [ev(1), ev(2), ev(3, error="worker died", final=True)])
    assert out == [ev(1), ev(2)]  # what came before the error still goes to the client
    assert failure is not None and str(failure) == "worker died"
