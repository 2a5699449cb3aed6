// Fused CPU operators of the decoder's bf16 path. Each one replaces several PyTorch calls
// (and their ~5-20 us of dispatch each) by one pass over the data, computing in fp32.
#pragma once

// The sources include the ATen headers they use (ATen/core/Tensor.h, ATen/ops/<op>.h), not
// ATen/ATen.h: parsing all of ATen was most of each source's compile time.
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pdserve {

// out = w * rms_norm(x) (fp32 inside, rounded to x's dtype before the weight, as HF does).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// sum = x + residual (rounded to bf16, as a separate add would); out = rms_norm(sum) * w.
// Returns (out, sum).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// gate_up [T, 2I] -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up);

// Rotates, in place, the first `heads` heads of each row of qkv [T, >= heads * D] by the rows
// `positions` of the fp32 tables cos and sin_signed [P, D]:
// x * cos + roll(x, D/2) * sin_signed (RoFormer eq. 34 in HF's rotate-half form).
void rope_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin_signed, int64_t heads, int64_t head_dim);

// MLA's rotary part (model/mla_rope.py), in place: each head of x [T, heads, d] (rows and
// heads may be strided) rotated by its row's fp32 cos and sin [T, d/2], pairs adjacent
// (`interleave`) or the two halves, written de-interleaved: [x1 cos - x2 sin, x2 cos + x1 sin].
void mla_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave);

// Pieces of the operators above, for the ones that fuse them (norm.cpp, rope.cpp):
// y = w * bf16(s / sqrt(mean(s^2) + eps)) for a row s of n already rounded to bf16 (Zhang &
// Sennrich 2019; HF's rounding points: fp32 inside, cast, then the weight in bf16);
void norm_row(const c10::BFloat16* s, const c10::BFloat16* w, c10::BFloat16* y, int64_t n,
              float eps);
// MLA's cos and sin: contiguous fp32 [t, half], one row per row of `rows` (named in the error);
void check_mla_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t t, int64_t half,
                      const char* rows);
// out = MLA's rotation of the row `in` of 2 half (as `mla_rope_`; out may be in), a and b fp32
// scratch of half each.
void rotate_mla_row(const c10::BFloat16* in, c10::BFloat16* out, const float* c, const float* s,
                    int64_t half, bool interleave, float* a, float* b);

// Checks that k_cache and v_cache are one layer's views of the pool:
// [num_blocks, block_size, KVH, D], same shape and strides, each slot's KVH x D contiguous.
void check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache);

// Writes row r of k and v [T, KVH, D] (rows may be strided) into slot slot_offsets[r] of
// block slot_blocks[r] of k_cache and v_cache [num_blocks, block_size, KVH, D].
void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);

// MLA's latent rows into its pool (model/mla_attention.py): row r of kv [T, r + d_r] bf16 (the
// kv_a_proj_with_mqa output; rows may be strided) becomes [norm(c), rotated k_rope] (the
// latent norm `norm_row` with weight [r] and eps, the rotation `rotate_mla_row` by cos and
// sin [T, d_r / 2] fp32) in slot slot_offsets[r] of block slot_blocks[r] of cache
// [num_blocks, block_size, r + d_r]: the same bits as rms_norm, mla_rope_ and a copy.
void mla_store_(const at::Tensor& kv, const at::Tensor& norm_weight, double eps,
                const at::Tensor& cos, const at::Tensor& sin, bool interleave, at::Tensor& cache,
                const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);

// Decode's block tables [B, W] int64 (contiguous) and lens [B] int64: every length fits its
// table's W blocks of block_size, and every block a length reaches is inside the pool.
void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lens, int64_t b,
                         int64_t block_size, int64_t num_blocks);

// One query token per request against its paged context. q [B, H, D] (rows may be strided);
// k_cache, v_cache [num_blocks, block_size, KVH, D] (blocks may be strided); block_tables
// [B, W] int64; lens [B] int64 (positions attended, the new token included). -> [B, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& lens, double scale);

// Whether this build has the prefill attention kernel (AVX512-BF16, or AVX2 and FMA).
bool prefill_attention_available();

// The kernel prefill_attention runs here: "amx", "avx512_bf16", "avx2", or "" (none).
std::string prefill_attention_kernel();

// prefill_attention's kernel for CPUs without AVX512-BF16 (prefill_attention_fma.cpp): the
// same contract in fp32 FMAs (AVX2 and FMA); prefill_attention calls it on such a build.
bool prefill_attention_fma_available();
at::Tensor prefill_attention_fma(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale);

// prefill_attention's kernels on AVX512-BF16's VDPBF16PS (prefill_attention.cpp) and AMX tiles
// (prefill_attention_amx.cpp): the same contract; prefill_attention calls the AMX one where the
// process is granted AMX (amx_available), else VDPBF16PS where the CPU has it, else the FMA one.
at::Tensor prefill_attention_dpbf16(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_table,
                                    int64_t context_len, double scale);
at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale);

// prefill_attention's argument checks (every kernel's); returns the block table's ids.
const int64_t* check_prefill_args(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  int64_t context_len);

// Causal attention of one prefill's n new rows over its paged context of context_len
// positions (the new rows are its last n, their K and V already stored): q [n, H, D] (rows
// may be strided); k_cache, v_cache [num_blocks, block_size, KVH, D]; block_table [>= blocks
// of context_len] int64. -> [n, H, D]. A row's result does not depend on n (chunking).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t context_len, double scale);

// x [B, V] bf16 -> [B] int64: each row's first maximum, as torch.max(dim=-1).indices (a
// NaN counts as the maximum).
at::Tensor argmax_rows(const at::Tensor& x);

// logits [B, V] bf16, temperatures [B] fp32 (> 0), top_ps [B] fp32 in (0, 1] (1: none),
// uniforms [B] fp32 in [0, 1) -> [B] int64: per row the first index, in vocabulary order, whose
// running sum of exp((x - max x) / T) over the row's nucleus (the fewest largest weights reaching
// top_p of the total, ties at its end kept; the whole row at 1) exceeds u x the nucleus's sum:
// inverse-CDF sampling of softmax(x / T) after top-p; never an index of zero weight. A row
// without a finite positive total (a NaN, all -inf) gives its first maximum.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperatures,
                       const at::Tensor& top_ps, const at::Tensor& uniforms);

// Whether this process may use AMX tiles (built for them, and granted by the kernel).
bool amx_available();

// weight [N, K] bf16 (N and K multiples of 32) -> AMX tiles [N/16, K/32, 16, 16, 2].
at::Tensor amx_pack(const at::Tensor& weight);

// x [M, K] bf16 (rows may be strided) . weight^T (+ bias [N]) -> [M, N], from amx_pack's tiles.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias);

// Whether this build has AVX512-BF16 (VDPBF16PS): the linear layer for CPUs without AMX.
bool dpbf16_available();

// weight [N, K] bf16 (N a multiple of 16, K even) -> [N/16, K/2, 16, 2] (16 columns' K-pairs).
at::Tensor dpbf16_pack(const at::Tensor& weight);

// x [M, K] bf16 (rows may be strided) . weight^T (+ bias [N]) -> [M, N], from dpbf16_pack's
// layout.
at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias);

// Whether this build has AVX2 and FMA: the linear layer for CPUs without bf16 arithmetic.
bool avx2_available();

// weight [N, K] bf16 (N a multiple of 16) -> [N/16, K, 8, 2] (16 columns per K row).
at::Tensor avx2_pack(const at::Tensor& weight);

// x [M, K] bf16 (rows may be strided) . weight^T (+ bias [N]) -> [M, N], fp32 FMAs over
// avx2_pack's layout.
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias);

// x . weight^T (+ bias) on the named kernel ("amx" | "avx512_bf16" | "avx2"), from that
// kernel's packed weight.
at::Tensor kernel_linear(const std::string& kernel, const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias);

// A MoE layer's routed experts, each packed once for `kernel` (model/packed_experts.py).
struct ExpertWeights {
  std::vector<at::Tensor> gate_up, down;  // per expert: [2I, hidden] and [hidden, I], packed
  std::string kernel;
};

// x [T, hidden] bf16 (rows may be strided), ids [T, k] int64, weights [T, k] fp32 or bf16 ->
// [T, hidden] bf16: per token, the sum over its slots j, in slot order and in fp32, of
// weights[t, j] times expert ids[t, j]'s down(silu_mul(gate_up(x[t]))) (each product rounded
// to bf16 first where the weights are bf16, as PyTorch multiplies). An unchosen expert is not
// read.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const ExpertWeights& w);

// DeepSeek-V3's noaux_tc routing (moe_route.cpp; model/moe_gate.py's rule): logits [T, E]
// fp32, bias [E] fp32 -> (weights [T, k] fp32, ids [T, k] int64), the chosen best first, ties
// to the lower expert id.
std::tuple<at::Tensor, at::Tensor> noaux_tc_route(const at::Tensor& logits,
                                                  const at::Tensor& bias, int64_t top_k,
                                                  int64_t n_group, int64_t topk_group,
                                                  bool norm_topk_prob, double scaling);

// The softmax top-k routing of Qwen3-MoE, Qwen2-MoE and Mixtral (moe_route.cpp;
// model/moe_gate.py's `softmax_topk`): logits [T, E] fp32 or bf16 -> (weights [T, k] in the
// logits' dtype, ids [T, k] int64): the k largest softmax probabilities (fp32), renormalised to
// sum 1 if `norm_topk_prob`, best first, ties to the lower expert id.
std::tuple<at::Tensor, at::Tensor> softmax_topk_route(const at::Tensor& logits, int64_t top_k,
                                                      bool norm_topk_prob);

// A MoE router's fp32 logits (router_logits.cpp): x [T, hidden] bf16 or fp32 (rows may be
// strided), weight [E, hidden] fp32 -> [T, E] fp32, each logit summed in the same order
// whatever T.
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight);

// MLA decode attention in the absorbed form (mla_decode.cpp), one query row per request:
// q_nope [B, H, d_n] and q_rope [B, H, d_r] (rotated; rows may be strided); cache: one layer's
// latent pool [num_blocks, block_size, r + d_r]; block_tables [B, W] int64; lens [B] int64
// (positions attended, the new token's included); w_uk [H, d_n, r] and w_uv [H, r, d_v]:
// kv_b_proj's key and value halves per head (the value half transposed). All bf16, computed
// in fp32. -> [B, H, d_v].
at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& cache,
                      const at::Tensor& block_tables, const at::Tensor& lens,
                      const at::Tensor& w_uk, const at::Tensor& w_uv, double scale);

// A decoder layer's weights for fused_layer, made once per layer after the linears are packed.
struct LayerWeights {
  at::Tensor input_norm, post_norm;          // [hidden] bf16
  at::Tensor qkv, o_proj, gate_up, down;     // packed for `kernel`
  std::optional<at::Tensor> qkv_bias;        // [(H + 2 KVH) D] fp32
  std::string kernel;                        // "amx" | "avx512_bf16" | "avx2"
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 0, scale = 0;
};

// What every layer of one step shares, made once per step. Rows: the prompts' first (each
// prompt's `prompt_tokens` rows in order), then the decode groups' (each group's lens.size(0)).
struct LayerStep {
  at::Tensor positions;              // [T] int64
  at::Tensor cos, sin_signed;        // fp32 [P, D] tables (rope_)
  at::Tensor slot_blocks, slot_offsets;  // [T] int64: where each row's K/V goes
  std::vector<at::Tensor> prompt_tables;  // per prompt: its block ids [num_blocks] int64
  std::vector<int64_t> prompt_tokens, prompt_context;  // per prompt: its rows, positions attended
  std::vector<at::Tensor> tables, lens;  // per decode group
};

// One decoder layer (Llama family) over a step: the same operators in the same order as
// model/llama.py's DecoderLayer on these operators. x [T, hidden] bf16; residual None for the
// first layer. Returns (out, residual), as DecoderLayer does.
std::tuple<at::Tensor, at::Tensor> fused_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const LayerWeights& w,
    const LayerStep& step, at::Tensor& k_cache, at::Tensor& v_cache);

}  // namespace pdserve
