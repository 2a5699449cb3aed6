"""Routed experts on pdserve's bf16 linear kernels: the same sums as `Experts` to bf16
rounding, each expert exactly as its two kernel calls and `silu_mul` compute it, an unchosen
expert's packed bytes never read, and a bf16 MoE model loads with them."""

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


def test_each_expert_is_its_two_kernel_calls_and_silu_mul(kernel, ops):
    """Rows grouped by expert, some experts with none: each row's output is bit for bit what
    gate_up, `silu_mul` and down on that expert's packed weights give it alone."""
    packed = PackedExperts(_experts(), kernel, ops)
    counts = torch.tensor([2, 0, 3, 1, 0, 1])
    xs = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = ops.moe_experts(xs, counts, packed.weights)
    rows = xs.split(counts.tolist())
    for e, (n, x) in enumerate(zip(counts.tolist(), rows, strict=True)):
        start = sum(counts[:e].tolist())
        for r in range(n):  # alone: a row's result does not depend on its expert's other rows
            h = ops.silu_mul(kernel.run(x[r : r + 1], packed.weights.gate_up[e], None))
            alone = kernel.run(h, packed.weights.down[e], None)
            assert torch.equal(got[start + r : start + r + 1], alone)


def test_the_experts_op_refuses_counts_that_do_not_cover_the_rows(kernel, ops):
    packed = PackedExperts(_experts(), kernel, ops)
    xs = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="counts cover 3 of 4 rows"):
        ops.moe_experts(xs, torch.tensor([1, 2, 0, 0, 0, 0]), packed.weights)
    with pytest.raises(RuntimeError, match="counts exceed the 4 rows"):
        ops.moe_experts(xs, torch.tensor([3, 2, 0, 0, 0, 0]), packed.weights)
    with pytest.raises(RuntimeError, match=r"counts must be a contiguous int64 \[6\] tensor"):
        ops.moe_experts(xs, torch.tensor([4, 0, 0, 0, 0]), packed.weights)


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
