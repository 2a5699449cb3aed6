// The routed experts of one MoE layer in one call: the (token, slot) pairs grouped by expert,
// each chosen expert's SwiGLU (gate_up, silu_mul, down) on its packed weights over its rows,
// and each token's weighted sum over its slots.
//
// Why: at decode's few rows an expert is a few MB of weights and two kernel calls, and the
// Python around them (the grouping, per expert slicing and activation, the weighting and the
// scatter back: ~10 operator calls each) was a large part of a layer's time next to the
// weights' streaming (`pdserve bench moe` times whole decode steps of MoE models). Experts
// run in expert order, each on its own rows, so a row's result does not depend on the other
// rows of the step.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

// The slots (token * k + slot) in expert order, stable: expert e's rows are
// order[start[e], start[e + 1]), in token order.
struct Grouping {
  std::vector<int64_t> order, start, row_of;  // row_of[slot]: its row in expert order
};

Grouping group_by_expert(const int64_t* ids, int64_t slots, int64_t experts) {
  Grouping g{std::vector<int64_t>(slots), std::vector<int64_t>(experts + 1, 0),
             std::vector<int64_t>(slots)};
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < experts, "expert id ", ids[s], " is outside the ",
                experts, " experts");
    ++g.start[ids[s] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> next(g.start.begin(), g.start.end() - 1);
  for (int64_t s = 0; s < slots; ++s) {
    g.row_of[s] = next[ids[s]]++;
    g.order[g.row_of[s]] = s;
  }
  return g;
}

// out[t] = bf16(sum over slots j, in order, of ys[row_of[t k + j]] * w[t, j]), in fp32; with
// bf16 weights each product is rounded to bf16 first (PyTorch's bf16 x bf16 multiply).
template <typename W>
void weighted_sum(const bf16* ys, const std::vector<int64_t>& row_of, const W* w, int64_t t,
                  int64_t k, int64_t hidden, bf16* out) {
  constexpr bool kRoundProducts = std::is_same_v<W, bf16>;
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t r = t0; r < t1; ++r) {
      for (int64_t i = 0; i < hidden; i += kBVec) {
        const int64_t c = std::min(kBVec, hidden - i);
        Vec a(0.f), b(0.f);
        for (int64_t j = 0; j < k; ++j) {
          const Vec weight(static_cast<float>(w[r * k + j]));
          auto [y0, y1] = load_bf16(ys + row_of[r * k + j] * hidden + i, c);
          std::pair<Vec, Vec> p{y0 * weight, y1 * weight};
          if constexpr (kRoundProducts) p = round_bf16(p.first, p.second);
          a = a + p.first;
          b = b + p.second;
        }
        store_bf16(out + r * hidden + i, a, b, c);
      }
    }
  });
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const ExpertWeights& w) {
  const int64_t experts = static_cast<int64_t>(w.gate_up.size());
  TORCH_CHECK(static_cast<int64_t>(w.down.size()) == experts,
              "every expert needs a gate_up and a down weight");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "x must be bf16 [T, hidden] with contiguous rows");
  const int64_t t = x.size(0), hidden = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == t && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "ids must be contiguous int64 [", t, ", k]");
  const int64_t k = ids.size(1);
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() &&
                  (weights.scalar_type() == at::kFloat || weights.scalar_type() == at::kBFloat16),
              "weights must be contiguous fp32 or bf16 [", t, ", ", k, "], as ids");
  const Grouping g = group_by_expert(ids.data_ptr<int64_t>(), t * k, experts);
  auto xs = at::empty({t * k, hidden}, x.options());  // [S, hidden], rows in expert order
  auto ys = at::empty({t * k, hidden}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* xsp = xs.data_ptr<bf16>();
  for (int64_t i = 0; i < t * k; ++i)
    std::memcpy(xsp + i * hidden, xp + (g.order[i] / k) * x.stride(0), hidden * sizeof(bf16));
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t start = g.start[e], n = g.start[e + 1] - start;
    if (n == 0) continue;  // an unchosen expert's weights are never read
    const at::Tensor gate_up = kernel_linear(w.kernel, xs.narrow(0, start, n), w.gate_up[e],
                                             std::nullopt);  // [n, 2I]
    ys.narrow(0, start, n).copy_(
        kernel_linear(w.kernel, silu_mul(gate_up), w.down[e], std::nullopt));  // [n, hidden]
  }
  auto out = at::empty({t, hidden}, x.options());
  if (weights.scalar_type() == at::kFloat) {
    weighted_sum(ys.data_ptr<bf16>(), g.row_of, weights.data_ptr<float>(), t, k, hidden,
                 out.data_ptr<bf16>());
  } else {
    weighted_sum(ys.data_ptr<bf16>(), g.row_of, weights.data_ptr<bf16>(), t, k, hidden,
                 out.data_ptr<bf16>());
  }
  return out;
}

}  // namespace pdserve
