"""The elastic controller's arrival window (`elastic_window.py`): the stretch of time its rates
are measured over is the sustain window when that holds 8 prompts, longer when prompts are rare,
and never more than about a minute."""

from __future__ import annotations

import pytest

from pdserve.router.elastic_window import ArrivalWindow, Window
from pdserve.router.split_decision import PrefillBacklog, Sent


def play(window: ArrivalWindow, backlog: PrefillBacklog, until: int,
         arrivals: dict[int, list[tuple[str, int]]]) -> None:
    """One sample a second from 0 to `until`; `arrivals[t]`: prompts sent just before t."""
    for t in range(until + 1):
        for worker, tokens in arrivals.get(t, []):
            backlog.add(worker, tokens)()
        window.sample(float(t), backlog.sent())


def test_a_busy_stream_is_measured_over_the_sustain_window() -> None:
    window, backlog = ArrivalWindow(), PrefillBacklog()
    play(window, backlog, 10, {t: [("p", 100), ("d", 50), ("d", 50)] for t in range(1, 11)})
    assert window.window(3.0) == Window(3.0, {"p": Sent(3, 300), "d": Sent(6, 300)})


def test_a_rare_stream_is_measured_over_its_last_8_prompts() -> None:
    window, backlog = ArrivalWindow(), PrefillBacklog()
    play(window, backlog, 40, {t: [("p", 1500)] for t in range(1, 41, 3)})  # 1, 4, ..., 40
    assert window.window(3.0) == Window(22.0, {"p": Sent(8, 12000)})  # 19, 22, ..., 40


def test_no_window_before_two_samples_and_the_whole_past_when_it_is_short() -> None:
    window, backlog = ArrivalWindow(), PrefillBacklog()
    assert window.window(3.0) == Window()
    play(window, backlog, 0, {})
    assert window.window(3.0) == Window(0.0, {}) == Window()
    play(window, backlog, 2, {1: [("p", 100)]})  # 0, 0, 1, 2: one prompt in two seconds
    assert window.window(3.0) == Window(2.0, {"p": Sent(1, 100)})


def test_the_window_reaches_about_a_minute_back_at_most() -> None:
    window, backlog = ArrivalWindow(max_s=60.0), PrefillBacklog()
    play(window, backlog, 200, {5: [("p", 1500)] * 20})
    assert window.window(3.0) == Window(60.0, {"p": Sent(0, 0)})


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_prompts must be an int >= 1, got 0"):
        ArrivalWindow(min_prompts=0)
    with pytest.raises(ValueError, match="max_s must be > 0 seconds, got 0"):
        ArrivalWindow(max_s=0)
