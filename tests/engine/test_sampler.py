from __future__ import annotations

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.sampler import Sampler, apply_top_p, inverse_cdf, mix_seed

VOCAB = 3000  # above the top-p candidate pool, so both top-p paths run


def _logits(batch: int, vocab: int = VOCAB, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * scale  # [B, V]


def _draws(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n independent unseeded draws from one logits row, sampled as one batch."""
    batch = logits_row[None, :].expand(n, -1)  # [n, V]
    return Sampler(seed=seed)(batch, [params] * n, [0] * n).token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = _logits(16).to(dtype)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 16, list(range(16)))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 16
    assert out.top_logprobs == [None] * 16


@pytest.mark.parametrize("temperature", [0.1, 1.0, 7.0])
def test_top_k_one_is_greedy(temperature: float) -> None:
    logits = _logits(32)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 32
    assert Sampler()(logits, params, [0] * 32).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 3.0])
def test_tiny_top_p_is_greedy(temperature: float) -> None:
    logits = _logits(32)
    params = [SamplingParams(temperature=temperature, top_p=1e-6)] * 32
    assert Sampler()(logits, params, [0] * 32).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits(8)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5) for i in range(8)]
    out = Sampler()(logits, params, [0] * 8)
    greedy = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 8, 2)] == [greedy[i] for i in range(1, 8, 2)]


def _other_rows() -> tuple[torch.Tensor, list[SamplingParams]]:
    params = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(seed=99, top_k=40),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(seed=5, logprobs=3),
    ]
    return _logits(len(params), seed=1), params


@pytest.mark.parametrize(
    "target", [SamplingParams(seed=1234), SamplingParams(seed=7, top_k=50, top_p=0.8)]
)
def test_seeded_row_is_batch_independent(target: SamplingParams) -> None:
    row = _logits(1, scale=0.5, seed=2)  # [1, V] flat: the draw is far from deterministic
    others, other_params = _other_rows()
    for position in range(6):
        alone = Sampler(seed=1)(row, [target], [position]).token_ids[0]
        for index in range(len(other_params) + 1):
            batch = torch.cat([others[:index], row, others[index:]])  # [B, V]
            params = [*other_params[:index], target, *other_params[index:]]
            positions = [position + 3] * len(params)
            positions[index] = position
            out = Sampler(seed=index + 10)(batch, params, positions)
            assert out.token_ids[index] == alone, (position, index)


def test_seeded_row_is_dtype_layout_and_batch_size_independent() -> None:
    row = _logits(1, scale=0.5, seed=3)
    target = SamplingParams(seed=42, temperature=0.9)
    alone = Sampler()(row, [target], [4]).token_ids[0]
    big = torch.cat([_logits(200, seed=4), row])  # [201, V]
    params = [SamplingParams()] * 200 + [target]
    assert Sampler()(big, params, [0] * 200 + [4]).token_ids[-1] == alone
    strided = torch.stack([row, row], dim=-1).reshape(1, -1)[:, ::2]  # same values, stride 2
    assert torch.equal(strided, row) and not strided.is_contiguous()
    assert Sampler()(strided, [target], [4]).token_ids[0] == alone


def test_seeded_token_at_a_position_ignores_earlier_positions() -> None:
    target = SamplingParams(seed=2024)
    rows = _logits(10, scale=0.5, seed=5)  # one logits row per output position
    one_engine = Sampler(seed=0)
    sequential = [one_engine(rows[p : p + 1], [target], [p]).token_ids[0] for p in range(10)]
    # A decode engine that never saw positions < 7 (prefill happened elsewhere).
    decode_engine = Sampler(seed=12345)
    for p in (7, 8, 9):
        assert decode_engine(rows[p : p + 1], [target], [p]).token_ids[0] == sequential[p]
    # Drawing the same positions again, in any order, repeats them.
    again = [Sampler(seed=p)(rows[p : p + 1], [target], [p]).token_ids[0] for p in range(9, -1, -1)]
    assert again[::-1] == sequential


def test_different_seeds_and_positions_differ() -> None:
    row = torch.zeros(1, 1000)  # uniform: each draw is one of 1000 equally likely tokens

    def draw(seed: int, position: int) -> int:
        return Sampler()(row, [SamplingParams(seed=seed)], [position]).token_ids[0]

    seq_a = [draw(1, p) for p in range(50)]
    seq_b = [draw(2, p) for p in range(50)]
    assert sum(a == b for a, b in zip(seq_a, seq_b, strict=True)) <= 3
    assert len(set(seq_a)) >= 45  # positions of one seed are not correlated
    assert len({draw(s, 0) for s in range(50)}) >= 45


def test_unseeded_rows_vary_and_follow_the_sampler_seed() -> None:
    row = torch.zeros(1, 1000)
    first = _draws(row[0], SamplingParams(), 20, seed=3)
    assert len(set(first)) >= 15
    assert _draws(row[0], SamplingParams(), 20, seed=3) == first


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9% quantile of chi-square with 5 degrees of freedom (6 categories).
_CHI2_DF5_999 = 20.52


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_unseeded_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    draws = _draws(logits, SamplingParams(temperature=temperature), 20000)
    counts = torch.bincount(torch.tensor(draws), minlength=6).float()
    assert _chi_square(counts, (logits / temperature).softmax(-1)) < _CHI2_DF5_999


def test_seeded_frequencies_match_softmax() -> None:
    """Across seeds and positions the seeded noise is still Exp(1): the mix has no bias."""
    logits = torch.tensor([1.5, 1.0, 0.2, 0.0, -0.3, -2.0])
    n = 6000
    batch = logits[None, :].expand(n, -1)  # [n, 6]
    params = [SamplingParams(seed=s // 3, temperature=0.8) for s in range(n)]
    draws = Sampler()(batch, params, [s % 3 for s in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(draws), minlength=6).float()
    assert _chi_square(counts, (logits / 0.8).softmax(-1)) < _CHI2_DF5_999


def test_top_k_and_top_p_frequencies_match_truncated_softmax() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    # top_k=6 drops the last two; top_p then keeps the nucleus of the renormalized six.
    probs = logits[:6].softmax(-1)
    cum = probs.cumsum(-1)
    top_p = float(cum[3] - 0.01)  # nucleus = first four tokens
    draws = _draws(logits, SamplingParams(top_k=6, top_p=top_p), 20000)
    assert set(draws) == {0, 1, 2, 3}
    counts = torch.bincount(torch.tensor(draws), minlength=4).float()
    assert _chi_square(counts, probs[:4] / probs[:4].sum()) < 16.27  # df=3, 99.9%


@pytest.mark.parametrize("k", [1, 5, 40])
def test_top_k_never_leaves_the_top_k(k: int) -> None:
    logits = _logits(1, scale=0.3, seed=6)[0]  # flat: without top-k draws would spread out
    allowed = set(logits.topk(k).indices.tolist())
    draws = _draws(logits, SamplingParams(temperature=3.0, top_k=k), 4000)
    assert set(draws) <= allowed
    assert len(set(draws)) == k  # and every one of them is reachable


def test_top_k_larger_than_vocab_is_no_filter() -> None:
    logits = torch.zeros(10)
    assert len(set(_draws(logits, SamplingParams(top_k=50), 2000))) == 10


def _nucleus_reference(probs: torch.Tensor, top_p: float) -> set[int]:
    """The most likely tokens, in order, up to and including the one reaching top_p (fp64)."""
    if top_p >= 1.0:
        return set(range(len(probs)))
    values, order = probs.double().sort(descending=True)
    count = int((values.cumsum(0) < top_p).sum()) + 1
    return set(order[:count].tolist())


# Nuclei from one token to most of a 20k vocabulary: each pool of apply_top_p gets used.
@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])
def test_top_p_keeps_the_smallest_nucleus(scale: float) -> None:
    probs = _logits(6, vocab=20000, scale=scale, seed=7).double().softmax(-1).float()  # [6, V]
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.999, 1.0])
    kept = probs.clone()
    apply_top_p(kept, top_p)
    for i in range(6):
        got = set(kept[i].nonzero().flatten().tolist())
        expected = _nucleus_reference(probs[i], float(top_p[i]))
        # fp32 cumulative sums may disagree with the fp64 reference about boundary tokens
        assert len(got ^ expected) <= max(2, len(expected) // 1000), (scale, float(top_p[i]))
        assert got >= {int(probs[i].argmax())}
        assert torch.equal(kept[i][kept[i] > 0], probs[i][kept[i] > 0])


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = _logits(4).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=2.0, top_k=3, logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0.5, seed=3, logprobs=20),
    ]
    out = Sampler()(logits, params, [0, 1, 2, 3])
    reference = logits.float().log_softmax(dim=-1)  # [4, V]
    for i in (0, 1, 3):
        logprob = out.logprobs[i]
        assert logprob == pytest.approx(float(reference[i, out.token_ids[i]]), abs=1e-5)
    assert out.logprobs[2] is None
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None
    for i, k in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == k
        values, ids = reference[i].topk(k)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)
    top0 = out.top_logprobs[0]
    assert top0 is not None and out.logprobs[0] == pytest.approx(max(top0.values()))


def test_mix_seed_is_a_deterministic_63_bit_value() -> None:
    assert mix_seed(1, 0) == mix_seed(1, 0)
    values = {mix_seed(s, p) for s in range(-5, 50) for p in range(50)}
    assert len(values) == 55 * 50
    assert all(0 <= v < 2**63 for v in values)


@pytest.mark.parametrize(
    ("logits", "n_params", "positions"),
    [
        (torch.zeros(3), 3, [0, 0, 0]),  # not 2-D
        (torch.zeros(2, 5, dtype=torch.long), 2, [0, 0]),  # not float
        (torch.zeros(2, 5), 3, [0, 0]),  # params count mismatch
        (torch.zeros(2, 5), 2, [0]),  # positions count mismatch
        (torch.zeros(2, 5), 2, [0, -1]),  # negative position
    ],
)
def test_bad_inputs_raise_value_error(
    logits: torch.Tensor, n_params: int, positions: list[int]
) -> None:
    with pytest.raises(ValueError):
        Sampler()(logits, [SamplingParams()] * n_params, positions)


def test_bad_sampler_seed_raises_value_error() -> None:
    with pytest.raises(ValueError, match="seed"):
        Sampler(seed="0")  # type: ignore[arg-type]


def test_inverse_cdf_draws_by_cumulative_weight_and_never_a_zero() -> None:
    """Rows need not sum to 1; U = 0 takes the first token of positive weight, U just under 1
    the last (never a zero-weight entry after it, even where U x total rounds to the total)."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0],
                          [0.0, 0.0, 3.0, 1.0, 0.0, 0.0]])  # the second sums to 4
    below_one = 1.0 - 2.0 ** -24
    cases = {0.0: [1, 2], 0.19: [1, 2], 0.21: [3, 2], 0.49: [3, 2], 0.51: [4, 2],
             0.75: [4, 3], below_one: [4, 3]}
    for u, want in cases.items():
        got = inverse_cdf(probs, torch.tensor([u, u]))
        assert got.tolist() == want, (u, got)
    tiny = torch.tensor([[0.0, 1e-30, 0.0]])  # a total far below 1 still draws its one token
    assert inverse_cdf(tiny, torch.tensor([below_one])).tolist() == [1]
