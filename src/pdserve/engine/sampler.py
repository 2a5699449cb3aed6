"""Turns a batch of next-token logits into token ids (and optional logprobs).

Invariants:
- Greedy rows (`SamplingParams.greedy`) take `torch.argmax` of the raw logits: the first
  maximal index.
- Sampled rows apply, in order: temperature scaling, top-k, top-p, then a draw from the
  filtered distribution, exact up to float rounding. Ties at a top-k or top-p cutoff are all
  kept.
  - A seeded row (`SamplingParams.seed`) runs the exponential race `argmax(probs / E)`, with
    `E ~ Exp(1)` i.i.d. per vocabulary entry from a fresh generator seeded with
    `mix_seed(seed, position)`. Path independence: the token at output position `p` depends
    only on that row's logits, params and `p`: not on the batch, the row's index in it, other
    rows, earlier positions or the engine that samples it (on the same device type). The race
    is also robust to the last-bit differences between two engines' logits (a stream moved to
    another worker recomputes its KV there): a token changes only where two candidates nearly
    tie in probs / E.
  - An unseeded row, which promises no such thing, takes inverse-CDF sampling (`inverse_cdf`):
    one uniform U per row from the sampler's own generator (one per device, seeded at
    construction), and the first token whose cumulative probability exceeds U times the row's
    total. One draw per row instead of one per vocabulary entry: SmolLM2's 49,152 race draws
    per row cost ~25% of a 15-stream decode step on 2 CPU cores (PyTorch's CPU generator draws
    them one after another). Its boundaries move with every logit before the token, so the
    same logits give the same token, slightly different ones may not. A batch of such rows
    with a temperature and at most top-p (no top-k) on bf16 CPU logits draws through the
    compiled `sample_rows` (csrc/sample.cpp): the same uniforms, the same nucleus and inverse
    CDF, summed in fp64 where PyTorch's running sums are fp32, so a token differs only where
    rounding moves a boundary (of the CDF or of the nucleus) across its uniform.
- Logprobs are `log_softmax` of the raw logits (before temperature and filtering), in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from pdserve.common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
# Candidate pools for top-p, smallest first: a row whose nucleus fits in the top this-many
# tokens avoids sorting its whole vocabulary. A language model's nucleus is small: SmolLM2
# answering chat prompts at temperature 0.7, top-p 0.9 had a median of 2 tokens, a 99th
# percentile of 30 and none over 64 (768 draws, `tools/sampler/nucleus.py`), and a top-64
# costs ~1/4 of a top-1,024 on 16 rows of its 49,152 logits (2 CPU cores); a flat row pays
# the small pool's extra pass.
_TOP_P_POOLS = (64, 1024, 8192)


@dataclass
class SamplerOutput:
    """One entry per batch row, in batch order.

    `logprobs[i]` is set when `params[i].logprobs is not None`; `top_logprobs[i]` (token id ->
    logprob, most likely first, `params[i].logprobs` entries) when `params[i].logprobs > 0`.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def _splitmix64(x: int) -> int:
    """A bijection on 64-bit ints whose outputs look independent for nearby inputs."""
    x = (x + _GOLDEN64) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed mod 2**64, output position)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + position) & _MASK64) >> 1


def _select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] ([R, V]), without a copy when rows is every row in order."""
    if rows.numel() == x.shape[0]:
        return x
    return x.index_select(0, rows)


def apply_top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> None:
    """Set to -inf, in place, every logit below its row's k-th largest (k = 0: keep all).

    scaled: [S, V] fp32; top_k: [S] int64 with 0 <= k.
    """
    vocab = scaled.shape[1]
    k = top_k.clamp(max=vocab)
    rows = ((k > 0) & (k < vocab)).nonzero().flatten()  # [R]
    if rows.numel() == 0:
        return
    k_rows = k[rows]  # [R]
    top = _select_rows(scaled, rows).topk(int(k_rows.max()), dim=-1).values  # [R, max k]
    kth = torch.full((scaled.shape[0], 1), float("-inf"), device=scaled.device)  # [S, 1]
    kth[rows] = top.gather(1, (k_rows - 1)[:, None])
    scaled.masked_fill_(scaled < kth, float("-inf"))


def _nucleus_threshold(
    sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest kept probability per row: the set ending where the cumulative sum reaches top_p.

    sorted_probs: [R, M] descending; top_p: [R]. Returns the threshold [R, 1] (always keeping
    the first token) and [R] bool: whether the cumulative sum reached top_p within the M tokens.
    """
    cum = sorted_probs.cumsum(dim=-1)  # [R, M]
    kept = ((cum - sorted_probs) < top_p[:, None]).sum(dim=-1).clamp(min=1)  # [R]
    return sorted_probs.gather(1, (kept - 1)[:, None]), cum[:, -1] >= top_p


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """Zero, in place, every probability outside its row's nucleus (top_p = 1: keep all).

    probs: [S, V] fp32 rows summing to 1; top_p: [S] in (0, 1]. The nucleus is searched in the
    top `_TOP_P_POOLS[0]` tokens first (a partial top-k, far cheaper than a sort); rows whose
    nucleus reaches past a pool retry with the next, larger one, and finally the whole row.
    """
    pending = (top_p < 1.0).nonzero().flatten()  # [R] rows still without a threshold
    if pending.numel() == 0:
        return
    vocab = probs.shape[1]
    thr = torch.zeros((probs.shape[0], 1), device=probs.device)  # [S, 1]; 0 keeps all
    for pool_size in (*_TOP_P_POOLS, vocab):
        size = min(pool_size, vocab)
        pool = _select_rows(probs, pending).topk(size, dim=-1).values  # [P, size] descending
        found, resolved = _nucleus_threshold(pool, top_p[pending])  # [P, 1], [P]
        if size == vocab:  # the whole row: fp32 rounding may leave the sum below top_p
            resolved.fill_(True)
        thr[pending[resolved]] = found[resolved]
        pending = pending[~resolved]
        if pending.numel() == 0:
            break
    probs.masked_fill_(probs < thr, 0.0)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[S] int64: per row, the first index whose cumulative probability exceeds u x the row's
    total: a draw from probs (rows of non-negative weights, not all 0, need not sum to 1),
    exact up to the rounding of the running fp32 sum (near its end, weights resolved to ~6e-8;
    a fp64 scan costs 15x more on a CPU). probs: [S, V] fp32; u: [S] in [0, 1).

    The target is kept below the total (u x total may round up to it), so an index is always
    found, and the running sum rises there: a zero-weight entry is never drawn."""
    cum = probs.cumsum(dim=-1)  # [S, V]
    total = cum[:, -1:]  # [S, 1]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1)  # [S]


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B]: index of the first maximum per row, as `torch.argmax` (faster on CPU)."""
    return x.max(dim=-1).indices


class Sampler:
    """Stateless apart from the generators that feed unseeded rows.

    `fused`: pdserve's compiled CPU operators, whose `argmax_rows` takes greedy bf16 rows
    (the same indices as `first_argmax`, ~6x faster on SmolLM2's 49,152-entry rows)."""

    def __init__(self, seed: int = 0, fused: ModuleType | None = None) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"Sampler seed must be an int, got {seed!r}")
        self._seed = seed
        self._fused = fused
        self._generators: dict[torch.device, torch.Generator] = {}

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and logits.dtype == torch.bfloat16 and not logits.is_cuda:
            return self._fused.argmax_rows(logits)
        return first_argmax(logits)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> SamplerOutput:
        """logits: [B, V] any float dtype; positions[i]: output index of the token sampled."""
        _check_inputs(logits, params, positions)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = self._argmax(logits)  # [B]
        else:
            tokens = self._sample_mixed(logits, params, positions, greedy)
        token_list: list[int] = tokens.tolist()
        logprobs, top = _gather_logprobs(logits, params, tokens)
        return SamplerOutput(token_ids=token_list, logprobs=logprobs, top_logprobs=top)

    def _sample_mixed(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        greedy: list[bool],
    ) -> torch.Tensor:
        sampled = [i for i, g in enumerate(greedy) if not g]
        if len(sampled) == len(params):
            return self._sample(logits, params, positions)
        tokens = self._argmax(logits)  # [B]
        idx = torch.tensor(sampled, device=logits.device)
        sub_tokens = self._sample(
            logits.index_select(0, idx),
            [params[i] for i in sampled],
            [positions[i] for i in sampled],
        )
        return tokens.index_copy(0, idx, sub_tokens)

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> torch.Tensor:
        """Sample every row of logits [S, V] (no greedy rows); returns [S] int64."""
        dev = logits.device
        if self._compiled_draw(logits, params):
            u = torch.rand(len(params), generator=self._generator(dev))  # [S]
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)  # [S]
            top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)  # [S]
            return self._fused.sample_rows(logits, temps, top_ps, u)
        temps = torch.tensor([p.temperature for p in params], device=dev)  # [S]
        scaled = (logits / temps[:, None]).float()  # [S, V] fp32 by type promotion
        apply_top_k(scaled, torch.tensor([p.effective_top_k for p in params], device=dev))
        probs = scaled.softmax(dim=-1)  # [S, V]
        apply_top_p(probs, torch.tensor([p.top_p for p in params], device=dev))
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) == len(params):
            return self._race(probs, params, positions)
        u = torch.rand(len(params), device=dev, generator=self._generator(dev))  # [S]
        tokens = inverse_cdf(probs, u)  # [S]
        if not seeded:
            return tokens
        idx = torch.tensor(seeded, device=dev)
        raced = self._race(probs.index_select(0, idx), [params[i] for i in seeded],
                           [positions[i] for i in seeded])
        return tokens.index_copy(0, idx, raced)

    def _compiled_draw(self, logits: torch.Tensor, params: list[SamplingParams]) -> bool:
        """Whether every row is an unseeded draw with a temperature and at most top-p (no
        top-k) of bf16 CPU logits, which the compiled `sample_rows` takes: the inverse CDF of
        softmax(x / T), after top-p over a pool of the largest logits, in one pass over each
        row and a short second one (16 rows of SmolLM2's vocabulary: ~5x cheaper than its
        PyTorch operators without top-p, 3.5-7x with: `pdserve bench sampler`)."""
        return (self._fused is not None and logits.dtype == torch.bfloat16
                and not logits.is_cuda and logits.stride(1) == 1
                and all(p.seed is None and p.effective_top_k == 0 for p in params))

    def _race(
        self, probs: torch.Tensor, params: list[SamplingParams], positions: list[int]
    ) -> torch.Tensor:
        """The exponential race over seeded rows probs [R, V]; returns [R] int64.
        E = -log(U) ~ Exp(1) and the winner maximizes probs / E, i.e. minimizes probs / log(U);
        U = 0 gives -0.0, which never wins."""
        log_u = torch.empty_like(probs)  # [R, V]
        for i, p in enumerate(params):
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(mix_seed(p.seed, positions[i]))
            log_u[i].uniform_(generator=gen)
        return probs.div_(log_u.log_()).min(dim=-1).indices

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed & _MASK64)
            self._generators[device] = gen
        return gen


def _check_inputs(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float [batch, vocab] tensor, "
            f"got {logits.dtype} {tuple(logits.shape)}"
        )
    if not len(params) == len(positions) == logits.shape[0]:
        raise ValueError(
            f"need one SamplingParams and one position per logits row: {logits.shape[0]} rows, "
            f"{len(params)} params, {len(positions)} positions"
        )
    if any(p < 0 for p in positions):
        raise ValueError(f"positions must be >= 0 (0 = first generated token), got {positions}")


def _gather_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor
) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """Chosen-token and top-k logprobs of the raw distribution, for rows that asked."""
    chosen: list[float | None] = [None] * len(params)
    top: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return chosen, top
    idx = torch.tensor(rows, device=logits.device)
    lp = logits.index_select(0, idx).float().log_softmax(dim=-1)  # [R, V]
    picked = lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1).tolist()  # [R]
    for j, i in enumerate(rows):
        chosen[i] = picked[j]
    max_k = max(params[i].logprobs or 0 for i in rows)
    if max_k == 0:
        return chosen, top
    top_vals, top_ids = lp.topk(min(max_k, lp.shape[1]), dim=-1)  # [R, K]
    vals, ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        if k:
            top[i] = dict(zip(ids[j][:k], vals[j][:k], strict=True))
    return chosen, top
