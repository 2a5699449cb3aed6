"""The absorbed MLA decode operator (`mla_decode`) against the attention it stands for, written
out in fp64 from expanded per-head keys and values: the same output to bf16 rounding, at odd
sizes (tails of every vector loop), on strided queries, paged contexts of several lengths, and
a request's result independent of its batch; bad arguments refused with the reason."""

from __future__ import annotations

import pytest
import torch

H, R, D_N, D_R, D_V, BS = 3, 40, 24, 8, 20, 4  # none a multiple of a vector
LENS = [1, 7, 13]  # one position, part of a block, several blocks
# Widths past the operator's column chunks (64 bf16 on AVX2, 128 on AVX-512) with a tail.
WIDE = {"h": 2, "r": 136, "d_n": 24, "d_r": 16, "d_v": 144}


def _inputs(seed: int = 0, h: int = H, r: int = R, d_n: int = D_N, d_r: int = D_R,
            d_v: int = D_V) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.5).bfloat16()

    q = rand(len(LENS), h, d_n + d_r)  # as the model splits q_b_proj's output: strided heads
    blocks = torch.randperm(16, generator=gen)[: 4 * len(LENS)].view(len(LENS), 4)
    return {"q_nope": q[..., :d_n], "q_rope": rand(len(LENS), h, d_r),
            "cache": rand(16, BS, r + d_r), "block_tables": blocks.contiguous(),
            "lens": torch.tensor(LENS), "w_uk": rand(h, d_n, r), "w_uv": rand(h, r, d_v)}


def _reference(a: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """Per request: keys k_h = [W_UK,h c_t ; k_rope_t], values v_h = W_UV,h c_t, softmax
    attention of [q_nope ; q_rope] (DeepSeek-V2 paper, eqs. 10-18), fp64 -> [B, H, d_v]."""
    out = []
    w_uk, w_uv = a["w_uk"].double(), a["w_uv"].double()
    h, _, r = w_uk.shape
    d_r = a["q_rope"].shape[-1]
    for b, length in enumerate(a["lens"].tolist()):
        rows = a["cache"][a["block_tables"][b]].flatten(0, 1)[:length].double()  # [L, r + d_r]
        c, k_rope = rows.split([r, d_r], dim=-1)
        k = torch.cat([torch.einsum("hnr,lr->hln", w_uk, c),
                       k_rope[None].expand(h, length, d_r)], dim=-1)  # [H, L, d_n + d_r]
        v = torch.einsum("hrv,lr->hlv", w_uv, c)  # [H, L, d_v]
        q = torch.cat([a["q_nope"][b], a["q_rope"][b]], dim=-1).double()  # [H, d_n + d_r]
        p = torch.softmax(scale * torch.einsum("hd,hld->hl", q, k), dim=-1)
        out.append(torch.einsum("hl,hlv->hv", p, v))
    return torch.stack(out)


def _call(ops, a: dict[str, torch.Tensor], scale: float = 0.15) -> torch.Tensor:
    return ops.mla_decode(a["q_nope"], a["q_rope"], a["cache"], a["block_tables"], a["lens"],
                          a["w_uk"], a["w_uv"], scale)


@pytest.mark.parametrize("sizes", [{}, WIDE], ids=["odd", "wide"])
def test_mla_decode_equals_expanded_attention_to_bf16_rounding(ops, sizes):
    a = _inputs(**sizes)
    out = _call(ops, a)
    assert out.dtype == torch.bfloat16 and out.shape == (len(LENS), sizes.get("h", H),
                                                         sizes.get("d_v", D_V))
    expected = _reference(a, 0.15)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    # the one-position context attends only its own row: softmax weight 1
    only = a["cache"][a["block_tables"][0, 0], 0, : a["w_uk"].shape[2]].double()
    torch.testing.assert_close(out[0].double(), torch.einsum("hrv,r->hv", a["w_uv"].double(), only),
                               rtol=1e-2, atol=1e-2)


def test_a_requests_result_does_not_depend_on_its_batch(ops):
    a = _inputs(seed=1)
    together = _call(ops, a)
    for b in range(len(LENS)):
        alone = {k: (v[b : b + 1] if k in ("q_nope", "q_rope", "block_tables", "lens") else v)
                 for k, v in a.items()}
        assert torch.equal(_call(ops, alone)[0], together[b])


def test_positions_past_a_requests_length_are_not_read(ops):
    a = _inputs(seed=2)
    before = _call(ops, a)
    blocks, length = a["block_tables"][1], LENS[1]
    a["cache"][blocks[length // BS], length % BS :] = float("nan")  # the rest of its last block
    a["cache"][blocks[length // BS + 1 :]] = float("nan")
    other = set(a["block_tables"][[0, 2]].flatten().tolist())
    assert not other & set(blocks[length // BS :].tolist())
    assert torch.equal(_call(ops, a)[1], before[1])


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.update(lens=torch.tensor([1, 7, 17])), "does not fit a table of 4 blocks"),
    (lambda a: a["block_tables"].__setitem__((2, 0), 16), "block id 16 is outside the pool"),
    (lambda a: a.update(w_uv=a["w_uv"][:, :-1].contiguous()), "disagree on heads or sizes"),
    (lambda a: a.update(cache=a["cache"].float()), "bf16 latent pool [num_blocks, block_size, 48]"),
    (lambda a: a.update(w_uk=a["w_uk"].float()), "w_uk and w_uv must be contiguous bf16"),
    (lambda a: a.update(lens=torch.tensor([1, 7])), "lens must be contiguous int64 [B]"),
])
def test_bad_arguments_are_refused_with_the_reason(ops, change, message):
    a = _inputs()
    change(a)
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _call(ops, a)
