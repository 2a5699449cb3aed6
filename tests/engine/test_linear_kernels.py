"""pdserve's bf16 linear kernels (AMX tiles; AVX512-BF16's VDPBF16PS; fp32 FMAs over bf16
weights on AVX2) against PyTorch's bf16 linear and a float64 product. Each test runs for every
kernel this CPU has and skips the others."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve import LLM
from pdserve.engine import huge_pages
from pdserve.engine.model.packed_linear import (
    KernelLinear,
    LinearKernel,
    PackedLinear,
    available_kernels,
    linear_kernel,
    onednn_packs,
    pack_linears,
)
from tests.conftest import KV_BLOCKS
from tests.engine.test_cpu_kernels import KERNEL_SHAPE

BF16 = torch.bfloat16


@pytest.fixture(params=["amx", "avx512_bf16", "avx2"])
def kernel(request, ops) -> LinearKernel:
    available = {k.name: k for k in available_kernels(ops)}
    if request.param not in available:
        pytest.skip(f"this CPU has no {request.param}")
    return available[request.param]


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(out, inp, generator=gen) * inp**-0.5).to(BF16)
    return w, torch.randn(out, generator=gen).to(BF16)


@pytest.mark.parametrize("out,inp", [(960, 576), (64, 1536), (96, 64), (1088, 576)])
@pytest.mark.parametrize("rows", [1, 7, 8, 17, 32, 33, 100])
def test_the_kernel_is_as_close_to_a_float64_product_as_onednn(kernel, out, inp, rows):
    w, b = _weights(out, inp, rows)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(1)).to(BF16)
    packed = kernel.pack(w)
    for bias in (None, b):
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got, onednn = kernel.run(x, packed, bias), F.linear(x, w, bias)
        assert got.shape == (rows, out) and got.dtype == BF16
        ours, theirs = ((y.double() - exact).abs().mean() for y in (got, onednn))
        assert ours <= 1.05 * theirs, (ours, theirs)
        assert (got != onednn).float().mean() < 0.02  # the same sums, nearly always the same bits


def test_a_rows_result_does_not_depend_on_the_rows_batched_with_it(kernel):
    """Every row sums over K in the same order whatever M is: greedy decoding gives the same
    tokens alone or in any batch."""
    w, b = _weights(576, 576, 0)
    packed = kernel.pack(w)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(2)).to(BF16)
    full = kernel.run(x, packed, b)
    for rows in (1, 7, 8, 9, 16, 17, 33):
        assert torch.equal(kernel.run(x[:rows], packed, b), full[:rows])
    wide = torch.zeros(70, 1000, dtype=BF16)
    wide[:, 100:676] = x  # rows 1,000 apart in memory
    assert torch.equal(kernel.run(wide[:, 100:676], packed, b), full)
    assert kernel.run(x[:0], packed, b).shape == (0, 576)


@pytest.mark.parametrize(("out", "inp", "cuts"), [
    (64, 1536, ((0, 1), (255, 2), (256, 33), (511, 3), (660, 40))),
    (1088, 576, ((0, 1), (31, 2), (639, 3), (640, 33), (667, 33))),
])
def test_a_long_prompts_rows_taken_a_chunk_at_a_time_are_each_rows_alone(kernel, out, inp,
                                                                         cuts):
    """A long prompt's x is taken in chunks of rows that stay in L2 (AMX: 256 rows at K =
    1,536, 640 at 576; AVX2: 32), and AMX's columns in groups whose weights stay there beside
    it (16 items of 32 columns at K = 576: 1,088 columns are three groups): across and inside
    the chunks and groups a row gets the bits it gets alone."""
    w, b = _weights(out, inp, 3)
    packed = kernel.pack(w)
    x = torch.randn(700, inp, generator=torch.Generator().manual_seed(4)).to(BF16)
    full = kernel.run(x, packed, b)
    for first, rows in cuts:
        assert torch.equal(kernel.run(x[first:first + rows], packed, b),
                           full[first:first + rows]), (first, rows)


def test_the_kernel_refuses_a_mismatched_input(kernel):
    packed = kernel.pack(_weights(64, 576, 0)[0])
    with pytest.raises(RuntimeError, match="x has 512 features, the packed weight 576"):
        kernel.run(torch.zeros(2, 512, dtype=BF16), packed, None)
    with pytest.raises(RuntimeError, match=f"N a multiple of {kernel.out_multiple}"):
        kernel.pack(torch.zeros(kernel.out_multiple + 8, 576, dtype=BF16))


def test_the_cpu_gets_its_fastest_kernel(ops):
    chosen = linear_kernel(ops)
    if ops.amx_available():
        assert chosen.name == "amx"
    elif ops.dpbf16_available():
        assert chosen.name == "avx512_bf16"
    elif ops.avx2_available():
        assert chosen.name == "avx2"
    else:
        assert chosen is None
    assert linear_kernel(None) is None  # --no-cpu-kernels: oneDNN


def test_pack_linears_takes_the_kernel_where_the_shape_fits(ops):
    kernel = linear_kernel(ops)
    if kernel is None:
        pytest.skip("this CPU has no linear kernel of pdserve's")
    model = nn.Sequential(nn.Linear(576, 960, bias=False).to(BF16), nn.Linear(100, 40).to(BF16),
                          nn.Linear(576, 960))
    pack_linears(model, ops)
    # a bf16 layer off the kernel goes to oneDNN where oneDNN has bf16 here (not on AVX2)
    unfit = PackedLinear if onednn_packs(BF16) else nn.Linear
    assert [type(m) for m in model] == [KernelLinear, unfit, PackedLinear]
    assert model[0].kernel.name == kernel.name
    plain = nn.Sequential(nn.Linear(576, 960).to(BF16))
    pack_linears(plain, None)  # without pdserve's operators (--no-cpu-kernels): oneDNN
    assert type(plain[0]) is unfit


def test_the_bf16_engine_runs_its_linears_on_the_kernel(ops, tiny_model):
    kernel = linear_kernel(ops)
    if kernel is None:
        pytest.skip("this CPU has no linear kernel of pdserve's")
    llm = LLM(model=str(tiny_model("llama", **KERNEL_SHAPE)), dtype="bfloat16", max_model_len=64,
              num_kv_blocks=KV_BLOCKS)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, KernelLinear | PackedLinear)]
    assert {type(m) for m in linears} == {KernelLinear}
    assert {m.kernel.name for m in linears} == {kernel.name}
    # side by side in one mapping that starts on a huge page
    packed = sorted((m.packed for m in linears), key=lambda t: t.data_ptr())
    assert packed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(a.data_ptr() + a.nbytes == b.data_ptr()
               for a, b in itertools.pairwise(packed))


def test_a_kernel_layer_adds_its_bias_as_the_kernel_does(ops):
    kernel = linear_kernel(ops)
    if kernel is None:
        pytest.skip("this CPU has no linear kernel of pdserve's")
    layer = nn.Linear(576, 960).to(BF16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = nn.Sequential(layer)
    pack_linears(model, ops)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(4)).to(BF16)
    assert isinstance(model[0], KernelLinear)
    assert torch.equal(model(x), kernel.run(x, kernel.pack(w), b))
