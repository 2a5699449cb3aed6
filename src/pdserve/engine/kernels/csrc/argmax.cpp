#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "vec.h"

namespace pdserve {

// Each row's first maximum, or its first NaN (torch.max's rule): two vector passes a row.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "argmax_rows needs bf16 [B, V] with V > 0 and contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const bf16* p = x.data_ptr<bf16>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* row = p + r * ld;
      op[r] = max_index(row, n, row_max(row, n));
    }
  });
  return out;
}

}  // namespace pdserve
