"""The Triton kernels of `triton_paged` (whose docstrings state what they compute). A module
of their own because importing it imports Triton: only an engine that uses them does."""

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_tb,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_SIZE_P: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_P)  # query heads of this KV head
    d = tl.arange(0, HEAD_DIM_P)
    s = tl.arange(0, BLOCK_SIZE_P)  # slots of one block
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [G, D]
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for i in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + i).to(tl.int64)
        s_ok = (s < BLOCK_SIZE) & (i * BLOCK_SIZE + s < length)
        kv_ok = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + s[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        scores = tl.where(s_ok[None, :], scores, float("-inf"))  # [G, S]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + block * stride_vb + s[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :],
                                            axis=1)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    o = acc / l_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, num_tokens, context_len, scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS_P: tl.constexpr, ROWS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    r = tile * ROWS + tl.arange(0, ROWS)  # query rows of this tile
    d = tl.arange(0, HEAD_DIM_P)
    s = tl.arange(0, KEYS_P)  # slots of one block (KEYS_P >= BLOCK_SIZE)
    r_ok = r < num_tokens
    d_ok = d < HEAD_DIM
    q_pos = context_len - num_tokens + r  # [M]
    q = tl.load(q_ptr + r[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], tl.float32)
    # the tile's last row attends up to its own position: blocks past it are never read
    last = tl.minimum(context_len, context_len - num_tokens + tile * ROWS + ROWS)
    for i in range(0, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(table_ptr + i).to(tl.int64)
        k_pos = i * BLOCK_SIZE + s  # [S]
        s_ok = (s < BLOCK_SIZE) & (k_pos < context_len)
        kv_ok = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh
                    + d[None, :], mask=kv_ok, other=0.0)  # [S, D]
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, S] fp32
        causal = s_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + block * stride_vb + s[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :], mask=kv_ok, other=0.0)  # [S, D]
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
    o = acc / l_sum[:, None]
    tl.store(out_ptr + r[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
