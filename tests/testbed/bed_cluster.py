"""`pdserve up --testbed` as a child process (`BedUpProcess`) with a tiny fp32 model, and a
client inside the testbed."""

from __future__ import annotations

import functools
import json
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.cluster.bed_up_process import BedUpProcess
from pdserve.testbed import lifecycle
from pdserve.testbed.state import BedState
from pdserve.testbed.topology import LinkShape, Topology
from tests.testbed.conftest import assert_nothing_left, fresh_prefix, skip_without_namespaces

MAX_TOKENS = 16


class BedCluster(BedUpProcess):
    """Workers in `bed`'s order of roles: worker 0 prefill on p0, worker 1 decode on d0."""

    def __init__(self, bed: BedState, model: Path, *args: str) -> None:
        super().__init__(bed, model, "--dtype", "float32", "--kv-cache-memory", "16MiB",
                         "--max-model-len", "512", *args)

    def worker_url(self, index: int) -> str:
        host = ("p0", "d0")[index]
        return f"http://{self.address(host)}:{self.port + 1 + index}"

    def metrics(self, index: int) -> str:
        with self.inside(), urllib.request.urlopen(self.worker_url(index) + "/metrics",
                                                   timeout=5) as r:
            return r.read().decode()

    def complete(self, prompt: list[int], max_tokens: int, timeout_s: float = 60.0) -> dict:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(self.url + "/completions", body,
                                         {"Content-Type": "application/json"})
        with self.inside(), urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read())


def metric_value(text: str, name: str) -> float:
    """The value of metric line `name` (0 when absent: a counter never incremented)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@contextmanager
def cluster_on_bed(model: Path, *args: str) -> Iterator[BedCluster]:
    """A testbed (router, p0, d0 on 1 Gb/s links) with a cluster on it (`pdserve up` ARGS),
    both removed afterwards, whatever happened."""
    skip_without_namespaces()
    prefix = fresh_prefix()
    try:
        bed = lifecycle.up(Topology(("router", "p0", "d0"), prefix), LinkShape(gbps=1))
        cluster = BedCluster(bed, model, *args)
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        lifecycle.down(prefix)
        assert_nothing_left(prefix)


def offline_texts(model: str, prompts: list[list[int]]) -> list[str]:
    """The offline engine's greedy texts on one host (MAX_TOKENS each, EOS ignored)."""
    return list(_offline_texts(model, tuple(tuple(p) for p in prompts)))


@functools.cache
def _offline_texts(model: str, prompts: tuple[tuple[int, ...], ...]) -> tuple[str, ...]:
    """Computed once per model and prompts (the cross-host tests ask once per transport)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return tuple(o.outputs[0].text for o in outs)
