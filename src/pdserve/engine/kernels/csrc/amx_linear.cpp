// bf16 linear layer on Intel AMX tiles (Sapphire Rapids and later).
//
// Why not oneDNN, which also uses AMX here: on SmolLM2's shapes (N x K of 960x576 ... 49152x576)
// its prepacked inner product streams the decode step's weights at 12-16 GB/s on this machine;
// this plain loop reaches 20-25 GB/s at 1-32 rows (all 121 linears of a step timed one after
// the other, 2 threads; in the engine: `pdserve bench engine`). Each call is
// one pass over the weights with no primitive lookup, and each output row's sum runs over K in
// the same order whatever M is, so a row's result does not depend on the rows batched with it.
//
// Tile algebra (Intel SDM vol. 1 ch. 20): TDPBF16PS C[16 x 16 fp32] += A[16 x 32 bf16] . B, with
// B one 1 KiB tile of 16 K-pairs x 16 columns x 2 bf16 ("VNNI" order). The weight is packed
// once into such tiles: [N/16][K/32][16 k-pairs][16 n][2]. A work item is 32 output columns
// (two B tiles side by side) of a block of 32 rows: 32 K at a time, C[rows 0-15 | 16-31][cols
// 0-15 | 16-31] accumulate in tiles 0-3 from A tiles 4-5 and B tiles 6-7. A thread's items go
// in groups of kGroupBytes of weights, each group over the row blocks of a chunk of
// kChunkBytes of x; both stay in L2, so the weights cross the memory bus once per call, and
// once per chunk of a long prompt's rows. Each thread copies a chunk's rows into A tiles of
// 1 KiB each before its items pass over them (`pack_rows`): the tile loads are half of an
// item's time (an item without them ran 2.0-2.3x faster at 1,500 rows), and a load of 16 rows
// of x in place reads 16 lines 2 K bytes apart (packed: 1.0-1.15x at 1,500 rows, SmolLM2's
// projections, `tools/kernel_ab`; docs/benchmarks.md).
#include <ATen/Parallel.h>

#include <algorithm>

#include "amx_tiles.h"
#include "linear_call.h"
#include "ops.h"
#include "thread_buffer.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_AMX 1
#endif

namespace pdserve {

#ifdef PDSERVE_AMX
namespace {

constexpr int64_t kTileK = 32;          // bf16 along K per A row / per B tile
constexpr int64_t kTileN = 16;          // fp32 columns per C tile
constexpr int64_t kTileElems = 16 * 32;  // bf16 per B tile (1 KiB)
// bf16 of x that a thread's items pass over at once, which stays in a core's L2 (2 MiB on
// Sapphire Rapids) beside an item's weights; a long prompt's whole x (2,048 x 1,536 is 6 MiB)
// would be read from L3 once per item
constexpr int64_t kChunkBytes = 768 * 1024;
// bf16 of weights whose items take a row block one after the other: they stay in L2 beside the
// chunk, the row block's x in L1 between them, and their outputs are neighbouring lines of the
// same rows. (Each item down the whole chunk, as before, wrote a column strip: at a row stride
// that is a multiple of 2 KiB, N = 2,048 or 3,072, its lines share L1 sets: SmolLM2's gate/up
// projection at 2,048 rows ran at 0.72-0.78x oneDNN's rate, now 0.84-0.90x, `pdserve bench
// linear` on a 2-core Xeon.)
constexpr int64_t kGroupBytes = 576 * 1024;

// Tiles 0-3: C, 4-5: A (rows 0-15, 16-31 of the chunk), 6-7: B; every row 64 bytes.
void configure(int64_t rows) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  if (rows > 16) cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows - 16);
  load_tile_config(cfg);
}

// c [rows, 32] fp32 (+ bias[32]) rounded to nearest even into out (row stride ld): each row
// one whole 64-byte line of out. (Half lines, one C tile's 16 columns at a time, touched each
// line twice; where the row stride is a multiple of 2 KiB, as N = 3,072's, a column strip's
// lines share two L1 sets and were evicted between the halves.)
void emit(const float (*c)[32], int64_t rows, const float* bias, bf16* out, int64_t ld) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(&c[r][16]), b1),
                                           _mm512_add_ps(_mm512_load_ps(c[r]), b0));
    _mm512_storeu_si512(out + r * ld, (__m512i)v);
  }
}

// x [m, k] (row stride ldx) -> A tiles a [ceil(m / 16)][k / 32][16 rows][32] (64-byte
// aligned): each tile's 1 KiB contiguous, as the B tiles are, where a tile loaded straight from
// x's rows reads 16 lines 2 k bytes apart. Rows past m in the last block are left unset: its
// tiles are configured to m's rows.
void pack_rows(const bf16* x, int64_t m, int64_t k, int64_t ldx, bf16* a) {
  const int64_t kcs = k / kTileK;
  for (int64_t i = 0; i < m; ++i) {
    const bf16* row = x + i * ldx;
    bf16* dst = a + (i / 16) * kcs * kTileElems + (i % 16) * kTileK;
    for (int64_t kc = 0; kc < kcs; ++kc)
      _mm512_store_si512(dst + kc * kTileElems, _mm512_loadu_si512(row + kc * kTileK));
  }
}

// Columns [32 g, 32 g + 32) of rows [m0, m0 + rows) of out = x . w^T (+ bias); x is the row
// block's tiles (pack_rows) where kPacked, else its first row (row stride ldx).
template <bool kPacked>
void item(const bf16* x, int64_t ldx, const bf16* w0, int64_t k, const float* bias, bf16* out,
          int64_t n, int64_t rows) {
  // rows 0-15's tile kc at x + kc * step, rows 16-31's at x1 + kc * step; a tile's rows ld
  // bytes apart
  const int64_t step = kPacked ? kTileElems : kTileK, ld = kPacked ? 64 : ldx * 2;
  const bf16* x1 = kPacked ? x + (k / kTileK) * kTileElems : x + 16 * ldx;
  const bf16* w1 = w0 + (k / kTileK) * kTileElems;  // the next 16 columns' tiles
  const bool two = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kc = 0; kc < k / kTileK; ++kc) {
    _tile_loadd(4, x + kc * step, ld);
    _tile_loadd(6, w0 + kc * kTileElems, 64);
    _tile_loadd(7, w1 + kc * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x1 + kc * step, ld);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16][32];
  _tile_stored(0, c, 128);
  _tile_stored(1, &c[0][16], 128);
  emit(c, std::min<int64_t>(rows, 16), bias, out, n);
  if (two) {
    _tile_stored(2, c, 128);
    _tile_stored(3, &c[0][16], 128);
    emit(c, rows - 16, bias, out + 16 * n, n);
  }
}

}  // namespace

bool amx_available() {
  // Linux hands out AMX's 8 KiB of tile state only to a process that asks (arch_prctl,
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; kernel Documentation/arch/x86/xstate.rst).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(0) % (2 * kTileN) == 0 && weight.size(1) % kTileK == 0,
              "amx_pack needs a bf16 [N, K] weight with N a multiple of 32 and K of 32");
  const int64_t n = weight.size(0), k = weight.size(1);
  // [N, K] -> [N/16, 16 n, K/32, 16 k-pairs, 2] -> [N/16, K/32, 16 k-pairs, 16 n, 2]
  return weight.reshape({n / kTileN, kTileN, k / kTileK, 16, 2})
      .permute({0, 2, 3, 1, 4})
      .contiguous();
}

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_available(), "this CPU or kernel does not grant AMX to the process");
  TORCH_CHECK(packed.dim() == 5, "the packed weight is amx_pack's 5-d tiles");
  const LinearCall call =
      linear_call(x_in, packed.size(1) * kTileK, packed.size(0) * kTileN, bias);
  const int64_t m = call.m, k = call.x.size(1), n = call.n, ldx = call.ldx;
  const bf16* xp = call.xp();
  const bf16* wp = packed.data_ptr<bf16>();
  const float* bp = call.bp();
  bf16* op = call.op();
  // rows per chunk: a chunk of x (kChunkBytes) stays in the core's L2 while the thread's items
  // pass over it; a multiple of 32
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (2 * k) / 32 * 32);
  // items per group: a group's weights (kGroupBytes) stay in L2 beside the chunk
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (2 * kTileN * k * 2));
  at::parallel_for(0, n / (2 * kTileN), 1, [&](int64_t g0, int64_t g1) {
    int64_t configured = -1;  // LDTILECFG is per thread; reload only when the chunk shape changes
    // each thread packs the chunk it passes over itself (the copy stays in its own L2); fewer
    // than 16 rows are read in place, a tile's rows as many lines either way
    const bool pack = m >= 16;
    const int64_t packed_rows = (std::min(m, chunk) + 15) / 16 * 16;
    bf16* xa = pack ? thread_buffer<bf16, struct ChunkRows>(packed_rows * k) : nullptr;
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
      const int64_t c1 = std::min(m, c0 + chunk);
      if (pack) pack_rows(xp + c0 * ldx, c1 - c0, k, ldx, xa);
      for (int64_t b0 = g0; b0 < g1; b0 += group) {
        const int64_t b1 = std::min(g1, b0 + group);
        for (int64_t m0 = c0; m0 < c1; m0 += 32) {
          const int64_t rows = std::min<int64_t>(32, c1 - m0);
          if (rows != configured) configure(configured = rows);
          for (int64_t g = b0; g < b1; ++g) {
            const bf16* w = wp + 2 * g * (k / kTileK) * kTileElems;
            const float* b = bp ? bp + 2 * g * kTileN : nullptr;
            bf16* out = op + m0 * n + 2 * g * kTileN;
            if (pack)
              item<true>(xa + (m0 - c0) * k, 0, w, k, b, out, n, rows);
            else
              item<false>(xp + m0 * ldx, ldx, w, k, b, out, n, rows);
          }
        }
      }
    }
    if (configured >= 0) _tile_release();
  });
  return call.out;
}

#else  // compiled for a CPU without AMX-BF16

bool amx_available() { return false; }

at::Tensor amx_pack(const at::Tensor&) { TORCH_CHECK(false, "built without AMX"); }

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AMX");
}

#endif

}  // namespace pdserve
