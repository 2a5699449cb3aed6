// AMX's tile configuration, shared by the kernels on tiles (amx_linear.cpp,
// prefill_attention_amx.cpp).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace pdserve {

// The 64-byte operand of LDTILECFG (Intel SDM vol. 1 section 3.2.2, palette 1), made with
// tiles 0-7 of 16 rows x 64 bytes; a kernel may shorten rows before loading it.
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      rows[t] = 16;
      colsb[t] = 64;
    }
  }
};

#if defined(__AMX_TILE__)
// LDTILECFG of `cfg`. GCC 12 does not count the intrinsic as a read of its operand: where it
// sees the whole life of a local TileConfig it drops the stores that filled it (observed on a
// kernel whose configure() was not inlined: palette 1 and garbage rows, #GP). The empty asm
// that may read `cfg` and all memory keeps them.
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace pdserve
