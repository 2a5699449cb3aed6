#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

// Bytes of the next work item's rows prefetched while the current one runs (`Lookahead`):
// with the current item's own rows, well inside a core's L2.
constexpr int64_t kLookahead = 512 << 10;

// One request's context in the paged cache: position t is slot t % bs of block
// table[t / bs]; a slot holds every KV head's row (KVH x D, contiguous), slots are
// `slot_stride` apart (KVH x D, or more where the view is a tensor-parallel rank's heads of a
// wider pool), blocks `block_stride` apart.
struct Context {
  const int64_t* table;
  int64_t len, bs, block_stride, slot_stride;

  // f(t, row) for every position's row in `cache` (K or V of this layer, at the head's
  // offset), walking each block's slots in order. While slot i of a block is read, `span`
  // bytes at slot i of the next block are prefetched from each of `pre` (the K and the V
  // cache): in step with the reads, since a whole block's prefetches at once stall on the
  // core's few outstanding misses. Into L2 (PREFETCHT2), not L1: the rows are read a block
  // later, and ~1.05-1.3x faster than with PREFETCHT0 here (interleaved A/B, 30 layers).
  template <typename F>
  void each(const bf16* cache, std::initializer_list<const bf16*> pre, int64_t span, F f) const {
    const int64_t slot_bytes = slot_stride * static_cast<int64_t>(sizeof(bf16));
    for (int64_t b = 0, t = 0; t < len; ++b) {
      const bf16* row = cache + table[b] * block_stride;
      const bool ahead = t + bs < len;
      const int64_t next = ahead ? table[b + 1] * block_stride : 0;
      for (int64_t i = 0, end = std::min(len, t + bs); t < end; ++t, ++i, row += slot_stride) {
        for (const bf16* p : pre) {
          const char* line = reinterpret_cast<const char*>(p + next) + i * slot_bytes;
          for (int64_t o = 0; ahead && o < span; o += 64) __builtin_prefetch(line + o, 0, 1);
        }
        f(t, row);
      }
    }
  }
};

// The rows the next work item will read, prefetched into L2 a few lines per call while this
// item runs the passes that find their own rows in cache (all but its first K pass): without
// it the memory bus idles through those passes, and the next item's first pass waits on
// every block. Lines run block by block, slot by slot, K and V together; at most
// kLookahead bytes.
struct Lookahead {
  const int64_t* table = nullptr;  // the next item's blocks; null: there is no next item
  const char* k = nullptr;         // the K and V cache at the next item's first head
  const char* v = nullptr;
  int64_t bs = 0, block_bytes = 0, slot_bytes = 0, span = 0;  // span: bytes of a slot it reads
  int64_t lines = 0, per_call = 0;  // lines left to fetch; K and V line pairs per call
  int64_t blk = 0, slot = 0, off = 0;  // the cursor: block, slot, byte offset in the span

  void step() {
    for (int64_t n = 0; n < per_call && lines > 0; ++n, lines -= 2) {
      const int64_t at = table[blk] * block_bytes + slot * slot_bytes + off;
      __builtin_prefetch(k + at, 0, 1);
      __builtin_prefetch(v + at, 0, 1);
      if ((off += 64) == span) {
        off = 0;
        if (++slot == bs) slot = 0, ++blk;
      }
    }
  }
};

// Each row of s [rows, len] becomes exp(s_t - max) in place, and inv[j] = 1 / its sum: the
// softmax p_t = exp(s_t - max) / sum, with the division left to the output (o = inv * sum_t
// exp(s_t - max) v_t, one multiply per output instead of one per score).
void exp_rows(float* s, int64_t rows, int64_t len, float* inv) {
  const Vec lowest(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < rows; ++j, s += len) {
    Vec top = lowest;
    for (int64_t t = 0; t < len; t += kVec) {
      const int64_t c = std::min(kVec, len - t);
      const Vec v = Vec::loadu(s + t, c);
      top = at::vec::maximum(top, c == kVec ? v : Vec::set(lowest, v, c));
    }
    const Vec m(max_lane(top));
    Vec total(0.f);
    for (int64_t t = 0; t < len; t += kVec) {
      const int64_t c = std::min(kVec, len - t);
      const Vec e = (Vec::loadu(s + t, c) - m).exp_u20();
      e.store(s + t, c);
      total = total + (c == kVec ? e : Vec::set(Vec(0.f), e, c));
    }
    inv[j] = 1.f / sum(total);
  }
}

// One KV head of one request and its G query heads, D = NV * kVec: q [G, D] (fp32,
// pre-scaled) -> out [G, D] fp32. `slot_offset` is the head's row inside a slot; the K pass
// prefetches `pre_span` bytes from `pre_offset` of each slot of the next block, in K and in V.
// G and NV are compile-time so that q, the partial sums and the output stay in registers.
template <int G, int NV>
void attend(const float* q, const Context& ctx, int64_t slot_offset, int64_t pre_offset,
            int64_t pre_span, const bf16* k_cache, const bf16* v_cache,
            std::vector<float>& scores, float* out, Lookahead& ahead) {
  const int64_t len = ctx.len;
  scores.resize(G * len);
  Vec qv[G][NV], x[NV];
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) qv[j][i] = Vec::loadu(q + (j * NV + i) * kVec);
  auto load = [&](const bf16* p) {
    for (int i = 0; i < NV; i += 2) std::tie(x[i], x[i + 1]) = load_bf16(p + i * kVec);
  };
  const std::initializer_list<const bf16*> pre = {k_cache + pre_offset, v_cache + pre_offset};
  // s[j, t] = q_j . k_t: each product's kVec partial sums are kept, and every kVec positions
  // `sum_each` adds them up for all of those positions at once
  Vec part[G][kVec];
  ctx.each(k_cache + slot_offset, pre, pre_span, [&](int64_t t, const bf16* row) {
    if (pre_span == 0) ahead.step();  // this pass's rows are in cache already
    load(row);
    const int64_t i = t % kVec;
    for (int j = 0; j < G; ++j) {
      Vec s = qv[j][0] * x[0];
      for (int n = 1; n < NV; ++n) s = at::vec::fmadd(qv[j][n], x[n], s);
      part[j][i] = s;
    }
    if (i == kVec - 1 || t == len - 1) {
      for (int j = 0; j < G; ++j) {
        for (int64_t z = i + 1; z < kVec; ++z) part[j][z] = Vec(0.f);
        sum_each(part[j]).store(scores.data() + j * len + t - i, i + 1);
      }
    }
  });
  float inv[G];
  exp_rows(scores.data(), G, len, inv);
  Vec acc[G][NV];
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) acc[j][i] = Vec(0.f);
  ctx.each(v_cache + slot_offset, {}, 0, [&](int64_t t, const bf16* row) {
    ahead.step();
    load(row);  // o_j = inv_j sum_t exp(s[j, t] - max_j) v_t
    for (int j = 0; j < G; ++j) {
      const Vec w(scores[j * len + t]);
      for (int i = 0; i < NV; ++i) acc[j][i] = at::vec::fmadd(w, x[i], acc[j][i]);
    }
  });
  for (int j = 0; j < G; ++j)
    for (int i = 0; i < NV; ++i) (acc[j][i] * Vec(inv[j])).store(out + (j * NV + i) * kVec);
}

using AttendFn = void (*)(const float*, const Context&, int64_t, int64_t, int64_t,
                          const bf16*, const bf16*, std::vector<float>&, float*, Lookahead&);

template <int NV>
AttendFn pick_g(int64_t g) {
  switch (g) {
    case 1: return attend<1, NV>;
    case 2: return attend<2, NV>;
    case 3: return attend<3, NV>;
    case 4: return attend<4, NV>;
    case 5: return attend<5, NV>;
    case 6: return attend<6, NV>;
    case 7: return attend<7, NV>;
    case 8: return attend<8, NV>;
    default: return nullptr;
  }
}

// The kernel for G query heads per KV head and head size D, or nullptr (the rule
// pdserve.engine.kernels.supports() states).
AttendFn pick(int64_t g, int64_t d) {
  if (d == 64) return pick_g<64 / kVec>(g);
  if (d == 128) return pick_g<128 / kVec>(g);
  return nullptr;
}

}  // namespace

void check_decode_tables(const at::Tensor& block_tables, const at::Tensor& lens, int64_t b,
                         int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == b &&
                  block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong,
              "block_tables must be contiguous int64 [B, W]");
  TORCH_CHECK(lens.numel() == b && lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "lens must be contiguous int64 [B]");
  const int64_t width = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(lp[r] > 0 && lp[r] <= width * block_size, "context length ", lp[r],
                " does not fit a table of ", width, " blocks");
    for (int64_t i = 0; i < (lp[r] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[r * width + i] >= 0 && tables[r * width + i] < num_blocks,
                  "block id ", tables[r * width + i], " is outside the pool");
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "q must be bf16 [B, H, D] with contiguous heads");
  check_kv_cache(k_cache, v_cache);
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "k_cache and v_cache must be bf16");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % kvh == 0, "q and the cache disagree on heads");
  const AttendFn fn = pick(h / kvh, d);
  TORCH_CHECK(fn != nullptr, "decode_attention supports head sizes 64 and 128 with up to 8 ",
              "query heads per KV head, not ", d, " and ", h / kvh);
  check_decode_tables(block_tables, lens, b, bs, k_cache.size(0));
  const int64_t g = h / kvh, width = block_tables.size(1), block_stride = k_cache.stride(0);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  auto out = at::empty({b, h, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k_cache.data_ptr<bf16>();
  const bf16* vp = v_cache.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  // A work item is a request and a run of its KV heads: all of them when there are requests
  // enough for every thread (the first head's pass reads each slot's rows of every head, one
  // contiguous block region, the next heads' passes find them in cache), else one.
  const int64_t heads_per_item = b >= 2 * at::get_num_threads() ? kvh : 1;
  const int64_t items_per_req = kvh / heads_per_item;
  const int64_t slot_stride = k_cache.stride(1);  // >= kvh * d: see check_kv_cache
  const int64_t slot_bytes = slot_stride * 2, block_bytes = block_stride * 2;
  const int64_t item_span = heads_per_item * d * 2;  // bytes of each slot an item reads
  const auto item = [&](int64_t i) {  // (request, first KV head) of work item i
    return std::pair<int64_t, int64_t>{i / items_per_req, (i % items_per_req) * heads_per_item};
  };
  const auto lookahead = [&](int64_t i) {  // the rows item i reads first, up to kLookahead
    Lookahead a;
    if (i < 0) return a;
    const auto [r, first] = item(i);
    a.table = tables + r * width;
    a.k = reinterpret_cast<const char*>(kp + first * d);
    a.v = reinterpret_cast<const char*>(vp + first * d);
    a.bs = bs, a.block_bytes = block_bytes, a.slot_bytes = slot_bytes;
    a.span = item_span;
    const int64_t blocks = (lp[r] + bs - 1) / bs;
    a.lines = std::min(blocks * bs * 2 * (a.span / 64), kLookahead / 64);
    return a;
  };
  at::parallel_for(0, b * items_per_req, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(g * d), of(g * d), scores;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [r, first] = item(i);
      const Context ctx{tables + r * width, lp[r], bs, block_stride, slot_stride};
      Lookahead ahead = lookahead(i + 1 < i1 ? i + 1 : -1);
      // spread over the passes that read from cache: 2 per head, less the first K pass
      const int64_t calls = (2 * heads_per_item - 1) * lp[r];
      ahead.per_call = (ahead.lines / 2 + calls - 1) / calls;  // K and V lines per call
      for (int64_t kh = first; kh < first + heads_per_item; ++kh) {
        for (int64_t j = 0; j < g; ++j) {  // query heads kh * g ... kh * g + g - 1
          to_float(qp + r * q.stride(0) + (kh * g + j) * q.stride(1), &qf[j * d], d);
          for (int64_t e = 0; e < d; ++e) qf[j * d + e] *= static_cast<float>(scale);
        }
        // the item's first K pass prefetches the K and V rows of every head it will read
        const int64_t span = kh == first ? item_span : 0;
        fn(qf.data(), ctx, kh * d, first * d, span, kp, vp, scores, of.data(), ahead);
        to_bf16(of.data(), op + (r * h + kh * g) * d, g * d);
      }
    }
  });
  return out;
}

}  // namespace pdserve
