"""Routed experts on pdserve's bf16 linear kernels: the same sums as `Experts` to bf16
rounding, an unchosen expert's packed bytes never read, and a bf16 MoE model loads with them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model.moe import Experts
from pdserve.engine.model.packed_experts import PackedExperts, pack_experts
from pdserve.engine.model.packed_linear import linear_kernel

HIDDEN, INTER, E = 64, 64, 6  # sides that fit AMX (multiples of 32) and AVX512-BF16


@pytest.fixture(scope="module")
def kernel(ops):
    found = linear_kernel(ops)
    if found is None:
        pytest.skip("this CPU has neither AMX nor AVX512-BF16")
    return found


def _experts() -> Experts:
    experts = Experts(E, HIDDEN, INTER)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return experts.bfloat16()


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(t)])
    return x, ids, torch.rand(t, 2, generator=gen)


def test_packed_experts_sum_like_experts(kernel):
    experts = _experts()
    x, ids, weights = _inputs(17, seed=1)
    reference = experts.float()(x.float(), ids, weights)
    packed = PackedExperts(_experts(), kernel)(x, ids, weights)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed.float(), reference, rtol=2e-2, atol=2e-2)


def test_packed_experts_never_read_unchosen_experts(kernel):
    packed = PackedExperts(_experts(), kernel)
    x, _, weights = _inputs(3, seed=2)
    ids = torch.tensor([[4, 1], [1, 4], [4, 1]])  # experts 0, 2, 3, 5 unchosen
    before = packed(x, ids, weights)
    for e in (0, 2, 3, 5):
        packed.gate_up[e].fill_(float("nan"))
        packed.down[e].fill_(float("nan"))
    after = packed(x, ids, weights)
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


def test_pack_experts_leaves_fp32_and_misfit_experts_alone(kernel):
    model = torch.nn.Sequential(Experts(E, HIDDEN, INTER), Experts(E, HIDDEN, 7).bfloat16())
    pack_experts(model, kernel)
    assert [type(m) for m in model] == [Experts, Experts]  # fp32; odd width (7)
    model[0] = _experts()
    pack_experts(model, kernel)
    assert type(model[0]) is PackedExperts


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_bf16_moe_model_decodes_on_packed_experts(tiny_model, kernel, arch):
    path = tiny_model(arch, hidden_size=64, moe_intermediate_size=32)  # fits every kernel
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128)
    kinds = {type(m) for m in llm.engine.model.modules()}
    assert PackedExperts in kinds and Experts not in kinds
    out = llm.generate([list(range(20, 40))], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
