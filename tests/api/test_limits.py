"""`RequestLimits`: its defaults, its validation, and its command-line flags."""

from __future__ import annotations

import argparse

import pytest

from pdserve.api.limits import (
    RequestLimits,
    SpecialTokensInContent,
    add_limit_args,
    limits_from_args,
)


def parsed(*argv: str) -> RequestLimits:
    p = argparse.ArgumentParser()
    add_limit_args(p)
    return limits_from_args(p.parse_args(list(argv)))


def test_the_flags_default_to_the_dataclass_defaults() -> None:
    assert parsed() == RequestLimits()
    d = RequestLimits()
    assert d.max_body_bytes == 16 * 2**20
    assert d.special_tokens_in_content is SpecialTokensInContent.TEXT


def test_every_flag_sets_its_field() -> None:
    got = parsed("--max-body-size", "2MiB", "--max-stop-strings", "3",
                 "--max-stop-string-chars", "7", "--max-stop-token-ids", "5",
                 "--header-timeout", "1.5", "--body-timeout", "2",
                 "--special-tokens-in-content", "parse")
    assert got == RequestLimits(max_body_bytes=2 * 2**20, max_stop_strings=3,
                                max_stop_string_chars=7, max_stop_token_ids=5,
                                header_timeout_s=1.5, body_timeout_s=2.0,
                                special_tokens_in_content=SpecialTokensInContent.PARSE)


@pytest.mark.parametrize(("argv", "flag"), [
    (["--max-body-size", "0"], "--max-body-size"),
    (["--max-body-size", "lots"], "--max-body-size"),
    (["--max-stop-strings", "0"], "--max-stop-strings"),
    (["--max-stop-string-chars", "-1"], "--max-stop-string-chars"),
    (["--max-stop-token-ids", "0"], "--max-stop-token-ids"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--body-timeout", "inf"], "--body-timeout"),
    (["--body-timeout", "nan"], "--body-timeout"),
])
def test_a_bad_value_is_a_value_error_naming_its_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        parsed(*argv)


def test_an_unknown_content_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match="--special-tokens-in-content must be one of text, parse"):
        RequestLimits(special_tokens_in_content="strip")  # type: ignore[arg-type]


def test_booleans_are_not_counts() -> None:
    with pytest.raises(ValueError, match="--max-stop-strings"):
        RequestLimits(max_stop_strings=True)
