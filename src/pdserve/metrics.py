"""Prometheus metrics: counters, gauges and histograms in the text exposition format 0.0.4.

One `Registry` per process (worker or router), rendered by its `/metrics` endpoint. Every
metric may carry labels; a labelled child is created on first use. Thread-safe: the engine
thread observes while the HTTP thread renders. Names follow Prometheus conventions
(`_total` counters, `_seconds` histograms), with vLLM's meanings where vLLM has the metric.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence

LabelValues = tuple[str, ...]

# Latency buckets in seconds, 1 ms to 2 min (vLLM's TTFT buckets, a few added at the low end).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 120.0)


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: Sequence[str], lock: threading.Lock) -> None:
        self.name, self.doc, self.label_names = name, doc, tuple(labels)
        self._lock = lock

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def render(self) -> list[str]:
        doc = self.doc.replace("\\", r"\\").replace("\n", r"\n")
        return [f"# HELP {self.name} {doc}", f"# TYPE {self.name} {self.kind}",
                *self._samples()]

    def _samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._values: dict[LabelValues, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def _samples(self) -> list[str]:
        values = self._values or ({(): 0.0} if not self.label_names else {})
        return [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in values.items()]


class Gauge(_Metric):
    """A value set directly, or read at render time from `fn` (for engine state)."""

    kind = "gauge"

    def __init__(self, *args, fn: Callable[[], float] | None = None) -> None:
        super().__init__(*args)
        self._values: dict[LabelValues, float] = {}
        self._fn = fn

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = float(value)

    def value(self, **labels: str) -> float:
        if self._fn is not None:
            return float(self._fn())
        return self._values.get(self._key(labels), 0.0)

    def _samples(self) -> list[str]:
        if self._fn is not None:
            return [f"{self.name} {_fmt(self._fn())}"]
        values = self._values or ({(): 0.0} if not self.label_names else {})
        return [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in values.items()]


class Histogram(_Metric):
    """Cumulative buckets (`le`), `_sum` and `_count`, as Prometheus histograms are."""

    kind = "histogram"

    def __init__(self, *args, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        super().__init__(*args)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{self.name}: buckets must be strictly increasing")
        self.buckets = (*buckets, math.inf)
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            total[0] += value

    def count(self, **labels: str) -> int:
        series = self._series.get(self._key(labels))
        return sum(series[0]) if series else 0

    def _samples(self) -> list[str]:
        lines = []
        for key, (counts, total) in self._series.items():
            cumulative = 0
            for bound, n in zip(self.buckets, counts, strict=True):
                cumulative += n
                le = 'le="' + _fmt(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le)} "
                             f"{cumulative}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {_fmt(total[0])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {cumulative}")
        return lines


class Registry:
    """The metrics of one process, rendered in registration order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, doc, labels, self._lock))

    def gauge(self, name: str, doc: str, labels: Sequence[str] = (),
              fn: Callable[[], float] | None = None) -> Gauge:
        return self._add(Gauge(name, doc, labels, self._lock, fn=fn))

    def histogram(self, name: str, doc: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, doc, labels, self._lock, buckets=buckets))

    def render(self) -> str:
        with self._lock:
            lines = [line for m in self._metrics.values() for line in m.render()]
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
