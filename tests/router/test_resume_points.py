"""Where a continuation may start when a token's text is held back (an incomplete UTF-8
character): the client's text must be the undisturbed stream's, character for character.

Seen under load with role flips: a decode leg's first event carries the prefill's token 0 (with
its text) and token 1, whose byte starts a character (no text yet); taking that event's end as
a point where every token's text was sent, a hand-back continued after token 1, and the client
lost the next token's first character. Workers here are emulated with the real detokenizer on
the tiny test tokenizer: events as `EngineLoop._token_event` builds them."""

from __future__ import annotations

from pdserve.api.assembler import StreamAssembler
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request
from pdserve.legs.protocol import TokenEvent
from pdserve.router.migration import Delivered, continuation
from pdserve.testing.tiny_models import tiny_tokenizer

TOK = tiny_tokenizer()
# byte-level tokens: 0x0F, a lead byte of a 3-byte character (0xED), " time", 0x16, a lead
# byte of a 2-byte character (0xC2), "slat"
PIECES = ["ď", "í", "Ġtime", "Ė", "Â", "slat"]
OUT = TOK.convert_tokens_to_ids(PIECES)
PROMPT = TOK.encode("a prompt:")
PARAMS = SamplingParams(max_tokens=len(OUT), temperature=0.0, ignore_eos=True)


class Worker:
    """One leg's detokenizer and the events it sends, as a worker's engine loop makes them."""

    def __init__(self, prompt: list[int]) -> None:
        self.detok = IncrementalDetokenizer(TOK, prompt)
        self.tokens, self.sent_tokens, self.sent_chars = 0, 0, 0

    def event(self, token_ids: list[int]) -> TokenEvent:
        for t in token_ids:
            self.detok.add(t)
        self.tokens += len(token_ids)
        text = self.detok.text
        ev = TokenEvent(index=self.sent_tokens, token_ids=list(token_ids),
                        text_offset=self.sent_chars, text=text[self.sent_chars:],
                        held_tokens=self.detok.held_tokens)
        self.sent_tokens, self.sent_chars = self.tokens, len(text)
        return ev


def _client_gets(delivered: Delivered, client: StreamAssembler, events: list[TokenEvent]
                 ) -> None:
    for ev in events:
        delivered.add([ev])
        client.add(ev)


def test_the_tokens_are_single_bytes_of_the_tiny_tokenizer() -> None:
    assert TOK.unk_token_id not in OUT and len(set(OUT)) == len(OUT)
    assert TOK.decode(OUT[:2]).endswith("\ufffd") and TOK.decode(OUT[:3]).count("\ufffd") == 1


def test_a_token_whose_text_is_held_is_no_point_to_resume_from() -> None:
    prefill, decode = Worker(PROMPT), Worker(PROMPT)
    delivered, client = Delivered(), StreamAssembler()
    # token 0 from the prefill leg; the decode leg repeats it with token 1, then token 2
    _client_gets(delivered, client, [prefill.event(OUT[:1]), decode.event(OUT[:2]),
                                     decode.event(OUT[2:3])])
    assert client.text == TOK.decode(OUT[:3])
    # token 1's byte had no text of its own: the last point before token 2 is after token 0
    assert delivered.resume_before(2) == (1, 1)
    assert delivered.resume_at == (3, len(TOK.decode(OUT[:3])))


def test_a_continuation_from_just_before_the_last_token_loses_no_character() -> None:
    """A hand-back continues from before the last token the client has (`before`), on a
    worker whose detokenizer starts after the continuation's prompt."""
    prefill, decode = Worker(PROMPT), Worker(PROMPT)
    delivered, client = Delivered(), StreamAssembler()
    _client_gets(delivered, client, [prefill.event(OUT[:1]), decode.event(OUT[:2]),
                                     decode.event(OUT[2:3])])
    leg, relay = continuation("r.1", PROMPT, PARAMS, delivered,
                              before=len(delivered.token_ids) - 1)
    k = leg.output_offset
    assert list(leg.prompt_token_ids) == PROMPT + OUT[:k]
    # the continuation's decode worker: token 0 (a repeat) with token 1, then one at a time
    cont = Worker(list(leg.prompt_token_ids))
    events = [cont.event(OUT[k:k + 2])] + [cont.event([t]) for t in OUT[k + 2:]]
    shifted, error = relay(events)
    assert error is None
    _client_gets(delivered, client, shifted)
    assert client.token_ids == OUT
    assert client.text == TOK.decode(OUT) == delivered.text


def test_held_tokens_survive_the_wire() -> None:
    ev = TokenEvent(index=3, token_ids=[1, 2], text_offset=4, text="x", held_tokens=1)
    assert TokenEvent.from_line(ev.to_line()) == ev
    assert b"held_tokens" not in TokenEvent(0, [1], 0, "a").to_line()  # the default: unsent


def test_the_engine_says_which_tokens_wait_for_their_text() -> None:
    """The engine's outputs (what a worker's events are made of) count the held tokens."""
    proc = OutputProcessor(TOK, eos_token_ids=(), max_model_len=64)
    req = Request("r", list(PROMPT), len(PROMPT), PARAMS)
    proc.add(req, None)
    held = []
    for t in OUT[:5]:
        proc.append_token(req, t, None, None)
        held.append(proc.make_output(req).outputs[0].held_tokens)
    # 0x0F; 0xED waits; " time" completes it; 0x16; 0xC2 waits
    assert held == [0, 1, 0, 0, 1]
