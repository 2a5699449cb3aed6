"""A leg handed back by a worker that changes role (its final event says `moved`) with scripted
legs (`scripted_model.py`): the request continues split, its prefill leg on the worker that
handed it back resuming the parked leg (`resume`) from just before the last token the client
has, its decode on another decode worker; the client sees one seamless stream with exactly the
tokens an undisturbed run gives, and the worker is not counted as failed."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.legs.protocol import LegKind
from tests.router.scripted_model import ScriptedModel, reference
from tests.router.test_dispatch_migration import (
    GREEDY,
    LONG,
    SEEDED,
    SHORT,
    collect,
    dispatcher,
    expected_text,
    worker_of,
)

REASON = "handed back by a worker changing role"


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["local", "split"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_handed_back_stream_goes_on_split_with_its_prefill_where_its_kv_is(prompt,
                                                                             params) -> None:
    model = ScriptedModel(hand_back_after={"http://d0": 5})
    d = dispatcher(model)
    out, events = asyncio.run(collect(d, prompt, params))
    want = reference(prompt, 12, params.seed)
    assert out.token_ids == want and out.text == expected_text(want)
    assert out.finish_reason == "length"
    indices = [e.index for e in events]  # one stream; a decode leg repeats its token 0
    assert indices == sorted(indices) and sorted(set(indices)) == list(range(12))
    first = model.kinds()[:2 if prompt is LONG else 1]
    assert ("http://d0", LegKind.DECODE if prompt is LONG else LegKind.LOCAL, "cmpl-1") in first
    assert model.kinds()[len(first):] == [("http://d0", LegKind.PREFILL, "cmpl-1.2"),
                                          ("http://d1", LegKind.DECODE, "cmpl-1.2")]
    pre, dec = model.legs("http://d0")[-1], model.legs("http://d1")[0]
    # one token before the last the client has: the worker parked the KV of every token but
    # the last (whose KV it never computed), and repeats that one as token 0
    assert pre.prompt_token_ids == dec.prompt_token_ids == (*prompt, *want[:4])
    assert pre.output_offset == dec.output_offset == 4
    assert (pre.resume, dec.resume) == ("cmpl-1", None)
    assert dec.params.max_tokens == 8 and pre.peer == worker_of(d, "http://d1").peer
    assert worker_of(d, "http://d0").healthy  # handing back is no failure
    assert d.breakers.of(worker_of(d, "http://d0")).failures == 0
    assert d.metrics.migrations.value(reason=REASON) == 1


def test_a_hand_back_does_not_use_up_the_moves_a_failure_may_make() -> None:
    model = ScriptedModel(hand_back_after={"http://d0": 3}, lose_after={"http://d1": 6})
    d = dispatcher(model, max_migrations=1)
    out, _ = asyncio.run(collect(d, SHORT, GREEDY))
    assert out.token_ids == reference(SHORT, 12)  # d0 -> (d0 prefill, d1) -> d0 local
    assert d.metrics.migrations.value(reason=REASON) == 1


def test_a_hand_back_resumes_where_the_text_was_last_whole() -> None:
    # the text of token 3 is held back (an incomplete character) and sent with token 4; the
    # leg is handed back after token 4: its KV covers tokens 0-3, whose text is whole up to 3
    model = ScriptedModel(hand_back_after={"http://d0": 5}, hold_back={"http://d0": {3}})
    d = dispatcher(model)
    out, _ = asyncio.run(collect(d, SHORT, GREEDY))
    want = reference(SHORT, 12)
    assert out.token_ids == want and out.text == expected_text(want)
    pre = model.legs("http://d0")[-1]
    assert pre.kind is LegKind.PREFILL and pre.resume == "cmpl-1"
    assert pre.prompt_token_ids == (*SHORT, *want[:3]) and pre.output_offset == 3
