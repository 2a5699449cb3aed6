// How the cost of AMX tile loads moves with the machine's phase (tools/amx_probe/phases.py).
// Two loops on the calling thread, every operand in a 16 KiB buffer that stays in L1:
//   0 products  4 TDPBF16PS an iteration on C tiles 0-3 from A tiles 4-5 and B tiles 6-7
//               loaded once: the tile unit alone
//   1 kernel    pdserve's linear item at 32 rows (amx_linear.cpp): an iteration loads 2 A and
//               2 B tiles and takes the same 4 products
// Each returns nanoseconds per TDPBF16PS over `iterations`.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/extension.h>

#include <chrono>

#include "amx_tiles.h"  // the engine's kernels/csrc

namespace {

alignas(64) char operands[16 * 1024];  // zeros: the products' values do not matter

double run(int64_t iterations, int64_t mode) {
  TORCH_CHECK(syscall(SYS_arch_prctl, 0x1023, 18) == 0, "the kernel does not grant AMX");
  pdserve::load_tile_config(pdserve::TileConfig());  // tiles 0-7 of 16 rows x 64 bytes
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operands, 64);
  _tile_loadd(5, operands + 1024, 64);
  _tile_loadd(6, operands + 2048, 64);
  _tile_loadd(7, operands + 3072, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    if (mode == 1) {  // 16 tiles of the buffer in turn, as the K loop walks its operands
      const char* a = operands + (i % 4) * 4096;
      _tile_loadd(4, a, 64);
      _tile_loadd(6, a + 1024, 64);
      _tile_loadd(7, a + 2048, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + 3072, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16][16];
  _tile_stored(0, c, 64);  // the products' results are used
  const auto t1 = std::chrono::steady_clock::now();
  _tile_release();
  return std::chrono::duration<double>(t1 - t0).count() / (4.0 * iterations) * 1e9;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
