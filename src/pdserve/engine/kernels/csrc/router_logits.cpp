// A MoE router's logits in fp32 from an fp32 gate weight, as DeepSeek keeps it (transformers'
// `F.linear(x.float(), weight)`, model/moe_gate.py's `Router`): out[t, e] = x_t . w_e.
//
// Why: at decode's few tokens PyTorch hands this [T, hidden] x [E, hidden]^T product to a
// general fp32 GEMM, which read a 0.5 MB gate (64 experts at hidden 2,048) at 2-5 GB/s when it
// was not in cache (it never is: the step streams every other weight in between) and took
// 2.5-3x longer at 4 tokens than at 1. Here each thread streams its own experts' rows once per
// block of tokens, a row against every token of the block.
//
// Every logit is one sum in the same order (two vector sums over hidden, then the scalar
// tail) whatever the number of tokens: a token's logits do not depend on the rest of its step.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "ops.h"
#include "thread_buffer.h"
#include "vec.h"

namespace pdserve {
namespace {

constexpr int64_t kTokens = 4;  // tokens a gate row is read for at once (`dots` up to 4)

// out[k * stride] = w . x[k] for k < K: w and each x[k] fp32 [n].
template <int K>
void dots(const float* w, const float* const* x, int64_t n, float* out, int64_t stride) {
  Vec acc[K][2];
#pragma GCC unroll 4
  for (int k = 0; k < K; ++k) acc[k][0] = acc[k][1] = Vec(0.f);
  int64_t i = 0;
  for (; i + 2 * kVec <= n; i += 2 * kVec) {
    const Vec w0 = Vec::loadu(w + i), w1 = Vec::loadu(w + i + kVec);
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) {
      acc[k][0] = at::vec::fmadd(w0, Vec::loadu(x[k] + i), acc[k][0]);
      acc[k][1] = at::vec::fmadd(w1, Vec::loadu(x[k] + i + kVec), acc[k][1]);
    }
  }
  for (int k = 0; k < K; ++k) {
    float total = sum(acc[k][0] + acc[k][1]);
    for (int64_t j = i; j < n; ++j) total += w[j] * x[k][j];
    out[k * stride] = total;
  }
}

struct Rows {};  // thread_buffer's tag

}  // namespace

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x must be bf16 or fp32 [T, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat,
              "the gate weight must be contiguous fp32 [experts, hidden]");
  const int64_t t = x.size(0), e = weight.size(0), n = weight.size(1);
  TORCH_CHECK(x.size(1) == n, "x has ", x.size(1), " columns, the gate weight ", n);
  auto out = at::empty({t, e}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = x.scalar_type() == at::kFloat;
  at::parallel_for(0, e, 1, [&](int64_t e0, int64_t e1) {
    float* rows = thread_buffer<float, Rows>(kTokens * n);
    for (int64_t t0 = 0; t0 < t; t0 += kTokens) {
      const int64_t m = std::min(kTokens, t - t0);
      const float* xs[kTokens];
      for (int64_t k = 0; k < m; ++k) {  // this block's tokens in fp32
        if (wide) {
          xs[k] = x.const_data_ptr<float>() + (t0 + k) * x.stride(0);
          continue;
        }
        const bf16* src = x.const_data_ptr<bf16>() + (t0 + k) * x.stride(0);
        for (int64_t j = 0; j < n; ++j) rows[k * n + j] = static_cast<float>(src[j]);
        xs[k] = rows + k * n;
      }
      const auto block = m == 4 ? dots<4> : m == 3 ? dots<3> : m == 2 ? dots<2> : dots<1>;
      for (int64_t r = e0; r < e1; ++r) block(w + r * n, xs, n, op + t0 * e + r, e);
    }
  });
  return out;
}

}  // namespace pdserve
