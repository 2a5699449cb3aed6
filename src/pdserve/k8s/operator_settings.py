"""`pdserve operator`'s options (kopf-free, so the command line parses without kopf)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    interval_s: float = 10.0  # between two looks at each resource
    model_config: str | None = None  # render's --model-config, for every resource

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and math.isfinite(self.interval_s)):
            raise ValueError(f"--interval must be a number of seconds > 0, got "
                             f"{self.interval_s}")
