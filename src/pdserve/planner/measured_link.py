"""`pdserve plan --link-gbps http://ROUTER`: the KV link rate a running cluster measured.

The router keeps one estimate per (prefill, decode) worker pair of the bandwidth their KV
hand-overs get (`pdserve_router_link_bytes_per_second`, see router/link_estimates.py); a pair
not measured lately reads 0 and is left out. The plan takes the median of the measured pairs,
in Gb/s (bytes/s x 8 / 1e9), the unit links are rated in.
"""

from __future__ import annotations

import re
import statistics
import urllib.error
import urllib.request
from dataclasses import dataclass

GAUGE = "pdserve_router_link_bytes_per_second"
_LINE = re.compile(GAUGE + r"\{([^}]*)\}\s+(\S+)$")


@dataclass(frozen=True)
class MeasuredLink:
    gbps: float
    links: int  # measured (prefill, decode) pairs the median is of
    url: str

    def describe(self) -> str:
        return (f"link: {self.gbps:.3g} Gb/s, the median of {self.links} link(s) the router at "
                f"{self.url} measured")


def parse_link_gbps(value: str, metrics_key: str | None = None) -> float | MeasuredLink:
    """A number of Gb/s, or (for an http(s) URL) the rate that router measured."""
    if value.startswith(("http://", "https://")):
        return from_router(value.rstrip("/").removesuffix("/v1"), metrics_key)
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"--link-gbps takes Gb/s or a running router's URL, got {value!r}") \
            from None


def from_router(url: str, metrics_key: str | None) -> MeasuredLink:
    headers = {"Authorization": f"Bearer {metrics_key}"} if metrics_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers),
                                    timeout=5) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        hint = " (give its key with --metrics-key-file)" if e.code == 401 else ""
        raise ValueError(f"{url}/metrics answered {e.code}{hint}") from None
    except OSError as e:
        raise ValueError(f"cannot read {url}/metrics: {e}") from None
    rates = measured_rates(text)
    if not rates:
        raise ValueError(f"the router at {url} has measured no KV link yet: it needs split "
                         "requests (prompts longer than its local-prefill threshold) first")
    return MeasuredLink(statistics.median(rates) * 8 / 1e9, len(rates), url)


def measured_rates(metrics_text: str) -> list[float]:
    """The non-zero per-pair link rates (bytes/s) in a router's /metrics text."""
    rates = []
    for line in metrics_text.splitlines():
        m = _LINE.match(line.strip())
        if m and float(m.group(2)) > 0:
            rates.append(float(m.group(2)))
    return rates
