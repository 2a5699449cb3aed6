#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

// Index of the first maximum of p[0, n), or of the first NaN if there is one (torch.max's
// rule): two vector passes, the maximum (`row_max`), then where it is.
int64_t first_max(const bf16* p, int64_t n) {
  const int64_t body = n - n % kBVec;
  const float m = row_max(p, n);
  if (std::isnan(m)) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(p[i]))) return i;
  }
  const Vec target(m);
  for (int64_t i = 0; i < body; i += kBVec) {
    auto [a, b] = load_bf16(p + i);
    // zero_mask: bit j set where lane j is 0, i.e. where the lane equals the maximum
    const int lo = (a != target).zero_mask(), hi = (b != target).zero_mask();
    if (lo) return i + __builtin_ctz(lo);
    if (hi) return i + kVec + __builtin_ctz(hi);
  }
  for (int64_t i = body; i < n; ++i)
    if (static_cast<float>(p[i]) == m) return i;
  return 0;  // n == 0 is refused before
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "argmax_rows needs bf16 [B, V] with V > 0 and contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const bf16* p = x.data_ptr<bf16>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = first_max(p + r * ld, n);
  });
  return out;
}

}  // namespace pdserve
