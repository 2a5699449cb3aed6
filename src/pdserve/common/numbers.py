"""What counts as a number in JSON read back from a run or a request: an int or a float that is
finite, and not a bool (which Python counts as an int)."""

from __future__ import annotations

import math


def is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
