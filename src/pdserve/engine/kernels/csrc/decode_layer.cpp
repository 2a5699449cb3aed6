// One decoder layer of a decode-only step, every operator of it called from here.
//
// Why: on SmolLM2 a layer is ten operators and about as many tensor views, and between them
// Python (module calls, views, argument conversion) took ~100 us a layer here, 3 of a 12 ms
// batch-1 step (EPYC Zen 4). This calls the same operators in the same order as
// `model/llama.py`'s DecoderLayer on the fused operators, so its output is bit-identical to
// that path (tests/engine/test_decode_layer.py); only the glue between them moves to C++.
#include <ATen/ops/empty.h>

#include <string>
#include <vector>

#include "ops.h"

namespace pdserve {

namespace {

at::Tensor linear(const std::string& kernel, const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias) {
  if (kernel == "amx") return amx_linear(x, packed, bias);
  TORCH_CHECK(kernel == "avx512_bf16", "unknown linear kernel ", kernel);
  return dpbf16_linear(x, packed, bias);
}

// q [T, H, D] (rows strided) against each group's rows: groups cover [0, T) in order.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::vector<at::Tensor>& tables, const std::vector<at::Tensor>& lens,
                  double scale) {
  if (tables.size() == 1) return decode_attention(q, k_cache, v_cache, tables[0], lens[0], scale);
  auto out = at::empty(q.sizes(), q.options());
  int64_t row = 0;
  for (size_t g = 0; g < tables.size(); ++g) {
    const int64_t b = lens[g].size(0);
    out.narrow(0, row, b).copy_(
        decode_attention(q.narrow(0, row, b), k_cache, v_cache, tables[g], lens[g], scale));
    row += b;
  }
  TORCH_CHECK(row == q.size(0), "the decode groups cover ", row, " of ", q.size(0), " rows");
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const DecodeLayerWeights& w,
    const DecodeStep& step, at::Tensor& k_cache, at::Tensor& v_cache) {
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
  at::Tensor qkv = linear(w.kernel, normed, w.qkv, w.qkv_bias);
  rope_(qkv, step.positions, step.cos, step.sin_signed, h + kvh, d);
  const at::Tensor qk = qkv.narrow(1, 0, (h + kvh) * d).view({t, h + kvh, d});
  const at::Tensor q = qk.narrow(1, 0, h), k = qk.narrow(1, h, kvh);
  const at::Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d).view({t, kvh, d});
  store_kv_(k, v, k_cache, v_cache, step.slot_blocks, step.slot_offsets);
  const at::Tensor o = attend(q, k_cache, v_cache, step.tables, step.lens, w.scale);
  const at::Tensor attn = linear(w.kernel, o.reshape({t, h * d}), w.o_proj, std::nullopt);
  // h, residual = post_attention_layernorm(attn, residual); mlp
  auto [mlp_in, res2] = add_rms_norm(attn, res, w.post_norm, w.eps);
  const at::Tensor gate_up = linear(w.kernel, mlp_in, w.gate_up, std::nullopt);
  return {linear(w.kernel, silu_mul(gate_up), w.down, std::nullopt), res2};
}

}  // namespace pdserve
