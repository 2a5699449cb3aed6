// AMX's tile configuration, shared by the kernels on tiles (amx_linear.cpp,
// prefill_attention_amx.cpp).
#pragma once

#include <cstdint>

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

}  // namespace pdserve
