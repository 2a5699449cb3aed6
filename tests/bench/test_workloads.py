"""Traces of `pdserve bench serve`: deterministic, exact lengths, Poisson gaps, bursts."""

from __future__ import annotations

import itertools
import statistics

import pytest

from pdserve.bench.serve.workloads import CHAT, RAG, TOKEN_ID_LO, Workload


def _tiny(seed: int = 0) -> Workload:
    """A fixed workload of one-token prompts: fast to draw thousands of arrivals."""
    return Workload("fixed", seed=seed, input_len=1, output_len=1)


def test_same_seed_same_trace_and_prefixes_agree():
    a = Workload("chat", seed=3).requests(2.0, duration_s=20)
    assert a == Workload("chat", seed=3).requests(2.0, duration_s=20)
    assert a != Workload("chat", seed=4).requests(2.0, duration_s=20)
    assert Workload("chat", seed=3).requests(2.0, num_requests=5) == a[:5]
    # the prompts do not depend on the rate, only the arrival times do
    b = Workload("chat", seed=3).requests(9.0, num_requests=5)
    assert [s.prompt_token_ids for s in b] == [s.prompt_token_ids for s in a[:5]]


def test_exact_lengths_and_id_range():
    fixed = Workload("fixed", input_len=100, output_len=7, vocab=2000)
    for spec in fixed.requests(5.0, num_requests=20):
        assert len(spec.prompt_token_ids) == 100 and spec.max_tokens == 7
        assert all(TOKEN_ID_LO <= t < 2000 for t in spec.prompt_token_ids)
    for kind, shape in (("chat", CHAT), ("rag", RAG)):
        specs = Workload(kind).requests(1.0, num_requests=30)
        assert all(shape.prompt.lo <= len(s.prompt_token_ids) <= shape.prompt.hi
                   and shape.output.lo <= s.max_tokens <= shape.output.hi for s in specs)
        assert all(TOKEN_ID_LO <= t < 30000 for s in specs for t in s.prompt_token_ids)
        assert len({len(s.prompt_token_ids) for s in specs}) > 10  # lengths do vary


def test_poisson_gaps():
    rate = 4.0
    arrivals = [s.arrival_s for s in _tiny().requests(rate, num_requests=4001)]
    assert arrivals[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.1)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.15)  # exponential: CV 1
    count = len(_tiny(1).requests(rate, duration_s=500))
    assert count == pytest.approx(rate * 500, rel=0.1)


def test_mixed_has_its_bursts():
    mixed = Workload("mixed", seed=2, burst_every_s=10, burst_size=3)
    specs = mixed.requests(1.0, duration_s=35)
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals)
    long = [s for s in specs if len(s.prompt_token_ids) >= RAG.prompt.lo]
    assert [s.arrival_s for s in long] == [10.0] * 3 + [20.0] * 3 + [30.0] * 3
    assert all(RAG.output.lo <= s.max_tokens <= RAG.output.hi for s in long)
    short = [s for s in specs if len(s.prompt_token_ids) < RAG.prompt.lo]
    assert short == Workload("chat", seed=2).requests(1.0, duration_s=35)
    assert len(short) > 20


def test_diurnal_alternates_ingestion_and_chat_phases():
    diurnal = Workload("diurnal", seed=3, phase_s=100)
    specs = diurnal.requests(0.5, duration_s=300)
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 300
    phases = [[s for s in specs if k * 100 <= s.arrival_s < (k + 1) * 100] for k in range(3)]
    for k, shape in ((0, RAG), (1, CHAT), (2, RAG)):
        assert all(shape.prompt.lo <= len(s.prompt_token_ids) <= shape.prompt.hi
                   for s in phases[k])
    assert len(phases[0]) == pytest.approx(50, rel=0.4)  # 0.5 req/s for 100 s
    assert len(phases[1]) == pytest.approx(400, rel=0.2)  # 8x faster
    # the same requests in the same order whatever the phase length
    short = Workload("diurnal", seed=3, phase_s=50).requests(0.5, duration_s=150)
    assert [s.prompt_token_ids for s in short if len(s.prompt_token_ids) < RAG.prompt.lo][:20] \
        == [s.prompt_token_ids for s in phases[1][:20]]


@pytest.mark.parametrize("kwargs", [
    {"kind": "nope"},
    {"kind": "chat", "vocab": 20},
    {"kind": "fixed", "input_len": 10},
    {"kind": "fixed", "input_len": 0, "output_len": 4},
    {"kind": "chat", "input_len": 10, "output_len": 4},
    {"kind": "mixed", "burst_size": 0},
    {"kind": "mixed", "burst_every_s": 0},
    {"kind": "diurnal", "phase_s": 0},
    {"kind": "rag", "max_model_len": 2063},  # needs 2,000 + 64
    {"kind": "mixed", "max_model_len": 2000},
    {"kind": "fixed", "input_len": 100, "output_len": 29, "max_model_len": 128},
])
def test_bad_workloads_refused(kwargs):
    with pytest.raises(ValueError):
        Workload(**kwargs)


def test_fitting_max_model_len_accepted():
    Workload("rag", max_model_len=2064)
    Workload("fixed", input_len=100, output_len=28, max_model_len=128)


@pytest.mark.parametrize("kwargs", [
    {"rate": 0.0, "num_requests": 3},
    {"rate": float("inf"), "num_requests": 3},
    {"rate": float("nan"), "num_requests": 3},
    {"rate": 1.0},
    {"rate": 1.0, "duration_s": 5, "num_requests": 3},
    {"rate": 1.0, "num_requests": 0},
    {"rate": 1.0, "duration_s": -1},
])
def test_bad_trace_settings_refused(kwargs):
    with pytest.raises(ValueError):
        _tiny().requests(**kwargs)


def test_settings_name_the_trace():
    assert Workload("mixed").settings() == {"workload": "mixed", "seed": 0, "vocab": 49152,
                                            "max_model_len": None, "burst_every_s": 20.0,
                                            "burst_size": 4}
    assert Workload("fixed", input_len=3, output_len=2).settings()["input_len"] == 3
