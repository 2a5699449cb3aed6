// The operands of one call of a bf16 linear kernel (amx_linear.cpp, dpbf16_linear.cpp), checked
// the same way for both.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "vec.h"

namespace pdserve {

struct LinearCall {
  at::Tensor x;       // [M, K] bf16, unit column stride (rows may be strided: ldx)
  at::Tensor bias32;  // [N] fp32, or undefined
  at::Tensor out;     // [M, N] bf16
  int64_t m, n, ldx;

  const bf16* xp() const { return x.data_ptr<bf16>(); }
  const float* bp() const { return bias32.defined() ? bias32.data_ptr<float>() : nullptr; }
  bf16* op() const { return out.data_ptr<bf16>(); }
};

// x_in [M, K] against a packed weight of `k` inputs and `n` outputs (+ bias [N]).
inline LinearCall linear_call(const at::Tensor& x_in, int64_t k, int64_t n,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bf16 [M, K]");
  TORCH_CHECK(x_in.size(1) == k, "x has ", x_in.size(1), " features, the packed weight ", k);
  LinearCall call;
  call.x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  call.m = call.x.size(0);
  call.n = n;
  call.ldx = call.x.stride(0);
  if (bias) {
    TORCH_CHECK(bias->numel() == n, "bias has ", bias->numel(), " values for ", n, " outputs");
    call.bias32 = bias->to(at::kFloat).contiguous();
  }
  call.out = at::empty({call.m, n}, call.x.options());
  return call;
}

}  // namespace pdserve
