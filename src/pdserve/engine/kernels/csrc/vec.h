// bf16 <-> fp32 vector helpers over ATen's Vectorized (AVX-512: 32 bf16 = two 16-float
// vectors). Conversions round to nearest even, as a PyTorch .to(torch.bfloat16) does.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace pdserve {

using bf16 = c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<bf16>;
constexpr int64_t kVec = Vec::size();    // floats per vector
constexpr int64_t kBVec = BVec::size();  // bf16 per vector (2 * kVec)

// Up to kBVec bf16 at p as two float vectors (lanes past `count` are zero).
inline std::pair<Vec, Vec> load_bf16(const bf16* p, int64_t count = kBVec) {
  const BVec v = count == kBVec ? BVec::loadu(p) : BVec::loadu(p, count);
  auto [a, b] = at::vec::convert_to_float<bf16>(v);
  return {a, b};
}

// kBVec bf16 at p as fp32 in "quad order": on AVX2, a = elements 0-3 and 8-11, b = 4-7 and
// 12-15, from two unpacks (ATen's natural-order conversion, `load_bf16`, takes a second load
// and five operations); `quads` turns a pair of vectors from quad order to natural order and
// back. Elsewhere quad order is natural order.
#if defined(CPU_CAPABILITY_AVX2)
inline std::pair<Vec, Vec> load_quads(const bf16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();  // a bf16 is the top half of its fp32
  return {Vec(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v))),
          Vec(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)))};
}

inline std::pair<Vec, Vec> quads(const Vec& a, const Vec& b) {
  return {Vec(_mm256_permute2f128_ps(a, b, 0x20)), Vec(_mm256_permute2f128_ps(a, b, 0x31))};
}
#else
inline std::pair<Vec, Vec> load_quads(const bf16* p) { return load_bf16(p); }

inline std::pair<Vec, Vec> quads(const Vec& a, const Vec& b) { return {a, b}; }
#endif

// q[0, n) in place: each whole kBVec block into quad order (`quads`), the tail as it is.
inline void to_quads(float* q, int64_t n) {
  for (int64_t i = 0; i + kBVec <= n; i += kBVec) {
    auto [a, b] = quads(Vec::loadu(q + i), Vec::loadu(q + i + kVec));
    a.store(q + i);
    b.store(q + i + kVec);
  }
}

// a and b rounded to nearest even into kBVec bf16 (a the first half). With AVX512-BF16 one
// VCVTNE2PS2BF16, where ATen's conversion takes ~17 integer operations; the two differ only on
// fp32 denormals (below 1.2e-38), which the instruction flushes to zero, and on NaN's payload.
inline BVec to_bvec(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  return BVec((__m512i)_mm512_cvtne2ps_pbh(b, a));
#else
  return at::vec::convert_from_float<bf16>(a, b);
#endif
}

inline void store_bf16(bf16* p, const Vec& a, const Vec& b, int64_t count = kBVec) {
  to_bvec(a, b).store(p, count);
}

// x rounded to bf16 and back: a separate PyTorch op's rounding point inside a fused one.
inline std::pair<Vec, Vec> round_bf16(const Vec& a, const Vec& b) {
  auto [x, y] = at::vec::convert_to_float<bf16>(to_bvec(a, b));
  return {x, y};
}

inline float sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);  // a shuffle tree; ATen's generic reduction is a scalar loop
#else
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
#endif
}

inline float max_lane(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); },
                                        v);
#endif
}

// Lane i of the result is the sum of the lanes of v[i], for i < kVec. On AVX-512 a transpose-
// and-add tree: 45 instructions for 16 sums, against ~8 for each one alone (`sum`); on AVX2 a
// hadd tree: 9 for 8.
inline Vec sum_each(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  // pairs of rows: per 128-bit lane, (a0 + a2, b0 + b2, a1 + a3, b1 + b3)
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // quads: per 128-bit lane, that lane's sum of rows 4i ... 4i + 3
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // across the four lanes: lanes (0 + 1, 2 + 3) of two quads, then of those
  const auto fold = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xdd));
  };
  return fold(fold(x[0], x[1]), fold(x[2], x[3]));
#elif defined(CPU_CAPABILITY_AVX2)
  // per 128-bit lane: pair sums of two rows, then of four rows (each row's low or high half)
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // rows 0-3 | 4-7: the low halves' sums plus the high halves'
  return Vec(_mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                           _mm256_permute2f128_ps(ab, cd, 0x31)));
#else
  alignas(64) float out[kVec];
  for (int64_t i = 0; i < kVec; ++i) out[i] = sum(v[i]);
  return Vec::loadu(out);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// exp(x) for x <= 0 (-inf gives 0) as 2^y, y = x log2(e): n = round(y), f = y - n in
// [-1/2, 1/2], 2^f = e^(f ln 2) by its Taylor series to degree 5 (relative error below
// (ln 2 / 2)^6 / 6! = 2.4e-6, far under bf16's rounding, 2^-9), and VSCALEFPS multiplies by
// 2^n, flushing to 0 below fp32's range. About half the instructions of ATen's exp_u20, which
// guards the whole float range.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));  // log2(e)
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 t = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147181f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 120);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) x u = g sigmoid(g) u (Elfwing et al. 2018) with e = exp(-|g|) in (0, 1]: sigmoid(g)
// = 1 / (1 + e) for g >= 0 and e / (1 + e) below, so 1 + e is in (1, 2] and its reciprocal
// is VRCP14PS (relative error below 2^-14) and one Newton step, r (2 - d r), which squares the
// error (~2^-28, about fp32's rounding), in place of a VDIVPS.
inline __m512 silu_times(__m512 g, __m512 u) {
  const __m512 e = exp_nonpositive(_mm512_or_ps(g, _mm512_set1_ps(-0.f)));  // exp(-|g|)
  const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
  const __m512 r0 = _mm512_rcp14_ps(d);
  const __m512 r = _mm512_fmadd_ps(_mm512_fnmadd_ps(d, r0, _mm512_set1_ps(1.f)), r0, r0);
  const __m512 sigmoid = _mm512_mask_mul_ps(r, _mm512_movepi32_mask(_mm512_castps_si512(g)),
                                            r, e);
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}
#endif

// n bf16 at src into fp32 at dst, and back (rounding to nearest even).
inline void to_float(const bf16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kBVec) {
    const int64_t c = std::min(kBVec, n - i);
    auto [a, b] = load_bf16(src + i, c);
    if (c == kBVec) {
      a.store(dst + i);
      b.store(dst + i + kVec);
    } else {
      a.store(dst + i, std::min(c, kVec));
      if (c > kVec) b.store(dst + i + kVec, c - kVec);
    }
  }
}

inline void to_bf16(const float* src, bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += kBVec) {
    const int64_t c = std::min(kBVec, n - i);
    if (c == kBVec) {
      store_bf16(dst + i, Vec::loadu(src + i), Vec::loadu(src + i + kVec));
    } else {
      store_bf16(dst + i, Vec::loadu(src + i, std::min(c, kVec)),
                 Vec::loadu(src + i + kVec, std::max<int64_t>(c - kVec, 0)), c);
    }
  }
}

// The maximum of bf16 p[0, n) as a float, NaN if one is there (torch.max's rule: NaN is larger
// than everything): vectors, then the tail.
inline float row_max(const bf16* p, int64_t n) {
  const int64_t body = n - n % kBVec;
  Vec best(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < body; i += kBVec) {
    auto [a, b] = load_bf16(p + i);
    best = at::vec::maximum(best, at::vec::maximum(a, b));  // NaN-propagating
  }
  float m = at::vec::vec_reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, best);
  for (int64_t i = body; i < n; ++i) {
    const float v = static_cast<float>(p[i]);
    m = std::isnan(v) || v > m ? v : m;
  }
  return m;
}

// Index of the first entry of bf16 p[0, n) equal to `m`, the row's `row_max` (so of its first
// NaN when m is NaN: torch.max's rule), or 0 if none is; vectors, then the tail.
inline int64_t max_index(const bf16* p, int64_t n, float m) {
  if (std::isnan(m)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(p[i]))) return i;
    return 0;
  }
  const int64_t body = n - n % kBVec;
  const Vec target(m);
  for (int64_t i = 0; i < body; i += kBVec) {
    auto [a, b] = load_bf16(p + i);
    // zero_mask: bit j set where lane j is 0, i.e. where the lane equals the maximum
    const int lo = (a != target).zero_mask(), hi = (b != target).zero_mask();
    if (lo) return i + __builtin_ctz(lo);
    if (hi) return i + kVec + __builtin_ctz(hi);
  }
  for (int64_t i = body; i < n; ++i)
    if (static_cast<float>(p[i]) == m) return i;
  return 0;
}

}  // namespace pdserve
