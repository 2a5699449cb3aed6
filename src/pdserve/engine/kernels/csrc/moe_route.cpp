// Two routing rules of model/moe_gate.py, each in one pass per token: DeepSeek-V3's
// auxiliary-loss-free routing (noaux_tc; arXiv 2412.19437, section 2.1.2) and the softmax
// top-k of Qwen3-MoE, Qwen2-MoE and Mixtral.
//
// Why: on PyTorch a rule is several small operator calls per MoE layer (noaux_tc ~25: sigmoid,
// the grouped top-2 sums, the group top-k, a scatter into a mask, the masked top-k, a gather,
// the normalisation; softmax top-k 5), each dispatched for a [T, E] tensor of a few hundred
// bytes at decode: as long as reading a chosen expert's weights. Here each token's E scores
// stay in one small buffer.
//
// Ties (equal scores) go to the lower index, where PyTorch's topk leaves the order to its
// implementation; the chosen experts come out best first, so slot order can differ from
// PyTorch's (the weighted sum over slots then adds in another order: fp32 rounding).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops.h"

namespace pdserve {
namespace {

// The first k of `order` (indices into `value`) made the k largest values, best first, ties
// to the lower index.
void top_first(std::vector<int64_t>& order, const float* value, int64_t k) {
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return value[a] > value[b] || (value[a] == value[b] && a < b);
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> noaux_tc_route(const at::Tensor& logits,
                                                  const at::Tensor& bias, int64_t top_k,
                                                  int64_t n_group, int64_t topk_group,
                                                  bool norm_topk_prob, double scaling) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous fp32 [T, experts]");
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == e && bias.is_contiguous() &&
                  bias.scalar_type() == at::kFloat,
              "the score bias must be contiguous fp32 [", e, "]");
  TORCH_CHECK(n_group > 0 && e % n_group == 0 && e / n_group >= 2,
              "n_group must split the ", e, " experts into groups of 2 or more, got ", n_group);
  const int64_t per_group = e / n_group;
  TORCH_CHECK(topk_group > 0 && topk_group <= n_group && top_k > 0 &&
                  top_k <= topk_group * per_group,
              "top_k ", top_k, " must fit the ", topk_group, " best groups of ", per_group);
  auto weights = at::empty({t, top_k}, logits.options());
  auto ids = at::empty({t, top_k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, t, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> score(e), biased(e), group_score(n_group);
    std::vector<int64_t> groups(n_group), chosen, in_group(per_group);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t x = 0; x < e; ++x) {  // sigmoid scores; the bias only decides the choice
        score[x] = 1.f / (1.f + std::exp(-lp[r * e + x]));
        biased[x] = score[x] + bp[x];
      }
      for (int64_t g = 0; g < n_group; ++g) {  // a group's score: its two best biased scores
        std::iota(in_group.begin(), in_group.end(), g * per_group);
        top_first(in_group, biased.data(), 2);
        group_score[g] = biased[in_group[0]] + biased[in_group[1]];
      }
      std::iota(groups.begin(), groups.end(), 0);
      top_first(groups, group_score.data(), topk_group);
      chosen.clear();  // the experts of the best groups, then the k best of those
      for (int64_t i = 0; i < topk_group; ++i)
        for (int64_t x = groups[i] * per_group; x < (groups[i] + 1) * per_group; ++x)
          chosen.push_back(x);
      top_first(chosen, biased.data(), top_k);
      float total = 0.f;
      for (int64_t i = 0; i < top_k; ++i) total += score[chosen[i]];
      // weights: the unbiased scores, over their sum (+1e-20) if norm_topk_prob, times scaling
      const float norm = norm_topk_prob ? total + 1e-20f : 1.f;
      for (int64_t i = 0; i < top_k; ++i) {
        ip[r * top_k + i] = chosen[i];
        wp[r * top_k + i] = score[chosen[i]] / norm * static_cast<float>(scaling);
      }
    }
  });
  return {weights, ids};
}

std::tuple<at::Tensor, at::Tensor> softmax_topk_route(const at::Tensor& logits, int64_t top_k,
                                                      bool norm_topk_prob) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "logits must be contiguous fp32 or bf16 [T, experts]");
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(top_k > 0 && top_k <= e, "top_k must be 1 to ", e, " (the experts), got ", top_k);
  auto weights = at::empty({t, top_k}, logits.options());
  auto ids = at::empty({t, top_k}, logits.options().dtype(at::kLong));
  int64_t* ip = ids.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "softmax_topk_route", [&] {
    const scalar_t* lp = logits.const_data_ptr<scalar_t>();
    scalar_t* wp = weights.data_ptr<scalar_t>();
    at::parallel_for(0, t, 64, [&](int64_t r0, int64_t r1) {
      std::vector<float> prob(e);
      std::vector<int64_t> order(e);
      for (int64_t r = r0; r < r1; ++r) {
        // softmax in fp32: exp(x - max) / sum (as PyTorch's, which widens bf16 logits first)
        float top = -INFINITY, total = 0.f;
        for (int64_t x = 0; x < e; ++x) top = std::max(top, prob[x] = lp[r * e + x]);
        for (int64_t x = 0; x < e; ++x) total += prob[x] = std::exp(prob[x] - top);
        for (int64_t x = 0; x < e; ++x) prob[x] /= total;
        std::iota(order.begin(), order.end(), 0);
        top_first(order, prob.data(), top_k);
        float chosen = 0.f;  // renormalised over the chosen if norm_topk_prob
        for (int64_t i = 0; i < top_k; ++i) chosen += prob[order[i]];
        const float norm = norm_topk_prob ? chosen : 1.f;
        for (int64_t i = 0; i < top_k; ++i) {  // rounded to the logits' dtype once
          ip[r * top_k + i] = order[i];
          wp[r * top_k + i] = static_cast<scalar_t>(prob[order[i]] / norm);
        }
      }
    });
  });
  return {weights, ids};
}

}  // namespace pdserve
