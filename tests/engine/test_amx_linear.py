"""pdserve's AMX linear layer (bf16, CPUs with AMX) against oneDNN's and a float64 product."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve import LLM
from pdserve.engine import huge_pages, kernels
from pdserve.engine.model.packed_linear import AmxLinear, PackedLinear, pack_linears
from tests.engine.test_cpu_kernels import KERNEL_SHAPE

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    module = kernels.cpu_ops()
    assert module is not None, "the CPU operators must build on the test machine"
    if not module.amx_available():
        pytest.skip("this CPU has no AMX")
    return module


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inp, generator=gen) * inp**-0.5).to(BF16)
    return w, torch.randn(out, generator=gen).to(BF16)


@pytest.mark.parametrize("out,inp", [(960, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 7, 17, 32, 33, 100])
def test_amx_linear_is_as_close_to_a_float64_product_as_onednn(ops, out, inp, rows):
    w, b = _weights(out, inp, rows)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1)).to(BF16)
    packed = ops.amx_pack(w)
    for bias in (None, b):
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got, onednn = ops.amx_linear(x, packed, bias), F.linear(x, w, bias)
        assert got.shape == (rows, out) and got.dtype == BF16
        ours, theirs = ((y.double() - exact).abs().mean() for y in (got, onednn))
        assert ours <= 1.05 * theirs, (ours, theirs)
        assert (got != onednn).float().mean() < 0.01  # the same sums, nearly always the same bits


def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(ops):
    """Every row sums over K in the same order whatever M is: greedy decoding gives the same
    tokens alone or in any batch."""
    w, b = _weights(576, 576, 0)
    packed = ops.amx_pack(w)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(BF16)
    full = ops.amx_linear(x, packed, b)
    for rows in (1, 16, 17, 33):
        assert torch.equal(ops.amx_linear(x[:rows], packed, b), full[:rows])
    wide = torch.zeros(70, 1000, dtype=BF16)
    wide[:, 100:676] = x  # rows 1,000 apart in memory
    assert torch.equal(ops.amx_linear(wide[:, 100:676], packed, b), full)
    assert ops.amx_linear(x[:0], packed, b).shape == (0, 576)


def test_amx_linear_refuses_a_mismatched_input(ops):
    packed = ops.amx_pack(_weights(64, 576, 0)[0])
    with pytest.raises(RuntimeError, match="x has 512 features, the packed weight 576"):
        ops.amx_linear(torch.zeros(2, 512, dtype=BF16), packed, None)
    with pytest.raises(RuntimeError, match="N a multiple of 32"):
        ops.amx_pack(torch.zeros(48, 576, dtype=BF16))


def test_pack_linears_takes_amx_where_the_shape_fits(ops):
    model = nn.Sequential(nn.Linear(576, 960, bias=False).to(BF16), nn.Linear(100, 64).to(BF16),
                          nn.Linear(576, 960))
    pack_linears(model, ops)
    assert [type(m) for m in model] == [AmxLinear, PackedLinear, PackedLinear]
    plain = nn.Sequential(nn.Linear(576, 960).to(BF16))
    pack_linears(plain, None)  # without pdserve's operators (--no-cpu-kernels): oneDNN
    assert isinstance(plain[0], PackedLinear)


def test_the_bf16_engine_runs_its_linears_on_amx(ops, tiny_model):
    llm = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16", max_model_len=64)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, AmxLinear | PackedLinear)]
    assert {type(m) for m in linears} == {AmxLinear}
    # side by side in one mapping that starts on a huge page
    packed = sorted((m.packed for m in linears), key=lambda t: t.data_ptr())
    assert packed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(a.data_ptr() + a.nbytes == b.data_ptr()
               for a, b in itertools.pairwise(packed))


def test_an_amx_layer_adds_its_bias_as_the_kernel_does(ops):
    layer = nn.Linear(576, 960).to(BF16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = nn.Sequential(layer)
    pack_linears(model, ops)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4)).to(BF16)
    assert isinstance(model[0], AmxLinear)
    assert torch.equal(model(x), ops.amx_linear(x, ops.amx_pack(w), b))
