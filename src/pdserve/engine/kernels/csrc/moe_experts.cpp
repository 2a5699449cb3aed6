// The routed experts of one MoE layer in one call: each chosen expert's SwiGLU
// (gate_up, silu_mul, down) on its packed weights, looped over here instead of in Python.
//
// Why: at decode's few rows an expert is a few MB of weights and two kernel calls, and the
// Python around each (slicing, split, silu, multiply, the copy back: ~10 operator calls) is
// a large part of its time next to the weights' streaming (`pdserve bench moe` times whole
// decode steps of MoE models). The experts run in expert order, each on its own rows,
// so a row's result does not depend on the other rows of the step.
#include <ATen/ops/empty.h>

#include "ops.h"

namespace pdserve {

at::Tensor moe_experts(const at::Tensor& xs, const at::Tensor& counts, const ExpertWeights& w) {
  const int64_t experts = static_cast<int64_t>(w.gate_up.size());
  TORCH_CHECK(static_cast<int64_t>(w.down.size()) == experts,
              "every expert needs a gate_up and a down weight");
  TORCH_CHECK(counts.dim() == 1 && counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                  counts.size(0) == experts,
              "counts must be a contiguous int64 [", experts, "] tensor");
  TORCH_CHECK(xs.dim() == 2 && xs.scalar_type() == at::kBFloat16, "xs must be bf16 [S, hidden]");
  const int64_t* rows = counts.data_ptr<int64_t>();
  auto out = at::empty(xs.sizes(), xs.options());  // [S, hidden]
  int64_t start = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = rows[e];
    if (n == 0) continue;
    TORCH_CHECK(n > 0 && start + n <= xs.size(0), "counts exceed the ", xs.size(0), " rows");
    const at::Tensor gate_up = kernel_linear(w.kernel, xs.narrow(0, start, n), w.gate_up[e],
                                             std::nullopt);  // [n, 2I]
    out.narrow(0, start, n).copy_(
        kernel_linear(w.kernel, silu_mul(gate_up), w.down[e], std::nullopt));  // [n, hidden]
    start += n;
  }
  TORCH_CHECK(start == xs.size(0), "counts cover ", start, " of ", xs.size(0), " rows");
  return out;
}

}  // namespace pdserve
