#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "vec.h"

namespace pdserve {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == at::kBFloat16 && gate_up.size(1) % 2 == 0,
              "expected a contiguous bf16 [T, 2 * intermediate] tensor");
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({t, inter}, gate_up.options());
  const bf16* in = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // silu(g) * u = g / (1 + exp(-g)) * u  (Elfwing et al. 2018), in fp32, rounded once; the
  // exps (vec.h's, or ATen's exp_u20: a few ulp of fp32) are far below bf16's rounding
  at::parallel_for(0, t, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const bf16* g = in + r * 2 * inter;
      for (int64_t i = 0; i < inter; i += kBVec) {
        const int64_t c = std::min(kBVec, inter - i);
        auto [ga, gb] = load_bf16(g + i, c);
        auto [ua, ub] = load_bf16(g + inter + i, c);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512DQ__)
        store_bf16(op + r * inter + i, Vec(silu_times(ga, ua)), Vec(silu_times(gb, ub)), c);
#else
        const Vec one(1.f);
        store_bf16(op + r * inter + i, ga / (one + ga.neg().exp_u20()) * ua,
                   gb / (one + gb.neg().exp_u20()) * ub, c);
#endif
      }
    }
  });
  return out;
}

}  // namespace pdserve
