// Why SmolLM2's decode linears stream their weights slower at batch 32 than at batch 1 on an
// AMX CPU (tools/amx_probe/run.py). Each function reads `bytes` of a weight-sized buffer once,
// split over two threads, 2 KiB (two B tiles) per iteration, in one of these ways:
//   0 avx_read      AVX-512 loads only: the machine's streaming read, the baseline
//   1 tile_loads    the two B tile loads only (TILELOADD), no arithmetic
//   2 tile_loads_pf the same with a PREFETCHT0 2 KiB ahead
//   3 m1_kernel     pdserve's kernel at one row: A tile + 2 B tiles, 2 TDPBF16PS
//   4 m32_kernel    pdserve's kernel at 32 rows: 2 A tiles + 2 B tiles, 4 TDPBF16PS
//   5 m32_pf        4 with a PREFETCHT1 2 KiB ahead
//   6 m32_hot       4 on the same 2 KiB every iteration (the arithmetic alone, from L1)
// The x rows (A tiles) come from a small buffer that stays in L1.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/extension.h>

#include "amx_tiles.h"  // the engine's kernels/csrc

namespace {

void configure(int rows) {  // tiles 0-3: C, 4-5: A (rows of x), 6-7: B (weights)
  pdserve::TileConfig c;
  for (int t = 0; t < 6; ++t) c.rows[t] = static_cast<uint8_t>(rows);
  pdserve::load_tile_config(c);
}

void stream(const char* w, int64_t n, const char* x, int mode) {
  __m512i acc = _mm512_setzero_si512();
  const int64_t ldx = 1152;  // a [32, 576] bf16 x
  for (int64_t i = 0; i < n; ++i) {
    const char* b = mode == 6 ? w : w + i * 2048;
    const char* a = x + (i % 18) * 64;
    switch (mode) {
      case 0:
        for (int o = 0; o < 2048; o += 64) acc = _mm512_xor_si512(acc, _mm512_load_si512(b + o));
        break;
      case 2:
        for (int o = 0; o < 2048; o += 64) _mm_prefetch(b + 2048 + o, _MM_HINT_T0);
        [[fallthrough]];
      case 1:
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        break;
      case 3:
        _tile_loadd(4, a, ldx);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        break;
      default:
        if (mode == 5)
          for (int o = 0; o < 2048; o += 64) _mm_prefetch(b + 2048 + o, _MM_HINT_T1);
        _tile_loadd(4, a, ldx);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * ldx, ldx);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (_mm512_reduce_or_epi64(acc) == 42) printf(" ");  // keep the reads
}

}  // namespace

// Seconds to stream `w` (bf16, 2 KiB-aligned length) once in `mode`, two threads.
double run(const torch::Tensor& w, const torch::Tensor& x, int64_t mode) {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;  // ARCH_REQ_XCOMP_PERM
  TORCH_CHECK(granted, "the kernel does not grant AMX tiles to this process");
  const char* wp = static_cast<const char*>(w.data_ptr());
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t per_thread = w.numel() * 2 / 2 / 2048;
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(2)
  {
    const int id = omp_get_thread_num();
    configure(mode == 3 ? 1 : 16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    stream(wp + id * per_thread * 2048, per_thread, xp, static_cast<int>(mode));
    _tile_release();
  }
  return omp_get_wtime() - t0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
