"""The compiled temperature and top-p draw (`sample_rows`, csrc/sample.cpp) and the Sampler's use
of it: the inverse CDF of softmax(x / T) over the row or its nucleus, never a token of zero
weight, ties at the nucleus's end kept across the candidate pools, the PyTorch path's tokens
from the same sampler seed, and the PyTorch path wherever a row asks for top-k or a seed."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.sampler import Sampler, apply_top_p, inverse_cdf

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the fused CPU operators are not built here")

BELOW_ONE = 1.0 - 2.0 ** -24  # the largest fp32 uniform


def _draw(logits: torch.Tensor, temperature: float, u: list[float],
          top_p: float = 1.0) -> list[int]:
    """One row of bf16 logits drawn once per uniform in u."""
    rows = logits.bfloat16()[None, :].expand(len(u), -1).contiguous()  # [n, V]
    return OPS.sample_rows(rows, torch.full((len(u),), temperature),
                           torch.full((len(u),), top_p),
                           torch.tensor(u, dtype=torch.float32)).tolist()


@pytest.mark.parametrize("vocab", [7, 37, 100, 3000, 49152])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_the_draw_is_the_inverse_cdf_of_the_tempered_softmax(vocab: int,
                                                             temperature: float) -> None:
    """Vocabularies off the vector and block widths included; PyTorch's fp32 running sum
    rounds differently near a boundary, so a few of 400 draws may differ, never more."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(vocab, generator=gen) * 3).bfloat16().float()  # [V]
    u = torch.rand(400, generator=gen)
    want = inverse_cdf((logits / temperature).softmax(-1).expand(400, -1).contiguous(), u)
    got = torch.tensor(_draw(logits, temperature, u.tolist()))
    assert (got == want).float().mean() >= 0.99


def test_zero_weights_are_never_drawn_and_the_edges_take_the_first_and_last() -> None:
    """Weight only at 5, 130 and 250 of 300 (three blocks apart): U = 0 draws the first, U just
    under 1 the last, and no U lands on a -inf entry before, between or after them."""
    logits = torch.full((300,), float("-inf"))
    logits[[5, 130, 250]] = 0.0
    assert _draw(logits, 1.0, [0.0]) == [5]
    assert _draw(logits, 1.0, [BELOW_ONE]) == [250]
    grid = [i / 997 for i in range(997)]
    draws = _draw(logits, 1.0, grid)
    assert set(draws) == {5, 130, 250}
    assert draws.count(130) == pytest.approx(997 / 3, abs=2)


def test_equal_weights_split_the_unit_interval_evenly() -> None:
    logits = torch.zeros(40)
    assert _draw(logits, 1.0, [0.0, 0.024, 0.026, 0.5, BELOW_ONE]) == [0, 0, 1, 20, 39]


def test_a_row_without_a_finite_positive_total_draws_its_first_maximum() -> None:
    rows = torch.full((2, 64), float("-inf")).bfloat16()
    rows[1, 9] = float("nan")
    got = OPS.sample_rows(rows, torch.ones(2), torch.ones(2), torch.tensor([0.5, 0.5]))
    assert got.tolist() == [0, 9]


@pytest.mark.parametrize("scale, top_p", [(8.0, 0.9), (3.0, 0.9), (3.0, 0.5), (0.3, 0.95),
                                          (0.05, 0.99)])
def test_the_nucleus_draw_is_the_pytorch_paths(scale: float, top_p: float) -> None:
    """Peaked rows (a nucleus within the first pool of 64) to flat ones (past 1,024 and 8,192:
    the whole row), 49,152 entries: the tokens of apply_top_p then the inverse CDF, but where
    fp32 rounding moves a boundary, for 300 uniforms."""
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = (torch.randn(49152, generator=gen) * scale).bfloat16().float()  # [V]
    u = torch.rand(300, generator=gen)
    probs = (logits / 0.8).softmax(-1).expand(300, -1).contiguous()  # [300, V]
    apply_top_p(probs, torch.full((300,), top_p))
    want = inverse_cdf(probs, u)
    got = torch.tensor(_draw(logits, 0.8, u.tolist(), top_p=top_p))
    assert (got == want).float().mean() >= 0.99


def test_ties_at_the_end_of_the_nucleus_are_kept_past_the_first_pool() -> None:
    """100 equal largest logits hold ~all the weight: the nucleus of top-p 0.5 ends among them,
    so all 100 are kept (as apply_top_p keeps ties), though the first pool holds 64."""
    logits = torch.full((5000,), -30.0)
    tied = torch.arange(7, 5000, 49)[:100]
    logits[tied] = 2.0
    draws = _draw(logits, 1.0, [i / 1000 for i in range(1000)], top_p=0.5)
    assert set(draws) == set(tied.tolist())


def test_a_small_top_p_keeps_the_largest_weights_only() -> None:
    """A row with 30 equal largest logits and a near second: top-p 0.01 keeps the 30 (ties),
    never the 2.9s just under them."""
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0] * 30)  # 150: a pool of 64 first
    draws = set(_draw(logits, 1.0, [i / 300 for i in range(300)], top_p=0.01))
    assert draws == set(range(1, 150, 5))


@pytest.mark.parametrize("temperatures, top_ps, uniforms, logits, message", [
    ([0.0], [1.0], [0.5], torch.zeros(1, 8).bfloat16(), "temperature 0 of row 0"),
    ([float("inf")], [1.0], [0.5], torch.zeros(1, 8).bfloat16(), "not a finite number > 0"),
    ([1.0], [1.0], [1.0], torch.zeros(1, 8).bfloat16(), "uniform 1 of row 0 is not in"),
    ([1.0], [0.0], [0.5], torch.zeros(1, 8).bfloat16(), "top_p 0 of row 0 is not in"),
    ([1.0], [1.5], [0.5], torch.zeros(1, 8).bfloat16(), "top_p 1.5 of row 0 is not in"),
    ([1.0], [1.0], [0.5], torch.zeros(1, 8), "needs bf16 logits"),
    ([1.0, 1.0], [1.0, 1.0], [0.5], torch.zeros(2, 8).bfloat16(), "fp32 uniforms"),
    ([1.0, 1.0], [1.0], [0.5, 0.5], torch.zeros(2, 8).bfloat16(), "fp32 top_ps"),
])
def test_bad_arguments_are_refused_with_the_reason(temperatures: list[float],
                                                   top_ps: list[float], uniforms: list[float],
                                                   logits: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.sample_rows(logits, torch.tensor(temperatures), torch.tensor(top_ps),
                        torch.tensor(uniforms))


class _Counting(types.SimpleNamespace):
    """The compiled operators, counting the Sampler's calls of `sample_rows`."""

    def __init__(self) -> None:
        super().__init__(argmax_rows=OPS.argmax_rows, calls=0)

    def sample_rows(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return OPS.sample_rows(*args)


def test_the_sampler_draws_plain_temperature_rows_compiled_with_the_same_tokens() -> None:
    """Well-separated logits, where rounding cannot move a boundary across a uniform: the
    compiled draw takes the same tokens as the PyTorch path from the same sampler seed, so a
    worker's unseeded stream does not depend on whether its operators were built."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0, 1.5]).bfloat16()
    batch = logits[None, :].expand(300, -1).contiguous()  # [300, 8]
    params = [SamplingParams(temperature=0.8)] * 300
    ops = _Counting()
    compiled = Sampler(seed=5, fused=ops)(batch, params, [0] * 300).token_ids
    assert ops.calls == 1
    assert compiled == Sampler(seed=5)(batch, params, [0] * 300).token_ids
    assert len(set(compiled)) >= 6


def test_the_sampler_draws_top_p_rows_compiled_with_the_same_tokens() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -4.0, 1.5]).bfloat16()
    batch = logits[None, :].expand(200, -1).contiguous()  # [200, 8]
    params = [SamplingParams(temperature=0.8, top_p=0.7), SamplingParams(temperature=1.2)] * 100
    ops = _Counting()
    compiled = Sampler(seed=6, fused=ops)(batch, params, [0] * 200).token_ids
    assert ops.calls == 1
    assert compiled == Sampler(seed=6)(batch, params, [0] * 200).token_ids
    assert set(compiled[0::2]) == {0, 7}  # the nucleus of 0.7 at T 0.8: 0.47 + 0.25 of it


@pytest.mark.parametrize("other", [SamplingParams(top_k=3), SamplingParams(seed=11),
                                   SamplingParams(top_k=3, top_p=0.9)])
def test_a_row_asking_for_more_than_a_temperature_keeps_the_pytorch_path(
        other: SamplingParams) -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(2)).bfloat16()
    params = [SamplingParams(), other, SamplingParams(temperature=0.0), SamplingParams()]
    ops = _Counting()
    got = Sampler(seed=9, fused=ops)(logits, params, [3] * 4).token_ids
    assert ops.calls == 0
    assert got == Sampler(seed=9)(logits, params, [3] * 4).token_ids


def test_greedy_rows_beside_temperature_rows_stay_greedy() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(4)).bfloat16()
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0), SamplingParams(), SamplingParams(temperature=0.0)]
    ops = _Counting()
    got = Sampler(seed=1, fused=ops)(logits, params, [0] * 6).token_ids
    assert ops.calls == 1
    first_max = logits.float().max(dim=-1).indices.tolist()
    assert [got[i] for i in (0, 2, 5)] == [first_max[i] for i in (0, 2, 5)]
