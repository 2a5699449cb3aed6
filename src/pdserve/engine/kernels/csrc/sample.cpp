// Temperature sampling by the inverse CDF, one pass over a row's logits and a short second one:
// the token drawn is the first index j whose running sum of w_i = exp((x_i - max x) / T)
// exceeds u x (the sum of all w_i), for one uniform u in [0, 1) per row. The same draw as
// softmax, cumsum and searchsorted in PyTorch (engine/sampler.py `inverse_cdf`), without the
// four [B, V] fp32 tensors between them.
//
// Pass 1 sums the weights per block of kBlock entries (vector lanes, then the block's lanes)
// and adds the blocks in fp64. Pass 2 walks the block sums, in fp64, to the block whose sum
// carries the running total past the target, recomputes that block's weights and walks them one
// by one. The target is below the total (u < 1, fp64 product), so a block is always found; if
// the walk inside it ends without passing the target (its lanes were added in another order
// than the walk adds them, which rounds differently), the block's last nonzero weight is drawn.
// Either way the draw has a nonzero weight: the running sum only rises at one.
//
// Top-p (p < 1): the nucleus is the fewest largest weights whose sum reaches p x total (ties at
// its smallest weight all kept, as engine/sampler.py `apply_top_p`), found in a pool of the
// largest logits (64, then 1,024, 8,192, the row: a language model's nucleus is small); the draw
// walks the nucleus in vocabulary order to the first entry whose running sum passes u x the
// nucleus's total. A pool whose smallest logit is the nucleus's last may leave out ties with it
// outside, so it is taken as too small.
//
// A row whose weights are not a finite positive total (a NaN logit, every logit -inf) draws its
// first maximum, as greedy would.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

constexpr int64_t kBlock = 4 * kBVec;  // entries per block sum: four bf16 vectors

// w_i of entries [i, i + count) of row p (count <= kBVec), as two float vectors (zero past
// count).
inline std::pair<Vec, Vec> weights(const bf16* p, int64_t i, int64_t count, const Vec& top,
                                   const Vec& inv_t) {
  auto [a, b] = load_bf16(p + i, count);
  Vec wa = ((a - top) * inv_t).exp_u20(), wb = ((b - top) * inv_t).exp_u20();
  if (count < kBVec) {  // the padded lanes loaded as 0, whose weight would not be
    const float lanes_a = static_cast<float>(std::min<int64_t>(count, kVec));
    const Vec idx = Vec::arange(0.f, 1.f);
    wa = Vec::blendv(Vec(0.f), wa, idx < Vec(lanes_a));
    wb = Vec::blendv(Vec(0.f), wb, idx < Vec(static_cast<float>(count - kVec)));
  }
  return {wa, wb};
}

// The sum of w_i over [i, i + n), n <= kBlock.
float block_sum(const bf16* p, int64_t i, int64_t n, const Vec& top, const Vec& inv_t) {
  Vec acc(0.f);
  for (int64_t j = i; j < i + n; j += kBVec) {
    auto [wa, wb] = weights(p, j, std::min(kBVec, i + n - j), top, inv_t);
    acc = acc + wa + wb;
  }
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
}

// The entry of block [i, i + n) where the running sum `run` (the blocks before it) passes
// `target`; its last nonzero one if rounding leaves the walk short.
int64_t walk_block(const bf16* p, int64_t i, int64_t n, double run, double target,
                   const Vec& top, const Vec& inv_t) {
  alignas(64) float w[kBlock];
  for (int64_t j = 0; j < n; j += kBVec) {
    auto [wa, wb] = weights(p, i + j, std::min(kBVec, n - j), top, inv_t);
    wa.store(w + j);
    wb.store(w + j + kVec);
  }
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (w[j] <= 0.f) continue;
    last = j;
    run += w[j];
    if (run > target) return i + j;
  }
  return last >= 0 ? i + last : -1;
}

struct Entry {
  float x;  // the logit
  int64_t i;  // its index
};

// The `k` largest logits of p[0, n) (k < n), in no order: entries above a floor, the k-th
// largest kept so far, collect in `pool` and are cut back to the k largest whenever they reach
// 2k; a vector of logits all at or under the floor costs one compare.
void largest(const bf16* p, int64_t n, int64_t k, std::vector<Entry>& pool) {
  const auto bigger = [](const Entry& a, const Entry& b) { return a.x > b.x; };
  pool.clear();
  float floor = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i += kBVec) {
    const int64_t count = std::min(kBVec, n - i);
    auto [a, b] = load_bf16(p + i, count);
    const int64_t lanes = (int64_t{1} << kVec) - 1;
    int64_t above = ~static_cast<int64_t>((a > Vec(floor)).zero_mask()) & lanes;
    above |= (~static_cast<int64_t>((b > Vec(floor)).zero_mask()) & lanes) << kVec;
    for (; above; above &= above - 1) {
      const int64_t j = __builtin_ctzll(above);
      if (j < count) pool.push_back({static_cast<float>(p[i + j]), i + j});
    }
    if (static_cast<int64_t>(pool.size()) >= 2 * k) {
      std::nth_element(pool.begin(), pool.begin() + (k - 1), pool.end(), bigger);
      pool.resize(k);
      floor = pool[k - 1].x;
    }
  }
  if (static_cast<int64_t>(pool.size()) > k) {
    std::nth_element(pool.begin(), pool.begin() + (k - 1), pool.end(), bigger);
    pool.resize(k);
  }
}

// The smallest logit of the nucleus (`p_total`: top_p x the row's total weight), from `pool`,
// the row's k largest logits; NaN where a full pool of k < n cannot tell it (its weights do not
// reach p_total, or the nucleus ends at its smallest logit, which entries outside may tie).
float nucleus_floor(std::vector<Entry>& pool, int64_t k, int64_t n, float m, float inv_t,
                    double p_total) {
  std::sort(pool.begin(), pool.end(), [](const Entry& a, const Entry& b) { return a.x > b.x; });
  // a pool short of k holds every logit above -inf: none left outside to reach p or to tie
  const bool partial = k < n && static_cast<int64_t>(pool.size()) == k;
  double run = 0.0;
  for (size_t j = 0; j < pool.size(); ++j) {
    run += std::exp((pool[j].x - m) * inv_t);
    if (run >= p_total) {
      const bool tied_out = partial && pool[j].x == pool.back().x;
      return tied_out ? std::numeric_limits<float>::quiet_NaN() : pool[j].x;
    }
  }
  return partial ? std::numeric_limits<float>::quiet_NaN() : pool.back().x;  // all of it
}

// The draw from the nucleus: entries of p at or above `floor`, in vocabulary order.
int64_t draw_nucleus(const bf16* p, int64_t n, float m, float inv_t, float top_p, double u,
                     double total, std::vector<Entry>& pool) {
  float floor = std::numeric_limits<float>::quiet_NaN();
  for (int64_t k : {int64_t{64}, int64_t{1024}, int64_t{8192}, n}) {
    k = std::min(k, n);
    if (k < n) {
      largest(p, n, k, pool);
    } else {
      pool.clear();
      for (int64_t i = 0; i < n; ++i) pool.push_back({static_cast<float>(p[i]), i});
    }
    floor = nucleus_floor(pool, k, n, m, inv_t, top_p * total);
    if (!std::isnan(floor) || k == n) break;
  }
  std::vector<Entry> kept;
  for (const Entry& e : pool)
    if (e.x >= floor) kept.push_back(e);
  std::sort(kept.begin(), kept.end(), [](const Entry& a, const Entry& b) { return a.i < b.i; });
  double sum = 0.0;
  for (const Entry& e : kept) sum += std::exp((e.x - m) * inv_t);
  const double target = u * sum;
  double run = 0.0;
  for (const Entry& e : kept) {
    run += std::exp((e.x - m) * inv_t);
    if (run > target) return e.i;
  }
  return kept.back().i;  // rounding left the walk short: the last kept entry
}

int64_t draw(const bf16* p, int64_t n, float inv_temperature, float top_p, double u,
             double* sums, std::vector<Entry>& pool) {
  const float m = row_max(p, n);
  if (!std::isfinite(m)) return max_index(p, n, m);
  const Vec top(m), inv_t(inv_temperature);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum(p, b * kBlock, std::min(kBlock, n - b * kBlock), top, inv_t);
    total += sums[b];
  }
  if (!(total > 0.0) || !std::isfinite(total)) return max_index(p, n, m);
  if (top_p < 1.f) return draw_nucleus(p, n, m, inv_temperature, top_p, u, total, pool);
  const double target = u * total;
  double run = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (sums[b] > 0.0 && run + sums[b] > target) {
      const int64_t j = walk_block(p, b * kBlock, std::min(kBlock, n - b * kBlock), run,
                                   target, top, inv_t);
      if (j >= 0) return j;
    }
    run += sums[b];
  }
  return max_index(p, n, m);  // unreachable with target < total
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures,
                       const at::Tensor& top_ps, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kBFloat16 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_rows needs bf16 logits [B, V] with V > 0 and contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == rows &&
                  temperatures.scalar_type() == at::kFloat && temperatures.is_contiguous(),
              "sample_rows needs fp32 temperatures [B]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == rows &&
                  uniforms.scalar_type() == at::kFloat && uniforms.is_contiguous(),
              "sample_rows needs fp32 uniforms [B]");
  TORCH_CHECK(top_ps.dim() == 1 && top_ps.size(0) == rows &&
                  top_ps.scalar_type() == at::kFloat && top_ps.is_contiguous(),
              "sample_rows needs fp32 top_ps [B]");
  const float* t = temperatures.data_ptr<float>();
  const float* tp = top_ps.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(t[r] > 0.f && std::isfinite(t[r]), "sample_rows: temperature ", t[r],
                " of row ", r, " is not a finite number > 0");
    TORCH_CHECK(tp[r] > 0.f && tp[r] <= 1.f, "sample_rows: top_p ", tp[r], " of row ", r,
                " is not in (0, 1]");
    TORCH_CHECK(u[r] >= 0.f && u[r] < 1.f, "sample_rows: uniform ", u[r], " of row ", r,
                " is not in [0, 1)");
  }
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const bf16* p = logits.data_ptr<bf16>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> sums(blocks);
    std::vector<Entry> pool;
    for (int64_t r = r0; r < r1; ++r)
      op[r] = draw(p + r * ld, n, 1.f / t[r], tp[r], static_cast<double>(u[r]), sums.data(),
                   pool);
  });
  return out;
}

}  // namespace pdserve
