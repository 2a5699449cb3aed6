"""The prefill pace: the longest chunk whose priced prompt part fits the step's budget where it
falls in its prompt (shorter as the prompt advances), at least a block; and the engine's chunks
beside a stream follow it, with the same tokens as whole prompts."""

from __future__ import annotations

import pytest

from pdserve.common.prefill_pace import PrefillPace
from tests.engine.test_prefill_chunk import LONG_PROMPT, _engine, _run


@pytest.mark.parametrize("token_s, pair_s", [(8e-4, 2.7e-7), (8e-4, 0.0), (0.0, 1e-6),
                                             (1e-5, 3e-5)])
@pytest.mark.parametrize("cached", [0, 1, 700, 5000])
def test_the_chunk_is_the_longest_whose_price_fits_the_budget(token_s: float, pair_s: float,
                                                              cached: int) -> None:
    pace = PrefillPace(0.085, token_s, pair_s, block=1)
    n = pace.tokens(cached)
    if pace.seconds(1, cached) > 0.085:  # not even one token fits: the one-block floor
        assert n == 1
    else:
        assert pace.seconds(n, cached) <= 0.085 * (1 + 1e-9) < pace.seconds(n + 1, cached)


def test_later_chunks_of_a_prompt_are_shorter_and_one_rate_keeps_them_equal() -> None:
    pace = PrefillPace(0.085, 6.5e-4, 1.3e-7, block=16)
    chunks = [pace.tokens(c) for c in (0, 500, 1000, 1500)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1] + 20
    flat = PrefillPace(0.085, 1e-3, 0.0, block=16)
    assert {flat.tokens(c) for c in (0, 500, 5000)} == {85}


def test_a_chunk_is_at_least_one_block() -> None:
    assert PrefillPace(0.001, 1e-3, 1e-6, block=16).tokens(100_000) == 16


@pytest.mark.parametrize("bad", [dict(budget_s=0.0), dict(budget_s=-1.0),
                                 dict(token_s=-1e-3), dict(pair_s=float("nan")),
                                 dict(token_s=0.0, pair_s=0.0), dict(block=0),
                                 dict(block=2.0)])
def test_a_bad_pace_is_refused(bad: dict) -> None:
    args = dict(budget_s=0.085, token_s=1e-3, pair_s=1e-7, block=16) | bad
    with pytest.raises(ValueError):
        PrefillPace(**args)


def test_the_engine_chunks_a_prompt_as_the_pace_says_with_the_same_tokens(tiny_model) -> None:
    """150 tokens beside a stream: each chunk is the pace's for the tokens computed before it
    (here 36, 25, 20, 17, then a block each), the stream decodes in every one of them, and the
    tokens are those of the whole prompt."""
    pace = PrefillPace(0.05, 1e-3, 2e-5, block=16)
    want, computed = [], 0
    while computed < len(LONG_PROMPT):
        want.append(min(pace.tokens(computed), len(LONG_PROMPT) - computed))
        computed += want[-1]
    assert want[0] > want[-2] and len(set(want)) > 2  # the pace shrinks them
    whole_tokens, _ = _run(_engine(tiny_model()), None)
    engine = _engine(tiny_model())
    engine.set_prefill_pace(pace)
    paced_tokens, steps = _run(engine, 64)  # the pace overrides the fixed chunk
    assert paced_tokens == whole_tokens
    assert [p for p, _ in steps if p] == want
    assert all(d >= 1 for p, d in steps if p)


def test_the_engine_refuses_what_is_no_pace(tiny_model) -> None:
    with pytest.raises(ValueError, match="a prefill pace is a PrefillPace or None"):
        _engine(tiny_model()).set_prefill_pace(64)  # type: ignore[arg-type]
