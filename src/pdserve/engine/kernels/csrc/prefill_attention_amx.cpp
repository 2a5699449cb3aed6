// prefill_attention's kernel on Intel AMX tiles (Sapphire Rapids and later): the same flash
// attention, tiles and per-row update as the VDPBF16PS kernel (prefill_attention.cpp's file
// comment, prefill_tiles.h's packing), with both products of a tile on TDPBF16PS. On a 2-core
// Xeon the VDPBF16PS kernel runs at ~130-150 GFLOP/s, a third of PyTorch's SDPA there (which
// is on AMX) and a tenth of the AMX linears: it was most of a long prompt's step.
//
// Tile algebra (Intel SDM vol. 1 ch. 20): TDPBF16PS C[16 x 16 fp32] += A[16 x 32 bf16] . B,
// B one 1 KiB tile of 16 pairs x 16 columns x 2 bf16. Per block of 16 query rows and key tile:
//   scores  C = Q [16 x D] . K^T: A = 32 dimensions of the rows, B = 16 dimension pairs of 16
//           keys, a row of the packed K tile (256 B apart); 4 C tiles hold the 64 keys;
//   softmax on the stored C (prefill_tiles.h's softmax_tile, per row), P rounded to bf16;
//   values  O [16 x 64 dims] = O x alpha + P [16 x 64 keys] . V: O is rescaled in memory,
//           loaded into 4 C tiles, A = 32 keys of P, B = 16 key pairs of 16 dimensions.
// Each row of C depends only on its own row of A, so a row's arithmetic is the same whatever
// rows share its block: blocks start at the first row that still attends to the tile, and a
// position's output does not depend on chunking, cache hits or batching (as the VDPBF16PS
// kernel's; the two kernels' results differ in the last bits, and a CPU always takes the same
// one).
//
// Tiles 0-3: C; 4: A; 6-7: B. The tile configuration is per thread: each item loads it and
// releases the tiles at its end.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "ops.h"
#include "paged_context.h"
#include "prefill_tiles.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_AMX_ATTENTION 1
#endif

namespace pdserve {

#ifdef PDSERVE_AMX_ATTENTION
namespace {

using namespace prefill_tiles;

constexpr int64_t kPos = 32;    // query positions per work item
constexpr int64_t kBlock = 16;  // query rows per tile block

void configure() {  // tiles 0-7 of 16 rows x 64 bytes
  const TileConfig cfg;
  load_tile_config(cfg);
}

// C tiles 0-3 += A tile 4 . the four B tiles at b, b + 16, b + 32, b + 48 (rows `stride`
// bytes apart): 64 columns. B alternates between tiles 6 and 7, so a load overlaps the
// previous product.
void four_products(const uint32_t* b, int64_t stride) {
  _tile_loadd(6, b, stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, b + 16, stride);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(6, b + 32, stride);
  _tile_dpbf16ps(2, 4, 6);
  _tile_loadd(7, b + 48, stride);
  _tile_dpbf16ps(3, 4, 7);
}

// C tiles 0-3 to [16][64] fp32 at c (rows `stride` bytes apart), or from it.
void store_c(float* c, int64_t stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 32, stride);
  _tile_stored(3, c + 48, stride);
}

void load_c(const float* c, int64_t stride) {
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + 16, stride);
  _tile_loadd(2, c + 32, stride);
  _tile_loadd(3, c + 48, stride);
}

// s [16][64] = q rows [16][D] (bf16 pairs, d / 2 apart) . the K tile's 64 keys^T, unscaled.
// B: 16 dimension pairs (rows of the packed K tile, 256 B apart) of 16 keys.
void block_scores(const uint32_t* q, int64_t d, const uint32_t* kt, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kc = 0; kc < d / 32; ++kc) {
    _tile_loadd(4, q + kc * 16, d * 2);
    four_products(kt + kc * 16 * kTile, kTile * 4);
  }
  store_c(s, kTile * 4);
}

// o [16][c0 .. c0 + 64) (rows d floats apart) += p [16][64 keys] (bf16 pairs, 32 apart) . the
// V tile's 64 keys, dimensions c0 ... B: 16 key pairs (rows d x 4 B apart) of 16 dimensions.
void block_values(const uint32_t* p, const uint32_t* vt, int64_t d, int64_t c0, float* o) {
  load_c(o + c0, d * 4);
  for (int64_t kc = 0; kc < 2; ++kc) {
    _tile_loadd(4, p + kc * 16, kTile * 2);
    four_products(vt + kc * 16 * d + c0, d * 4);
  }
  store_c(o + c0, d * 4);
}

// o rows [n][d] x= alpha[r] (skipped where every alpha is 1, as while the maxima hold).
void rescale(float* o, const float* alpha, int64_t n, int64_t d) {
  for (int64_t r = 0; r < n; ++r) {
    if (alpha[r] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t e = 0; e < d; e += 16)
      _mm512_storeu_ps(o + r * d + e, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + e), a));
  }
}

// The rows of one item: G heads x up to kPos positions, position-major, in blocks of 16. The
// buffers hold 16 rows past the last, which a last partial block computes and nothing reads.
void attend_item(int64_t g, int64_t first, const at::Tensor& q, int64_t start, int64_t n,
                 int64_t group, float scale, const Packed& packed, bf16* out, int64_t heads) {
  const int64_t d = q.size(2);
  const int64_t positions = std::min(kPos, n - first), rows = positions * group;
  const int64_t padded = rows + kBlock;
  std::vector<uint32_t> qrows(padded * d / 2, 0u), p(kBlock * kTile / 2);  // bf16 pairs
  std::vector<float> s(kBlock * kTile), o(padded * d, 0.f), l(rows, 0.f), alpha(kBlock);
  std::vector<float> m(rows, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> limit(rows);  // keys each row attends: pos + 1
  gather_rows(q, first, positions, g, group, start, qrows.data(), limit.data());
  configure();
  const int64_t tiles = (start + first + positions + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first_key = t * kTile;
    int64_t skip = 0;  // rows done before this tile: a prefix, as rows are position-major
    while (skip < rows && limit[skip] <= first_key) ++skip;
    for (int64_t r0 = skip; r0 < rows; r0 += kBlock) {
      const int64_t live = std::min(kBlock, rows - r0);
      block_scores(&qrows[r0 * d / 2], d, packed.k_tile(g, t), s.data());
      for (int64_t i = 0; i < live; ++i)
        alpha[i] = softmax_tile(&s[i * kTile], std::min(kTile, limit[r0 + i] - first_key),
                                scale, m[r0 + i], l[r0 + i], &p[i * kTile / 2]);
      rescale(&o[r0 * d], alpha.data(), live, d);
      for (int64_t c0 = 0; c0 < d; c0 += kTile)
        block_values(p.data(), packed.v_tile(g, t), d, c0, &o[r0 * d]);
    }
  }
  _tile_release();
  emit_rows(o.data(), l.data(), first, positions, g, group, d, heads, out);
}

}  // namespace

at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale) {
  TORCH_CHECK(amx_available(), "this CPU or kernel does not grant AMX to the process");
  return prefill_by_items(q, k_cache, v_cache, block_table, context_len, kPos, pack,
                          [&](const Packed& packed, int64_t g, int64_t first, int64_t start,
                              int64_t group, bf16* out) {
                            attend_item(g, first, q, start, q.size(0), group,
                                        static_cast<float>(scale), packed, out, q.size(1));
                          });
}

#else  // compiled for a CPU without AMX-BF16

at::Tensor prefill_attention_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "built without AMX");
}

#endif

}  // namespace pdserve
