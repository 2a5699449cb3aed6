"""Routed experts on pdserve's bf16 linear kernels: the same sums as `Experts` to bf16
rounding, each expert exactly as its two kernel calls and `silu_mul` compute it, an unchosen
expert's packed bytes never read, and a bf16 MoE model loads with them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model.moe import Experts, run_chosen_experts
from pdserve.engine.model.packed_experts import PackedExperts, pack_experts
from pdserve.engine.model.packed_linear import linear_kernel

HIDDEN, INTER, E = 64, 64, 6  # sides that fit AMX (multiples of 32) and AVX512-BF16


@pytest.fixture(scope="module")
def kernel(ops):
    found = linear_kernel(ops)
    if found is None:
        pytest.skip("this CPU has none of pdserve's linear kernels")
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


def test_packed_experts_sum_like_experts(kernel, ops):
    experts = _experts()
    x, ids, weights = _inputs(17, seed=1)
    reference = experts.float()(x.float(), ids, weights)
    packed = PackedExperts(_experts(), kernel, ops)(x, ids, weights)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed.float(), reference, rtol=2e-2, atol=2e-2)


def test_packed_experts_never_read_unchosen_experts(kernel, ops):
    packed = PackedExperts(_experts(), kernel, ops)
    x, _, weights = _inputs(3, seed=2)
    ids = torch.tensor([[4, 1], [1, 4], [4, 1]])  # experts 0, 2, 3, 5 unchosen
    before = packed(x, ids, weights)
    for e in (0, 2, 3, 5):
        packed.weights.gate_up[e].fill_(float("nan"))
        packed.weights.down[e].fill_(float("nan"))
    after = packed(x, ids, weights)
    assert torch.isfinite(after).all()
    assert torch.equal(before, after)


def _alone(ops, kernel, packed: PackedExperts, row: torch.Tensor, e: int) -> torch.Tensor:
    """Expert e's gate_up, `silu_mul` and down on its packed weights, for one row alone."""
    h = ops.silu_mul(kernel.run(row, packed.weights.gate_up[e], None))
    return kernel.run(h, packed.weights.down[e], None)


def test_each_expert_is_its_two_kernel_calls_and_silu_mul(kernel, ops):
    """One slot of weight 1, some experts chosen by several tokens, some by none: each token's
    output is bit for bit what its expert's kernel calls give it alone (a row's result does
    not depend on its expert's other rows)."""
    packed = PackedExperts(_experts(), kernel, ops)
    ids = torch.tensor([[2], [0], [2], [3], [0], [5], [2]])
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = ops.moe_experts(x, ids, torch.ones(7, 1), packed.weights)
    for t, e in enumerate(ids[:, 0].tolist()):
        assert torch.equal(got[t : t + 1], _alone(ops, kernel, packed, x[t : t + 1], e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_op_sums_slots_as_pytorch_does(kernel, ops, dtype):
    """Weighted slots summed in slot order in fp32 (each product rounded to bf16 first where
    the weights are bf16, as `run_chosen_experts` computes with PyTorch operators), to one
    bf16 rounding of the result."""
    packed = PackedExperts(_experts(), kernel, ops)
    x, ids, weights = _inputs(9, seed=4)
    weights = weights.to(dtype)
    expected = run_chosen_experts(x, ids, weights, E, lambda xs, counts: torch.cat(
        [_alone(ops, kernel, packed, xs[i : i + 1], e) for i, e in
         enumerate(torch.repeat_interleave(torch.arange(E), counts).tolist())]))
    got = packed(x, ids, weights)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-5)


def test_the_experts_op_refuses_bad_ids_and_weights(kernel, ops):
    packed = PackedExperts(_experts(), kernel, ops)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    ids, weights = torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    ids[3, 1] = 6
    with pytest.raises(RuntimeError, match="expert id 6 is outside the 6 experts"):
        ops.moe_experts(x, ids, weights, packed.weights)
    with pytest.raises(RuntimeError, match=r"ids must be contiguous int64 \[4, k\]"):
        ops.moe_experts(x, ids[:3], weights, packed.weights)
    with pytest.raises(RuntimeError, match=r"weights must be contiguous fp32 or bf16 \[4, 2\]"):
        ops.moe_experts(x, ids.clamp(max=5), weights.half(), packed.weights)


def test_pack_experts_leaves_fp32_and_misfit_experts_alone(kernel, ops):
    model = torch.nn.Sequential(Experts(E, HIDDEN, INTER), Experts(E, HIDDEN, 7).bfloat16())
    pack_experts(model, ops)
    assert [type(m) for m in model] == [Experts, Experts]  # fp32; odd width (7)
    model[0] = _experts()
    pack_experts(model, ops)
    assert type(model[0]) is PackedExperts
    alone = torch.nn.Sequential(_experts())
    pack_experts(alone, None)  # no compiled operators: PyTorch's
    assert type(alone[0]) is Experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_bf16_moe_model_decodes_on_packed_experts(tiny_model, kernel, arch):
    path = tiny_model(arch, hidden_size=64, moe_intermediate_size=32)  # fits every kernel
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128)
    kinds = {type(m) for m in llm.engine.model.modules()}
    assert PackedExperts in kinds and Experts not in kinds
    out = llm.generate([list(range(20, 40))], SamplingParams(temperature=0, max_tokens=6,
                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
