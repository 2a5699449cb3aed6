"""Per-request decoding settings, with vLLM's names and defaults.

Invariants (checked in `__post_init__`, violations raise `ValueError` saying what to fix):
- `max_tokens >= 1`;
- `temperature` is finite and `>= 0`; `0` (anything below `GREEDY_TEMPERATURE`) means greedy;
- `top_k` is `-1` or `>= 0`; `0` and `-1` both mean "no top-k filter";
- `0 < top_p <= 1`;
- `seed` is `None` or an int; a seeded request samples the same token at output position `p`
  whichever engine or batch samples it;
- `stop` is a tuple of non-empty strings of valid Unicode (no unpaired surrogate: such a
  string has no UTF-8 form, so it could never match generated text nor cross a process),
  `stop_token_ids` a tuple of ints `>= 0` (a single str/int or a list is accepted and
  normalized to a tuple);
- `logprobs` is `None` (no logprobs) or in `[0, 20]` (chosen token's logprob plus that many
  top alternatives).
Booleans are never accepted where an int is expected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy: dividing logits by them overflows fp32.
GREEDY_TEMPERATURE = 1e-5
_SURROGATE = re.compile("[\ud800-\udfff]")


def unpaired_surrogate(text: str) -> int | None:
    """The index of the first unpaired UTF-16 surrogate in `text` (what JSON's "\\ud800"
    decodes to), or None when `text` is valid Unicode. Python joins a JSON surrogate pair into
    one character, so any surrogate left is unpaired."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_tuple(name: str, value: Any, scalar_type: type) -> tuple[Any, ...]:
    """Normalize a scalar, list or tuple to a tuple; anything else is a `ValueError`."""
    if isinstance(value, scalar_type) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValueError(
            f"{name} must be a {scalar_type.__name__} or a list of them, got {value!r}"
        )
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(
            self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int)
        )
        self._check_lengths()
        self._check_distribution()
        self._check_stops()
        self._check_flags()

    def _check_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    def _check_distribution(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int: -1 or 0 to disable, >= 1 to keep the k most likely "
                f"tokens; got {self.top_k!r}"
            )
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")

    def _check_stops(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r} in {self.stop!r}")
            at = unpaired_surrogate(s)
            if at is not None:
                raise ValueError(f"stop strings must be valid Unicode; {s!r} holds an unpaired "
                                 f"surrogate at index {at}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be ints >= 0, got {t!r} in {self.stop_token_ids!r}"
                )

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax of the logits (temperature ~0)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def effective_top_k(self) -> int:
        """The top-k cutoff, with 0 meaning "no cutoff" (the -1 spelling folded into 0)."""
        return max(self.top_k, 0)
