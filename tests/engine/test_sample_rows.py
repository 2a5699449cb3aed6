"""The compiled temperature draw (`sample_rows`, csrc/sample.cpp) and the Sampler's use of it:
the inverse CDF of softmax(x / T), never a token of zero weight, the PyTorch path's tokens from
the same sampler seed, and the PyTorch path wherever a row asks for more than a temperature."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.sampler import Sampler, inverse_cdf

OPS = cpu_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="the fused CPU operators are not built here")

BELOW_ONE = 1.0 - 2.0 ** -24  # the largest fp32 uniform


def _draw(logits: torch.Tensor, temperature: float, u: list[float]) -> list[int]:
    """One row of bf16 logits drawn once per uniform in u."""
    rows = logits.bfloat16()[None, :].expand(len(u), -1).contiguous()  # [n, V]
    return OPS.sample_rows(rows, torch.full((len(u),), temperature),
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
    got = OPS.sample_rows(rows, torch.ones(2), torch.tensor([0.5, 0.5]))
    assert got.tolist() == [0, 9]


@pytest.mark.parametrize("temperatures, uniforms, logits, message", [
    ([0.0], [0.5], torch.zeros(1, 8).bfloat16(), "temperature 0 of row 0"),
    ([float("inf")], [0.5], torch.zeros(1, 8).bfloat16(), "not a finite number > 0"),
    ([1.0], [1.0], torch.zeros(1, 8).bfloat16(), "uniform 1 of row 0 is not in"),
    ([1.0], [0.5], torch.zeros(1, 8), "needs bf16 logits"),
    ([1.0, 1.0], [0.5], torch.zeros(2, 8).bfloat16(), "fp32 uniforms"),
])
def test_bad_arguments_are_refused_with_the_reason(temperatures: list[float],
                                                   uniforms: list[float],
                                                   logits: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.sample_rows(logits, torch.tensor(temperatures), torch.tensor(uniforms))


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


@pytest.mark.parametrize("other", [SamplingParams(top_p=0.9), SamplingParams(top_k=3),
                                   SamplingParams(seed=11)])
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
