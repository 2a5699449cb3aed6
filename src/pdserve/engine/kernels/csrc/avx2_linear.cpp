// bf16 linear layer on AVX2 + FMA, for CPUs without bf16 arithmetic (AMD Zen 2/3, Intel
// Haswell to Skylake client): weights stay bf16 in memory, every product is an fp32 FMA.
//
// Why: without AVX-512, oneDNN refuses bf16 and PyTorch's own bf16 matmul is several times
// slower than fp32, so such a CPU ran fp32 weights, and a decode step streamed twice the bytes
// it needs. Here a bf16 weight widens to fp32 in registers (a bf16 is the top half of its fp32:
// two integer ops per 16 values), so decode reads half the bytes of fp32 and prefill's FMAs run
// at fp32's rate.
//
// Layout: the weight is packed once into [N/16][K][8 j][2 h]: one 32-byte row of a group holds
// one input k of 16 output columns, column 8 h + j at bf16 position 2 j + h. Shifting the row's
// 32-bit lanes left by 16 gives columns 0..7 as fp32 (h = 0); masking the low halves off gives
// columns 8..15 (h = 1).
//
// Register blocking: a block is R rows x G groups, 2 R G fp32 accumulators of 8 lanes
// (R <= 6 at G = 1: 12 of the 16 ymm, plus 2 weight vectors and a broadcast; R <= 2 at G = 2,
// so that one or two rows still keep 8 FMA chains in flight). A thread owns a contiguous range
// of column groups and takes the rows in chunks, each widened to fp32 into the thread's own
// buffer, which stays in L2 (192 KiB) while its groups pass over it; a group's weights
// (K x 32 bytes, 48 KiB at K = 1536) stay in L1/L2 while the chunk's row blocks reuse them.
// Weights cross the memory bus once per chunk: once per call at decode's few rows.
//
// Every output's sum runs over K in one FMA chain, in order, whatever the block shape: a row's
// result does not depend on the rows batched with it (greedy decoding gives the same tokens
// alone or in a batch).
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>

#include "linear_call.h"
#include "ops.h"
#include "thread_buffer.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif

namespace pdserve {

#ifdef PDSERVE_AVX2
namespace {

constexpr int64_t kGroup = 16;  // output columns per packed group
constexpr int kMaxRows = 6;     // rows per block at one group
constexpr int64_t kChunkBytes = 192 * 1024;  // fp32 rows a thread's groups pass over at once
// Weight rows (32 bytes each) a block prefetches ahead in each group's stream: 1 KiB. At
// decode's few rows the kernel streams weights once and the hardware prefetcher alone left
// it a few percent slower (interleaved A/B of the two builds); at many rows it is the same.
constexpr int64_t kPrefetchRows = 32;

// fp32 -> bf16, round to nearest even (a NaN stays a NaN: its payload's top bits are kept).
// Raw 256-bit intrinsics here and in `widen`, not vec.h's load_bf16/store_bf16: those follow
// the build's vector width, which is 512 bits where this file is also built for AVX-512 CPUs.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                        16);
  // 8 x 32-bit -> 8 x 16-bit, in lane order
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane: a b a b
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes 0, 2
}

// out[r][16 g + c] = sum_k x[r][k] w[g][k][c] (+ bias), for the block's R rows and G groups.
// x: fp32 rows K apart; w: the first group's packed weight, the next groups 16 K further each.
template <int R, int G>
void block(const float* x, int64_t k, const bf16* w, const float* bias, bf16* out,
           int64_t ldo) {
  __m256 acc[R][G][2];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();
  const __m256i* wv = reinterpret_cast<const __m256i*>(w);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < k; ++i) {
    __m256 lo[G], hi[G];
    for (int g = 0; g < G; ++g) {
      // past the group's end it names the next group's rows, or none: prefetches never fault
      _mm_prefetch(reinterpret_cast<const char*>(wv + g * k + i + kPrefetchRows), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(wv + g * k + i);
      lo[g] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));  // columns 0..7
      hi[g] = _mm256_castsi256_ps(_mm256_and_si256(v, high));  // columns 8..15
    }
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k + i);
      for (int g = 0; g < G; ++g) {
        acc[r][g][0] = _mm256_fmadd_ps(a, lo[g], acc[r][g][0]);
        acc[r][g][1] = _mm256_fmadd_ps(a, hi[g], acc[r][g][1]);
      }
    }
  }
  // Both loops unrolled in full (G <= 2, R <= kMaxRows), so every acc index is a constant:
  // otherwise GCC 12 keeps the G = 2 blocks' acc in memory too, and the loop above stores
  // each accumulator after its FMA (a store per FMA).
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g) {
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + g * kGroup) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + g * kGroup + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      __m128i* o = reinterpret_cast<__m128i*>(out + r * ldo + g * kGroup);
      _mm_storeu_si128(o, to_bf16(_mm256_add_ps(acc[r][g][0], b0)));
      _mm_storeu_si128(o + 1, to_bf16(_mm256_add_ps(acc[r][g][1], b1)));
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const bf16*, const float*, bf16*, int64_t);

template <int G, int... R>
constexpr std::array<BlockFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {&block<R + 1, G>...};
}

constexpr auto kOneGroup = rows_table<1>(std::make_integer_sequence<int, kMaxRows>{});
constexpr int kMaxRowsTwoGroups = 2;
constexpr auto kTwoGroups =
    rows_table<2>(std::make_integer_sequence<int, kMaxRowsTwoGroups>{});

// The rows [m0, m0 + rows) of groups g and (if two) g + 1.
void run_rows(const float* x, int64_t k, const bf16* w, int64_t groups_here, const float* bias,
              bf16* out, int64_t ldo, int64_t rows) {
  if (groups_here == 2 && rows <= kMaxRowsTwoGroups) {
    kTwoGroups[rows - 1](x, k, w, bias, out, ldo);
    return;
  }
  for (int64_t g = 0; g < groups_here; ++g)
    kOneGroup[rows - 1](x, k, w + g * kGroup * k, bias ? bias + g * kGroup : nullptr,
                        out + g * kGroup, ldo);
}

struct RowsTag;

// rows x k bf16 (rows ldx apart) -> fp32 rows k apart: a bf16 is the top half of its fp32.
void widen(const bf16* x, int64_t ldx, int64_t rows, int64_t k, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x + r * ldx);
    float* dst = out + r * k;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(
                                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    for (; i < k; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &bits, sizeof bits);
    }
  }
}

}  // namespace

bool avx2_available() { return true; }

at::Tensor avx2_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(0) % kGroup == 0,
              "avx2_pack needs a bf16 [N, K] weight with N a multiple of 16");
  const int64_t n = weight.size(0), k = weight.size(1);
  // [N, K] -> [N/16, 2 h, 8 j, K] -> [N/16, K, 8 j, 2 h]
  return weight.reshape({n / kGroup, 2, 8, k}).permute({0, 3, 2, 1}).contiguous();
}

at::Tensor avx2_linear(const at::Tensor& x_in, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4, "the packed weight is avx2_pack's 4-d layout");
  const int64_t k = packed.size(1), groups = packed.size(0);
  const LinearCall call = linear_call(x_in, k, groups * kGroup, bias);
  const int64_t m = call.m, n = call.n, ldx = call.ldx;
  const bf16* xp = call.xp();
  const bf16* wp = packed.data_ptr<bf16>();
  const float* bp = call.bp();
  bf16* op = call.op();
  const int64_t group_elems = k * kGroup;  // bf16 per packed column group
  // rows per chunk: a chunk's fp32 rows (kChunkBytes) stay in the thread's L2 while its groups
  // pass over them; a multiple of the block's rows
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkBytes / (4 * k) / kMaxRows * kMaxRows);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    float* rows32 = thread_buffer<float, RowsTag>(std::min(m, chunk) * k);
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
      const int64_t c1 = std::min(m, c0 + chunk);
      widen(xp + c0 * ldx, ldx, c1 - c0, k, rows32);
      for (int64_t g = g0; g < g1; g += 2) {
        const int64_t gs = std::min<int64_t>(2, g1 - g);
        for (int64_t m0 = c0; m0 < c1; m0 += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, c1 - m0);
          run_rows(rows32 + (m0 - c0) * k, k, wp + g * group_elems, gs,
                   bp ? bp + g * kGroup : nullptr, op + m0 * n + g * kGroup, n, rows);
        }
      }
    }
  });
  return call.out;
}

#else  // compiled for a CPU without AVX2 and FMA

bool avx2_available() { return false; }

at::Tensor avx2_pack(const at::Tensor&) { TORCH_CHECK(false, "built without AVX2 and FMA"); }

at::Tensor avx2_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AVX2 and FMA");
}

#endif

}  // namespace pdserve
