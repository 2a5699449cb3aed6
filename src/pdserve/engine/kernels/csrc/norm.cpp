#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace pdserve {

void norm_row(const bf16* s, const bf16* w, bf16* y, int64_t n, float eps) {
  // two sums of squares, so that each FMA waits for its own chain only
  Vec sa(0.f), sb(0.f);
  for (int64_t i = 0; i < n; i += kBVec) {
    auto [a, b] = load_bf16(s + i, std::min(kBVec, n - i));
    sa = at::vec::fmadd(a, a, sa);
    sb = at::vec::fmadd(b, b, sb);
  }
  const Vec r(1.f / std::sqrt(sum(sa + sb) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kBVec) {
    const int64_t c = std::min(kBVec, n - i);
    auto [a, b] = load_bf16(s + i, c);
    auto [na, nb] = round_bf16(a * r, b * r);
    auto [wa, wb] = load_bf16(w + i, c);
    store_bf16(y + i, wa * na, wb * nb, c);
  }
}

namespace {

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "expected a contiguous bf16 [T, hidden] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous(),
              "the norm weight must be contiguous bf16 [hidden]");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t n = x.size(1);
  auto out = at::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * n, wp, op + r * n, n, eps);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  check(residual, weight);
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual differ in shape");
  const int64_t n = x.size(1);
  auto out = at::empty_like(x);
  auto total = at::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  bf16* tp = total.data_ptr<bf16>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = r * n; i < (r + 1) * n; i += kBVec) {  // total = bf16(x + residual)
        const int64_t c = std::min(kBVec, (r + 1) * n - i);
        auto [xa, xb] = load_bf16(xp + i, c);
        auto [ra, rb] = load_bf16(rp + i, c);
        store_bf16(tp + i, xa + ra, xb + rb, c);
      }
      norm_row(tp + r * n, wp, op + r * n, n, eps);
    }
  });
  return {out, total};
}

}  // namespace pdserve
