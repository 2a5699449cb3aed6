#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

// Positions per tile. A request's context is read in tiles (FlashAttention's online softmax,
// Dao et al. 2022, for one query row per head): a tile's K and V rows stay in L1/L2 between
// its score and value passes and across the item's KV heads, and the next tile's rows are
// fetched into L2 while this one is computed. A multiple of kVec.
constexpr int64_t kTile = 64;

// Positions per partition. A context longer than one is cut at fixed positions (multiples of
// kPart), each partition computed as a work item of its own and the partitions' softmax states
// merged in order afterwards (flash-decoding): a long context on few requests keeps every
// thread busy, and since the cuts do not depend on the batch or the threads, neither does a
// request's result.
constexpr int64_t kPart = 16 * kTile;

// (request, KV head) merges per thread at least (`merge`).
constexpr int64_t kMergeGrain = 64;

// The next tile's rows (or the next work item's first tile), fetched into L2 one position per
// `step`, `span` bytes of each slot from `k` and `v`: in step with the reads, since a whole
// tile's prefetches at once stall on the core's few outstanding misses.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* slots = nullptr;  // element offsets of the positions' rows
  int64_t n = 0, span = 0, p = 0;

  void step() {
    if (p >= n) return;
    const char* kr = k + slots[p] * static_cast<int64_t>(sizeof(bf16));
    const char* vr = v + slots[p] * static_cast<int64_t>(sizeof(bf16));
    for (int64_t o = 0; o < span; o += 64) {
      __builtin_prefetch(kr + o, 0, 1);
      __builtin_prefetch(vr + o, 0, 1);
    }
    ++p;
  }
};

// Element offsets of positions [t0, t0 + n) of a request's rows in the pool: position t is slot
// t % bs of block table[t / bs], slots `slot_stride` apart (KVH x D, or more where the view is a
// tensor-parallel rank's heads of a wider pool), blocks `block_stride` apart.
void tile_slots(const int64_t* table, int64_t t0, int64_t n, int64_t bs, int64_t block_stride,
                int64_t slot_stride, int64_t* out) {
  int64_t b = t0 / bs, i = t0 % bs;
  for (int64_t p = 0; p < n; ++p) {
    out[p] = table[b] * block_stride + i * slot_stride;
    if (++i == bs) i = 0, ++b;
  }
}

// One tile of n <= kTile positions of one KV head (k and v at the head's offset, rows at
// `slots`) for its G query heads, D = NV * kVec: q [G, D] fp32, pre-scaled, in quad order
// (vec.h). Query head j's running softmax is m[j] (max score), l[j] (sum of exp(s - m)) and
// acc[j] [D] (sum of exp(s - m) v, quad order); per tile (online softmax):
//   m' = max(m, max_t s_t),  l' = l exp(m - m') + sum_t exp(s_t - m'),
//   acc' = acc exp(m - m') + sum_t exp(s_t - m') v_t.
// Scores: each K row is widened once (in chunks of NC vectors held in registers) for all G
// heads; a head's kVec partial sums per position are kept, and every kVec positions
// `sum_each` adds them up at once. Values: head by head, NC accumulators in registers over the
// tile's positions (the rows come from L1). G and NV are compile-time.
template <int G, int NV>
void attend_tile(const float* q, const bf16* k, const bf16* v, const int64_t* slots, int64_t n,
                 float* m, float* l, float* acc, Ahead* ahead) {
  constexpr int NC = NV < 8 ? NV : 8, C = NV / NC;
  alignas(64) float s[G][kTile];
  Vec part[G][kVec];
  for (int64_t p0 = 0; p0 < n; p0 += kVec) {
    const int64_t e = std::min(kVec, n - p0);
    for (int64_t i = 0; i < e; ++i) {
      if (ahead != nullptr) ahead->step();
      const bf16* row = k + slots[p0 + i];
      for (int c = 0; c < C; ++c) {
        Vec x[NC];
        for (int r = 0; r < NC; r += 2)
          std::tie(x[r], x[r + 1]) = load_quads(row + (c * NC + r) * kVec);
        for (int j = 0; j < G; ++j) {  // s_j = q_j . k, two FMA chains
          const float* qj = q + (j * NV + c * NC) * kVec;
          Vec s0 = Vec::loadu(qj) * x[0], s1 = Vec::loadu(qj + kVec) * x[1];
          for (int r = 2; r < NC; r += 2) {
            s0 = at::vec::fmadd(Vec::loadu(qj + r * kVec), x[r], s0);
            s1 = at::vec::fmadd(Vec::loadu(qj + (r + 1) * kVec), x[r + 1], s1);
          }
          part[j][i] = c == 0 ? s0 + s1 : part[j][i] + (s0 + s1);
        }
      }
    }
    for (int j = 0; j < G; ++j) {
      for (int64_t z = e; z < kVec; ++z) part[j][z] = Vec(0.f);
      sum_each(part[j]).store(s[j] + p0);
    }
  }
  const Vec lowest(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < G; ++j) {
    Vec top = lowest;
    for (int64_t t = 0; t < n; t += kVec) {
      const int64_t c = std::min(kVec, n - t);
      const Vec x = Vec::loadu(s[j] + t);
      top = at::vec::maximum(top, c == kVec ? x : Vec::set(lowest, x, c));
    }
    const float mx = std::max(m[j], max_lane(top));
    // 0 on the first tile (m = -inf); exactly 1 while the maximum holds
    const float alpha = mx == m[j] ? 1.f : std::exp(m[j] - mx);
    Vec total(0.f);
    for (int64_t t = 0; t < n; t += kVec) {
      const int64_t c = std::min(kVec, n - t);
      const Vec p = (Vec::loadu(s[j] + t) - Vec(mx)).exp_u20();
      p.store(s[j] + t);
      total = total + (c == kVec ? p : Vec::set(Vec(0.f), p, c));
    }
    l[j] = l[j] * alpha + sum(total);
    m[j] = mx;
    for (int c = 0; c < C; ++c) {
      float* a = acc + (j * NV + c * NC) * kVec;
      Vec o[NC];
      for (int r = 0; r < NC; ++r) o[r] = Vec::loadu(a + r * kVec) * Vec(alpha);
      for (int64_t t = 0; t < n; ++t) {
        const Vec w(s[j][t]);
        const bf16* row = v + slots[t] + c * NC * kVec;
        for (int r = 0; r < NC; r += 2) {
          auto [x0, x1] = load_quads(row + r * kVec);
          o[r] = at::vec::fmadd(w, x0, o[r]);
          o[r + 1] = at::vec::fmadd(w, x1, o[r + 1]);
        }
      }
      for (int r = 0; r < NC; ++r) o[r].store(a + r * kVec);
    }
  }
}

using TileFn = void (*)(const float*, const bf16*, const bf16*, const int64_t*, int64_t, float*,
                        float*, float*, Ahead*);

template <int NV>
TileFn pick_g(int64_t g) {
  switch (g) {
    case 1: return attend_tile<1, NV>;
    case 2: return attend_tile<2, NV>;
    case 3: return attend_tile<3, NV>;
    case 4: return attend_tile<4, NV>;
    case 5: return attend_tile<5, NV>;
    case 6: return attend_tile<6, NV>;
    case 7: return attend_tile<7, NV>;
    case 8: return attend_tile<8, NV>;
    default: return nullptr;
  }
}

// The kernel for G query heads per KV head and head size D, or nullptr (the rule
// pdserve.engine.kernels.supports() states).
TileFn pick(int64_t g, int64_t d) {
  if (d == 64) return pick_g<64 / kVec>(g);
  if (d == 128) return pick_g<128 / kVec>(g);
  return nullptr;
}

// A work item: a request r, a run of its KV heads from `first`, its positions [t0, t1).
struct Item {
  int64_t r, first, t0, t1;
};

// The items in contiguous shares of about equal positions, one share a thread: bounds [s] to
// [s + 1] is share s. Equal counts of items (at::parallel_for's split) would give one thread a
// request's full partitions and the other its short last ones: one stream of 1,280 positions
// over 3 KV heads is items of 1,024, 1,024, 1,024, 256, 256, 256 positions, 3,072 against 768.
// Each cut goes at the item boundary nearest its equal share; every share holds an item. Which
// thread runs an item does not change its result.
std::vector<int64_t> shares(const std::vector<Item>& items, int64_t threads) {
  const int64_t n = static_cast<int64_t>(items.size()), count = std::min(threads, n);
  std::vector<int64_t> before(n + 1, 0);  // positions of the items before item i
  for (int64_t i = 0; i < n; ++i) before[i + 1] = before[i] + items[i].t1 - items[i].t0;
  std::vector<int64_t> bounds{0};
  for (int64_t s = 1; s < count; ++s) {
    const int64_t want = before[n] * s / count;
    int64_t i = std::lower_bound(before.begin(), before.end(), want) - before.begin();
    if (i > 0 && want - before[i - 1] < before[i] - want) --i;
    bounds.push_back(std::clamp(i, bounds.back() + 1, n - (count - s)));
  }
  bounds.push_back(n);
  return bounds;
}

// What every item of a call reads. An item's softmax state, per query head of its run (its
// `heads` = heads_per_item x G): acc [heads][D] (quad order), then m [heads], then l [heads].
struct Call {
  TileFn fn;
  const bf16* q;
  const bf16* k;
  const bf16* v;
  const int64_t* tables;
  int64_t q_stride_b, q_stride_h, width, bs, block_stride, slot_stride;
  int64_t g, d, heads_per_item, span;
  float scale;

  int64_t heads() const { return heads_per_item * g; }
  int64_t state_floats() const { return heads() * (d + 2); }
  const int64_t* table(int64_t r) const { return tables + r * width; }
  void slots(const Item& it, int64_t t0, int64_t n, int64_t* out) const {
    tile_slots(table(it.r), t0, n, bs, block_stride, slot_stride, out);
  }
};

// The item's tiles in order into `state`; the last tile's pass prefetches `next`'s first tile.
// qf: room for the run's queries in fp32 (heads x D).
void run_item(const Call& c, const Item& it, const Item* next, float* state, float* qf) {
  const int64_t d = c.d, heads = c.heads();
  float* acc = state;
  float* m = state + heads * d;
  float* l = m + heads;
  for (int64_t j = 0; j < heads; ++j) {  // query heads first * g ... (first + run) * g - 1
    float* qj = &qf[j * d];
    to_float(c.q + it.r * c.q_stride_b + (it.first * c.g + j) * c.q_stride_h, qj, d);
    for (int64_t e = 0; e < d; ++e) qj[e] *= c.scale;
    to_quads(qj, d);
  }
  std::fill(acc, acc + heads * d, 0.f);
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads, 0.f);
  const auto rows = [&](int64_t first) {  // the K and V cache at a KV head, as bytes
    return std::pair<const char*, const char*>{reinterpret_cast<const char*>(c.k + first * d),
                                               reinterpret_cast<const char*>(c.v + first * d)};
  };
  int64_t slots[kTile], next_slots[kTile];
  c.slots(it, it.t0, std::min(kTile, it.t1 - it.t0), slots);
  for (int64_t t0 = it.t0; t0 < it.t1; t0 += kTile) {
    const int64_t n = std::min(kTile, it.t1 - t0);
    Ahead ahead;  // the next tile's rows, else the next item's first tile
    ahead.slots = next_slots, ahead.span = c.span;
    if (t0 + kTile < it.t1) {
      std::tie(ahead.k, ahead.v) = rows(it.first);
      ahead.n = std::min(kTile, it.t1 - t0 - kTile);
      c.slots(it, t0 + kTile, ahead.n, next_slots);
    } else if (next != nullptr) {
      std::tie(ahead.k, ahead.v) = rows(next->first);
      ahead.n = std::min(kTile, next->t1 - next->t0);
      c.slots(*next, next->t0, ahead.n, next_slots);
    }
    for (int64_t kh = 0; kh < c.heads_per_item; ++kh) {  // the first head's pass prefetches
      const int64_t at = (it.first + kh) * d, j = kh * c.g;
      c.fn(&qf[j * d], c.k + at, c.v + at, slots, n, &m[j], &l[j], &acc[j * d],
           kh == 0 ? &ahead : nullptr);
    }
    while (ahead.p < ahead.n) ahead.step();
    std::copy(next_slots, next_slots + ahead.n, slots);
  }
}

// Query head j of a run: its partitions' states (`parts` of them, `stride` floats apart)
// merged in order, M = max_p m_p, o = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p, into
// out [D] bf16. One partition: o = acc / l, the same bits as without partitions.
void merge(const Call& c, const float* state, int64_t parts, int64_t stride, int64_t j,
           bf16* out) {
  const int64_t d = c.d, heads = c.heads();
  const auto m = [&](int64_t p) { return state[p * stride + heads * d + j]; };
  float top = m(0);
  for (int64_t p = 1; p < parts; ++p) top = std::max(top, m(p));
  alignas(64) float o[128];  // d <= 128 (pick)
  std::fill(o, o + d, 0.f);
  float total = 0.f;
  for (int64_t p = 0; p < parts; ++p) {
    const float* acc = state + p * stride + j * d;
    const float w = parts == 1 ? 1.f : std::exp(m(p) - top);
    total += w * state[p * stride + heads * d + heads + j];
    for (int64_t e = 0; e < d; ++e) o[e] += w * acc[e];
  }
  const Vec inv(1.f / total);
  for (int64_t e = 0; e < d; e += 2 * kVec) {
    auto [x0, x1] = quads(Vec::loadu(&o[e]), Vec::loadu(&o[e + kVec]));
    (x0 * inv).store(&o[e]);
    (x1 * inv).store(&o[e + kVec]);
  }
  to_bf16(o, out, d);
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
  const TileFn fn = pick(h / kvh, d);
  TORCH_CHECK(fn != nullptr, "decode_attention supports head sizes 64 and 128 with up to 8 ",
              "query heads per KV head, not ", d, " and ", h / kvh);
  check_decode_tables(block_tables, lens, b, bs, k_cache.size(0));
  const int64_t g = h / kvh;
  auto out = at::empty({b, h, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  // A work item is a partition of a request and a run of its KV heads: all of them when there
  // are requests enough for every thread (a tile's slots then hold every head's rows, one
  // contiguous region per block, read by the first head's pass and found in cache by the
  // others), else one. Items run request by request, partition by partition.
  const int64_t heads_per_item = b >= 2 * at::get_num_threads() ? kvh : 1;
  const int64_t runs = kvh / heads_per_item;
  const Call c{fn, q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
               block_tables.data_ptr<int64_t>(), q.stride(0), q.stride(1), block_tables.size(1),
               bs, k_cache.stride(0), k_cache.stride(1),  // slots: >= kvh * d, check_kv_cache
               g, d, heads_per_item, heads_per_item * d * static_cast<int64_t>(sizeof(bf16)),
               static_cast<float>(scale)};
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<Item> items;
  std::vector<int64_t> first_item(b);  // request r's items: first_item[r] + part * runs + run
  for (int64_t r = 0; r < b; ++r) {
    first_item[r] = static_cast<int64_t>(items.size());
    for (int64_t t0 = 0; t0 < lp[r]; t0 += kPart)
      for (int64_t run = 0; run < runs; ++run)
        items.push_back({r, run * heads_per_item, t0, std::min(lp[r], t0 + kPart)});
  }
  const int64_t n_items = static_cast<int64_t>(items.size()), stride = c.state_floats();
  std::vector<float> states(n_items * stride);
  const std::vector<int64_t> bounds = shares(items, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> qf(c.heads() * d);
    for (int64_t i = bounds[s0], i1 = bounds[s1]; i < i1; ++i)
      run_item(c, items[i], i + 1 < i1 ? &items[i + 1] : nullptr, &states[i * stride],
               qf.data());
  });
  bf16* op = out.data_ptr<bf16>();
  // a merge is a few hundred operations per query head: fewer than kMergeGrain of them run on
  // this thread, without waking the others
  at::parallel_for(0, b * kvh, kMergeGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // request r, KV head kh: its G query heads
      const int64_t r = i / kvh, kh = i % kvh, parts = (lp[r] + kPart - 1) / kPart;
      const float* state = &states[(first_item[r] + kh / heads_per_item) * stride];
      for (int64_t j = 0; j < g; ++j)
        merge(c, state, parts, runs * stride, (kh % heads_per_item) * g + j,
              op + (r * h + kh * g + j) * d);
    }
  });
  return out;
}

}  // namespace pdserve
