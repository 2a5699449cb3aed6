// The packed K/V tiles, the online-softmax step, the query gather and the output of the
// VDPBF16PS prefill attention (prefill_attention.cpp), in the order the instruction takes its
// second operand; the AMX kernel (prefill_attention_amx.cpp) packs its own transposed tiles and
// takes transpose16 from here.
//
// Keys go in tiles of kTile = 64 positions aligned to absolute positions (tile t is
// [64 t, 64 t + 64)). Each KV head's tiles are packed once per call from the pool, read in
// place through the block table (no gathered copy of the context):
//   K tile: [D/2 pairs][64 keys][2]   a VDPBF16PS vector = one dimension pair of 16 keys
//   V tile: [32 key pairs][D][2]      a vector = one key pair of 16 dimensions
// Positions past `len` are packed as zeros (the pool's free slots may hold anything, NaN
// included, and 0 x NaN is NaN).
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_context.h"
#include "vec.h"

namespace pdserve::prefill_tiles {

constexpr int64_t kTile = 64;  // keys per tile: 4 vectors of 16 fp32 scores

// The KV heads' packed tiles, in bf16 pairs (per_tile: 64 x D / 2).
using Packed = KVTiles<uint32_t>;

struct PackTag;
using Pool = PagedContext;

// 16 x 16 32-bit transpose in registers: out[c] lane i = r[i] lane c. Within each 128-bit lane
// L (columns 4L .. 4L + 3), unpacking 32 then 64-bit elements transposes the 4 x 4 blocks of
// rows 4k .. 4k + 3; u[4k + m] then holds, in lane L, those rows' column 4L + e(m), with
// e = (0, 2, 1, 3). Output row 4L + e(m) is lane L of u[m], u[4 + m], u[8 + m], u[12 + m]: a
// 4 x 4 transpose of 128-bit lanes, two rounds of lane shuffles.
inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int k = 0; k < 16; k += 4) {
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);          // column 0 of the lane
    u[k + 1] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);  // column 2
    u[k + 2] = _mm512_unpackhi_epi64(t[k], t[k + 2]);      // column 1
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);  // column 3
  }
  constexpr int kColumn[4] = {0, 2, 1, 3};
  for (int m = 0; m < 4; ++m) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // A.L0 A.L2 B.L0 B.L2
    const __m512i s1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // A.L1 A.L3 B.L1 B.L3
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    const int e = kColumn[m];
    out[e] = _mm512_shuffle_i32x4(s0, s2, 0x88);       // lane 0 of A, B, C, D
    out[8 + e] = _mm512_shuffle_i32x4(s0, s2, 0xdd);   // lane 2
    out[4 + e] = _mm512_shuffle_i32x4(s1, s3, 0x88);   // lane 1
    out[12 + e] = _mm512_shuffle_i32x4(s1, s3, 0xdd);  // lane 3
  }
}

// Packs tile t of KV head g (see the file comment), zeros past len.
inline void pack_tile(const Pool& pool, int64_t g, int64_t t, int64_t len, uint32_t* kt,
                      uint32_t* vt) {
  const int64_t d = pool.d, first = t * kTile;
  const int64_t valid = std::min(kTile, len - first);
  const __m512i zero = _mm512_setzero_si512();
  // K: 16 keys x 16 dimension pairs at a time, transposed to [pair][key]
  for (int64_t j0 = 0; j0 < kTile; j0 += 16)
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
      __m512i r[16], c[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j0 + j < valid ? _mm512_loadu_si512(pool.k + pool.row(first + j0 + j, g) + 2 * p0)
                              : zero;
      transpose16(r, c);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (p0 + p) * kTile + j0, c[p]);
    }
  // V: rows 2j and 2j + 1 interleaved element by element, 32 dimensions at a time
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < kTile; j += 2) {
    const bf16* a = j < valid ? pool.v + pool.row(first + j, g) : nullptr;
    const bf16* b = j + 1 < valid ? pool.v + pool.row(first + j + 1, g) : nullptr;
    uint32_t* out = vt + (j / 2) * d;
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i x = a ? _mm512_loadu_si512(a + e) : zero;
      const __m512i y = b ? _mm512_loadu_si512(b + e) : zero;
      _mm512_storeu_si512(out + e, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + e + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

inline Packed pack(const Pool& pool, int64_t kvh, int64_t len) {
  return pack_kv_tiles<uint32_t, PackTag>(
      kvh, (len + kTile - 1) / kTile, kTile * pool.d / 2, 4,
      [&](int64_t g, int64_t t, uint32_t* k, uint32_t* v) { pack_tile(pool, g, t, len, k, v); });
}

// One row's online-softmax update for one tile (prefill_attention.cpp's file comment): s [64]
// unscaled dot products with keys >= `valid` masked; writes p [64] bf16 from s x scale,
// returns alpha = exp(m - m') and updates m, l.
inline float softmax_tile(const float* s, int64_t valid, float scale, float& m, float& l,
                          uint32_t* p) {
  __m512 x[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t keep = std::clamp<int64_t>(valid - c * 16, 0, 16);
    const __mmask16 k = static_cast<__mmask16>((1u << keep) - 1u);
    x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), k,
                              _mm512_loadu_ps(s + c * 16), _mm512_set1_ps(scale));
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]),
                                                       _mm512_max_ps(x[2], x[3])));
  const float next = std::max(m, top);
  // 0 on the first tile (m = -inf); exactly 1 while the maximum holds
  const float alpha = next == m ? 1.f : std::exp(m - next);
  const __m512 mv = _mm512_set1_ps(next);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; c += 2) {
    const int64_t keep0 = std::clamp<int64_t>(valid - c * 16, 0, 16);
    const int64_t keep1 = std::clamp<int64_t>(valid - c * 16 - 16, 0, 16);
    const __m512 e0 = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << keep0) - 1u),
                                          exp_nonpositive(_mm512_sub_ps(x[c], mv)));
    const __m512 e1 = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << keep1) - 1u),
                                          exp_nonpositive(_mm512_sub_ps(x[c + 1], mv)));
    const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);  // [e0 | e1] rounded to bf16
    _mm512_storeu_si512(p + c * 8, (__m512i)pb);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
  }
  m = next;
  l = l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
}

// An item's query rows (its G heads x `positions` positions from `first`, position-major; row
// r = i G + h) as bf16 pairs `d / 2` apart, and the keys each attends (start + first + i + 1).
inline void gather_rows(const at::Tensor& q, int64_t first, int64_t positions, int64_t g,
                        int64_t group, int64_t start, uint32_t* rows, int64_t* limit) {
  const int64_t d = q.size(2);
  const bf16* qp = q.data_ptr<bf16>();
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      std::memcpy(rows + r * d / 2, qp + (first + i) * q.stride(0) + (g * group + h) * q.stride(1),
                  d * sizeof(bf16));
      limit[r] = start + first + i + 1;
    }
}

// out rows (position first + i, head g G + h of `heads`) = o_r / l_r rounded to bf16.
inline void emit_rows(const float* o, const float* l, int64_t first, int64_t positions,
                      int64_t g, int64_t group, int64_t d, int64_t heads, bf16* out) {
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      const Vec inv(1.f / l[r]);
      bf16* dst = out + ((first + i) * heads + g * group + h) * d;
      for (int64_t e = 0; e < d; e += kBVec)
        store_bf16(dst + e, Vec::loadu(&o[r * d + e]) * inv,
                   Vec::loadu(&o[r * d + e + kVec]) * inv);
    }
}

}  // namespace pdserve::prefill_tiles

#endif
