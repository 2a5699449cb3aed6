"""The most bytes a request that fits the context can need: what a body is refused beyond,
before it is parsed."""

from __future__ import annotations

import json

from pdserve.api.body import useful_body_bytes
from pdserve.api.limits import RequestLimits

LIMITS = RequestLimits()


def test_unknown_context_or_tokenizer_gives_no_bound() -> None:
    assert useful_body_bytes(LIMITS, None, 50) is None
    assert useful_body_bytes(LIMITS, 512, None) is None


def test_the_largest_request_that_fits_is_within_the_bound() -> None:
    max_len, c = 512, 13
    # every prompt character as a surrogate pair escape, every stop string at its limit
    prompt = "\U0001f600" * (max_len * c)
    stops = ["\U0001f600" * LIMITS.max_stop_string_chars] * LIMITS.max_stop_strings
    body = json.dumps({"model": "m" * 200, "prompt": prompt, "stop": stops,
                       "stop_token_ids": [10**6] * LIMITS.max_stop_token_ids,
                       "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 1},
                      indent=4).encode()
    assert len(body) <= useful_body_bytes(LIMITS, max_len, c)


def test_the_bound_grows_with_the_context_and_the_characters_per_token() -> None:
    small = useful_body_bytes(LIMITS, 8192, 81)
    assert 8 * 2**20 < small < 9 * 2**20  # SmolLM2: a 10 MiB body cannot fit
    assert useful_body_bytes(LIMITS, 16384, 81) > small
    assert useful_body_bytes(LIMITS, 8192, 40) < small
