// One decoder layer of a step, every operator of it called from here.
//
// Why: on SmolLM2 a layer is ten operators and about as many tensor views, and between them
// Python (module calls, views, argument conversion) took ~100 us a layer here, 3 of a 12 ms
// batch-1 decode step (EPYC Zen 4), and more in a step with a prompt in it (its attention a
// loop over the prompts in Python). This calls the same operators in the same order as
// `model/llama.py`'s DecoderLayer on the fused operators, so its output is bit-identical to
// that path (tests/engine/test_fused_layer.py); only the glue between them moves to C++.
#include <ATen/ops/empty.h>

#include <string>
#include <vector>

#include "ops.h"

namespace pdserve {

namespace {

// q [T, H, D] (rows strided): the prompts' rows first, each prompt's in order, then the decode
// groups' rows in order (model/attention.py's paged_attention, operator by operator).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const LayerStep& s, double scale) {
  const size_t prompts = s.prompt_tables.size();
  TORCH_CHECK(s.prompt_tokens.size() == prompts && s.prompt_context.size() == prompts,
              "each prompt needs its block table, token count and context length");
  TORCH_CHECK(s.tables.size() == s.lens.size(), "each decode group needs its table and lens");
  if (prompts == 0 && s.tables.size() == 1)
    return decode_attention(q, k_cache, v_cache, s.tables[0], s.lens[0], scale);
  auto out = at::empty(q.sizes(), q.options());
  int64_t row = 0;
  for (size_t p = 0; p < prompts; ++p) {
    const int64_t n = s.prompt_tokens[p];
    out.narrow(0, row, n).copy_(prefill_attention(q.narrow(0, row, n), k_cache, v_cache,
                                                  s.prompt_tables[p], s.prompt_context[p],
                                                  scale));
    row += n;
  }
  for (size_t g = 0; g < s.tables.size(); ++g) {
    const int64_t b = s.lens[g].size(0);
    out.narrow(0, row, b).copy_(
        decode_attention(q.narrow(0, row, b), k_cache, v_cache, s.tables[g], s.lens[g], scale));
    row += b;
  }
  TORCH_CHECK(row == q.size(0), "the prompts and decode groups cover ", row, " of ", q.size(0),
              " rows");
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const LayerWeights& w,
    const LayerStep& step, at::Tensor& k_cache, at::Tensor& v_cache) {
  const int64_t t = x.size(0), h = w.heads, kvh = w.kv_heads, d = w.head_dim;
  // h, residual = input_layernorm(x, residual)
  at::Tensor normed, res;
  if (residual) {
    std::tie(normed, res) = add_rms_norm(x, *residual, w.input_norm, w.eps);
  } else {
    normed = rms_norm(x, w.input_norm, w.eps);
    res = x;
  }
  // attention: qkv [T, (H + 2 KVH) D]; q and k heads rotate in place
  at::Tensor qkv = kernel_linear(w.kernel, normed, w.qkv, w.qkv_bias);
  rope_(qkv, step.positions, step.cos, step.sin_signed, h + kvh, d);
  const at::Tensor qk = qkv.narrow(1, 0, (h + kvh) * d).view({t, h + kvh, d});
  const at::Tensor q = qk.narrow(1, 0, h), k = qk.narrow(1, h, kvh);
  const at::Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d).view({t, kvh, d});
  store_kv_(k, v, k_cache, v_cache, step.slot_blocks, step.slot_offsets);
  const at::Tensor o = attend(q, k_cache, v_cache, step, w.scale);
  const at::Tensor attn = kernel_linear(w.kernel, o.reshape({t, h * d}), w.o_proj, std::nullopt);
  // h, residual = post_attention_layernorm(attn, residual); mlp
  auto [mlp_in, res2] = add_rms_norm(attn, res, w.post_norm, w.eps);
  const at::Tensor gate_up = kernel_linear(w.kernel, mlp_in, w.gate_up, std::nullopt);
  return {kernel_linear(w.kernel, silu_mul(gate_up), w.down, std::nullopt), res2};
}

}  // namespace pdserve
