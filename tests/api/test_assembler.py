"""The router's merge of leg streams (each position once, text and logprobs in step) and the
leg protocol's JSON (LegRequest, TokenEvent NDJSON lines)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from pdserve.api.assembler import Delta, StreamAssembler
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import LegKind, LegRequest, TokenEvent
from pdserve.transfer.peer import PeerId

PEER = PeerId(0xF00D_0000_0000_BEEF, "10.0.0.2", 7200)
TID = 0xDEAD_BEEF_0000_0001  # above 2**63: a JSON number would lose it
PARAMS = SamplingParams(max_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=2**62,
                        stop=("\n\n", "END"), stop_token_ids=(2, 3), logprobs=2)


def ev(index: int, ids: list[int], offset: int, text: str, **kw: Any) -> TokenEvent:
    return TokenEvent(index=index, token_ids=ids, text_offset=offset, text=text, **kw)


def lp(*ids: int) -> dict[str, Any]:
    """Logprobs for tokens `ids`: token t has logprob -t/10 and two alternatives."""
    return {"logprobs": [-t / 10 for t in ids],
            "top_logprobs": [{t: -t / 10, t + 1: -1.5} for t in ids]}


# -- merging legs --------------------------------------------------------------------------------


def test_prefill_token0_then_decode_stream_that_repeats_it():
    a = StreamAssembler()
    d0 = a.add(ev(0, [11], 0, "Hello", prompt_tokens=5, cached_tokens=4, final=True, **lp(11)))
    assert d0 == Delta([11], "Hello", [-1.1], [{11: -1.1, 12: -1.5}])
    d1 = a.add(ev(0, [11, 12], 0, "Hello world", **lp(11, 12)))  # decode repeats token 0
    assert d1 == Delta([12], " world", [-1.2], [{12: -1.2, 13: -1.5}])
    d2 = a.add(ev(2, [13], 11, "!", finish_reason="stop", stop_reason="!", final=True, **lp(13)))
    assert d2 == Delta([13], "!", [-1.3], [{13: -1.3, 14: -1.5}])
    assert (a.token_ids, a.text) == ([11, 12, 13], "Hello world!")
    assert a.logprobs == [-1.1, -1.2, -1.3]
    assert a.top_logprobs == [{11: -1.1, 12: -1.5}, {12: -1.2, 13: -1.5}, {13: -1.3, 14: -1.5}]
    assert (a.finish_reason, a.stop_reason, a.cached_tokens) == ("stop", "!", 4)


def test_decode_repeating_token0_alone_adds_nothing():
    a = StreamAssembler()
    a.add(ev(0, [11], 0, "Hi"))
    assert a.add(ev(0, [11], 0, "Hi")) == Delta([], "", None, None)
    assert (a.token_ids, a.text, a.finish_reason) == ([11], "Hi", None)


def test_recompute_restarting_at_zero_adds_only_the_unseen_tail():
    a = StreamAssembler()
    a.add(ev(0, [11], 0, "Hello", **lp(11)))
    a.add(ev(1, [12, 13], 5, " world", **lp(12, 13)))
    stale = a.add(ev(0, [11, 12], 0, "Hello wo", **lp(11, 12)))  # behind what was sent
    assert stale == Delta([], "", [], [])
    new = a.add(ev(0, [11, 12, 13, 14], 0, "Hello world!", finish_reason="length", **lp(
        11, 12, 13, 14)))
    assert new == Delta([14], "!", [-1.4], [{14: -1.4, 15: -1.5}])
    assert (a.token_ids, a.text) == ([11, 12, 13, 14], "Hello world!")
    assert a.logprobs == [-1.1, -1.2, -1.3, -1.4]
    assert a.finish_reason == "length"


def test_text_and_tokens_are_trimmed_independently():
    # the detokenizer may hold text back (an incomplete UTF-8 character): token and text
    # positions advance separately
    a = StreamAssembler()
    a.add(ev(0, [11, 12], 0, "ca"))
    assert a.add(ev(0, [11, 12, 13], 0, "caf")) == Delta([13], "f", None, None)
    assert a.add(ev(3, [14], 3, "é")) == Delta([14], "é", None, None)
    assert a.text == "café"


@pytest.mark.parametrize("bad", [ev(2, [13], 5, "x"), ev(1, [12], 6, "x")],
                         ids=["token gap", "text gap"])
def test_a_gap_raises_and_changes_nothing(bad):
    a = StreamAssembler()
    a.add(ev(0, [11], 0, "Hello", **lp(11)))
    with pytest.raises(ValueError, match="expected token 1 and char 5"):
        a.add(bad)
    assert (a.token_ids, a.text, a.logprobs) == ([11], "Hello", [-1.1])


def test_cached_tokens_keep_the_largest_report():
    a = StreamAssembler()
    a.add(ev(0, [1], 0, "a", cached_tokens=16))
    a.add(ev(1, [2], 1, "b", cached_tokens=0))
    assert a.cached_tokens == 16


# -- LegRequest ------------------------------------------------------------------------------------


def roundtrip_request(req: LegRequest) -> LegRequest:
    return LegRequest.from_json(json.loads(json.dumps(req.to_json())))


@pytest.mark.parametrize("kind", [LegKind.PREFILL, LegKind.DECODE])
def test_remote_leg_round_trips_with_hex_ids(kind):
    req = LegRequest("req-1", (1, 2, 3), PARAMS, kind, TID, PEER)
    wire = req.to_json()
    assert wire["transfer_id"] == "deadbeef00000001"
    assert wire["peer"] == {"instance_id": "f00d00000000beef", "host": "10.0.0.2", "port": 7200}
    assert wire["kind"] == kind.value
    assert wire["params"]["stop"] == ["\n\n", "END"]
    back = roundtrip_request(req)
    assert back == req
    assert back.transfer_id == TID and back.peer.instance_id == PEER.instance_id


def test_local_leg_round_trips_and_kind_defaults_to_local():
    req = LegRequest("r", (5,), SamplingParams())
    wire = req.to_json()
    assert (wire["transfer_id"], wire["peer"], wire["kind"]) == (None, None, "local")
    assert roundtrip_request(req) == req
    del wire["kind"], wire["transfer_id"], wire["peer"]
    assert LegRequest.from_json(wire) == req


def test_kind_given_as_a_string_is_normalized():
    req = LegRequest("r", (1,), PARAMS, "decode", TID, PEER)  # type: ignore[arg-type]
    assert req.kind is LegKind.DECODE


@pytest.mark.parametrize(("kind", "tid", "peer"), [
    (LegKind.DECODE, TID, None),
    (LegKind.PREFILL, None, PEER),
    (LegKind.DECODE, None, None),
    (LegKind.LOCAL, TID, None),
    (LegKind.LOCAL, None, PEER),
])
def test_transfer_id_and_peer_exactly_for_remote_legs(kind, tid, peer):
    with pytest.raises(ValueError, match=f"a {kind.value} leg needs transfer_id and peer"):
        LegRequest("r", (1,), PARAMS, kind, tid, peer)


@pytest.mark.parametrize("rid", ["", 7, None])
def test_request_id_must_be_a_non_empty_string(rid):
    with pytest.raises(ValueError, match="non-empty string request_id"):
        LegRequest(rid, (1,), PARAMS)  # type: ignore[arg-type]


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="'sideways' is not a valid LegKind"):
        LegRequest("r", (1,), PARAMS, "sideways")  # type: ignore[arg-type]


def good_wire() -> dict[str, Any]:
    return LegRequest("r", (1, 2), PARAMS, LegKind.DECODE, TID, PEER).to_json()


@pytest.mark.parametrize(("change", "message"), [
    ({"params": None}, "malformed leg request"),
    ({"params": {"bogus": 1}}, "malformed leg request"),
    ({"params": {"max_tokens": 0}}, "max_tokens must be an int >= 1"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids must be a list of ints"),
    ({"prompt_token_ids": "12"}, "prompt_token_ids must be a list of ints"),
    ({"transfer_id": TID}, "transfer_id must be 16 lowercase hex digits"),
    ({"transfer_id": "DEADBEEF00000001"}, "transfer_id must be 16 lowercase hex digits"),
    ({"transfer_id": "beef"}, "transfer_id must be 16 lowercase hex digits"),
    ({"peer": {**PEER.to_json(), "extra": 1}}, "unknown keys"),
    ({"peer": None}, "a decode leg needs transfer_id and peer"),
    ({"request_id": None}, "non-empty string request_id"),
    ({"kind": "sideways"}, "not a valid LegKind"),
])
def test_from_json_names_what_is_wrong(change, message):
    wire = good_wire() | change
    with pytest.raises(ValueError, match=message):
        LegRequest.from_json(wire)


@pytest.mark.parametrize("missing", ["request_id", "prompt_token_ids", "params"])
def test_from_json_missing_field(missing):
    wire = good_wire()
    del wire[missing]
    with pytest.raises(ValueError, match=f"malformed leg request: KeyError\\('{missing}'\\)"):
        LegRequest.from_json(wire)


def test_from_json_needs_an_object():
    with pytest.raises(ValueError, match="a leg request is a JSON object"):
        LegRequest.from_json([1, 2])


# -- TokenEvent ------------------------------------------------------------------------------------


def test_token_event_line_round_trip_keeps_int_top_logprob_keys():
    e = ev(3, [7, 8], 10, "ab", logprobs=[-0.5, None], top_logprobs=[{7: -0.5, 100: -2.0}, None],
           finish_reason="stop", stop_reason=8, prompt_tokens=12, cached_tokens=8, final=True,
           extra={"prefill_finished": True})
    line = e.to_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["top_logprobs"] == [{"7": -0.5, "100": -2.0}, None]
    back = TokenEvent.from_line(line)
    assert back == e
    assert list(back.top_logprobs[0]) == [7, 100]


def test_token_event_defaults_round_trip():
    e = ev(0, [], 0, "", error="the leg failed", final=True)
    back = TokenEvent.from_line(e.to_line())
    assert back == e and back.logprobs is None and back.top_logprobs is None


def test_token_event_line_holds_only_what_differs_from_the_defaults():
    line = ev(5, [1234], 20, " word").to_line()
    assert json.loads(line) == {"index": 5, "token_ids": [1234], "text_offset": 20,
                                "text": " word"}
    # stop_reason 0 (a token id) is not the default None: it must travel
    back = TokenEvent.from_line(ev(1, [0], 0, "", stop_reason=0, finish_reason="stop").to_line())
    assert back.stop_reason == 0 and back.finish_reason == "stop"


def test_every_optional_token_event_field_has_its_default_listed():
    from pdserve.legs.protocol import _OPTIONAL_DEFAULTS

    optional = {f.name: f for f in dataclasses.fields(TokenEvent)
                if f.name not in ("index", "token_ids", "text_offset", "text")}
    listed = dict(_OPTIONAL_DEFAULTS)
    assert listed.keys() == optional.keys()
    for name, f in optional.items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert listed[name] == default, name
