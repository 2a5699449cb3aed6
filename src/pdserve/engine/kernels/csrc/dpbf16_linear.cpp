// bf16 linear layer on AVX512-BF16's VDPBF16PS, for CPUs that have it but no AMX tiles
// (AMD Zen 4 and later, Intel Cooper Lake).
//
// VDPBF16PS (Intel SDM vol. 2, "VDPBF16PS"): for each of 16 fp32 lanes j,
// acc[j] += a[2j] * b[2j] + a[2j+1] * b[2j+1], with a and b 32 bf16 each. The weight is packed
// once so that one 64-byte vector holds one K-pair of 16 output columns: [N/16][K/2][16 n][2]
// ("VNNI" order, as one AMX B-tile row). For row m and K-pair p, a is x[m][2p..2p+1] broadcast
// to every lane (an embedded 32-bit broadcast), so one instruction adds a K-pair's products to 16
// columns of one row.
//
// Register blocking: a block is kRows rows x kGroups groups of 16 columns, 8 x 3 = 24 fp32
// accumulators (plus 3 weight vectors and a broadcast: 28 of the 32 zmm). Per K-pair it loads 3
// weight vectors and 8 broadcasts for 24 products, so at 8 or more rows the loop is bound by the
// VDPBF16PS throughput, not by loads; at 1 row it streams the weights (one vector per product).
// A thread owns a contiguous range of column groups; its current 3 groups' weights (3 x K x 32
// bytes, <= 144 KiB at K = 1536) stay in L2 while the row blocks reuse them, so weights cross the
// memory bus once per call.
//
// Every output's sum runs over K in one chain, in order, whatever the block shape: a row's result
// does not depend on the rows batched with it (greedy decoding gives the same tokens alone or in
// a batch).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

#include "linear_call.h"
#include "ops.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_DPBF16 1
#endif

namespace pdserve {

#ifdef PDSERVE_DPBF16
namespace {

constexpr int64_t kGroup = 16;  // output columns per vector
constexpr int kRows = 8;        // rows per block
constexpr int kGroups = 3;      // column groups per block

// out[r][16 g + j] = sum_p x[r][2p..2p+1] . w[g][p][j][0..1] (+ bias), for the block's rows
// and groups. x rows (ldx apart) are read as 32-bit K-pairs; w is the first group's packed
// weight, the next groups kp vectors further each.
template <int R, int G>
void block(const bf16* x, int64_t ldx, const bf16* w, int64_t kp, const float* bias, bf16* out,
           int64_t ldo) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * ldx);
  const __m512i* wv = reinterpret_cast<const __m512i*>(w);
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[G];
    for (int g = 0; g < G; ++g) b[g] = (__m512bh)_mm512_loadu_si512(wv + g * kp + p);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][p]);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kGroup) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][g], bv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + g * kGroup),
                          reinterpret_cast<const __m256i&>(v));
    }
  }
}

using BlockFn = void (*)(const bf16*, int64_t, const bf16*, int64_t, const float*, bf16*,
                         int64_t);

template <int G, int... R>
constexpr std::array<BlockFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {&block<R + 1, G>...};
}

// kBlocks[g - 1][r - 1] runs r rows x g groups.
constexpr auto kSeq = std::make_integer_sequence<int, kRows>{};
constexpr std::array<std::array<BlockFn, kRows>, kGroups> kBlocks = {
    rows_table<1>(kSeq), rows_table<2>(kSeq), rows_table<3>(kSeq)};

}  // namespace

bool dpbf16_available() { return true; }

at::Tensor dpbf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(0) % kGroup == 0 && weight.size(1) % 2 == 0,
              "dpbf16_pack needs a bf16 [N, K] weight with N a multiple of 16 and K even");
  const int64_t n = weight.size(0), k = weight.size(1);
  // [N, K] -> [N/16, 16 n, K/2, 2] -> [N/16, K/2, 16 n, 2]
  return weight.reshape({n / kGroup, kGroup, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor dpbf16_linear(const at::Tensor& x_in, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4, "the packed weight is dpbf16_pack's 4-d layout");
  const int64_t kp = packed.size(1), groups = packed.size(0);
  const LinearCall call = linear_call(x_in, kp * 2, groups * kGroup, bias);
  const int64_t m = call.m, n = call.n, ldx = call.ldx;
  const bf16* xp = call.xp();
  const bf16* wp = packed.data_ptr<bf16>();
  const float* bp = call.bp();
  bf16* op = call.op();
  const int64_t group_elems = kp * 2 * kGroup;  // bf16 per packed column group
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g += kGroups) {
      const int64_t gs = std::min<int64_t>(kGroups, g1 - g);
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - m0);
        kBlocks[gs - 1][rows - 1](xp + m0 * ldx, ldx, wp + g * group_elems, kp,
                                  bp ? bp + g * kGroup : nullptr, op + m0 * n + g * kGroup, n);
      }
    }
  });
  return call.out;
}

#else  // compiled for a CPU without AVX512-BF16

bool dpbf16_available() { return false; }

at::Tensor dpbf16_pack(const at::Tensor&) { TORCH_CHECK(false, "built without AVX512-BF16"); }

at::Tensor dpbf16_linear(const at::Tensor&, const at::Tensor&,
                         const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif

}  // namespace pdserve
