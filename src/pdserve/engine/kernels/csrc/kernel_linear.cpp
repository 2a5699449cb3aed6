// A linear layer on one of pdserve's bf16 kernels, chosen by name: what every fused operator
// that runs packed weights (fused_layer.cpp, moe_experts.cpp) calls.
#include "ops.h"

namespace pdserve {

at::Tensor kernel_linear(const std::string& kernel, const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  if (kernel == "amx") return amx_linear(x, packed, bias);
  if (kernel == "avx2") return avx2_linear(x, packed, bias);
  TORCH_CHECK(kernel == "avx512_bf16", "unknown linear kernel ", kernel);
  return dpbf16_linear(x, packed, bias);
}

}  // namespace pdserve
