// One request's context in the paged KV pool, as the prefill attention kernels read it.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>

#include "ops.h"
#include "thread_buffer.h"
#include "vec.h"

namespace pdserve {

// Position p of KV head g: slot p % bs of block table[p / bs] (K and V alike).
struct PagedContext {
  const bf16* k;
  const bf16* v;
  const int64_t* table;
  int64_t bs, block_stride, slot_stride, d;

  int64_t row(int64_t p, int64_t g) const {
    return table[p / bs] * block_stride + (p % bs) * slot_stride + g * d;
  }
};

// The context of a block table's ids in a [num_blocks, block_size, KVH, D] pool.
inline PagedContext paged_context(const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const int64_t* table) {
  return {k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), table, k_cache.size(1),
          k_cache.stride(0), k_cache.stride(1), k_cache.size(3)};
}

// A call's packed K and V tiles, each kernel in its own layout: tile t of KV head g at
// (g * tiles + t) * per_tile elements of T, K and V alike.
template <typename T>
struct KVTiles {
  T* k = nullptr;
  T* v = nullptr;
  int64_t tiles = 0, per_tile = 0;

  T* k_tile(int64_t g, int64_t t) const { return k + (g * tiles + t) * per_tile; }
  T* v_tile(int64_t g, int64_t t) const { return v + (g * tiles + t) * per_tile; }
};

// The KV heads' tiles of one call, packed in parallel (`grain` tiles a task) by
// pack_tile(g, t, k, v), into the calling thread's buffer for Tag (thread_buffer.h), which is
// kept between calls.
template <typename T, typename Tag, typename PackTile>
KVTiles<T> pack_kv_tiles(int64_t kvh, int64_t tiles, int64_t per_tile, int64_t grain,
                         const PackTile& pack_tile) {
  KVTiles<T> out;
  out.tiles = tiles;
  out.per_tile = per_tile;
  const int64_t count = kvh * tiles * per_tile;
  out.k = thread_buffer<T, Tag>(2 * count);
  out.v = out.k + count;
  at::parallel_for(0, kvh * tiles, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      pack_tile(i / tiles, i % tiles, out.k_tile(i / tiles, i % tiles),
                out.v_tile(i / tiles, i % tiles));
  });
  return out;
}

// item(g, first) for every KV head g and run of `rows` query positions from `first` of a
// prompt of n, on every thread, the runs with the longest rows (the last positions attend to
// the most keys) taken first from a shared counter, so the threads finish together under the
// causal triangle.
template <typename Item>
void for_each_item(int64_t kvh, int64_t n, int64_t rows, const Item& item) {
  const int64_t blocks = (n + rows - 1) / rows, items = kvh * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items; i = next++) item(i % kvh, (blocks - 1 - i / kvh) * rows);
  });
}

// A prefill attention kernel's call: its arguments checked, each KV head's tiles packed once
// (pack(pool, kvh, len)), then attend(tiles, g, first, start, group, out) for every item of
// `rows` positions (for_each_item), writing its rows of out [n, H, D].
template <typename Pack, typename Attend>
at::Tensor prefill_by_items(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            int64_t context_len, int64_t rows, const Pack& pack,
                            const Attend& attend) {
  const int64_t* table = check_prefill_args(q, k_cache, v_cache, block_table, context_len);
  const int64_t n = q.size(0), h = q.size(1), kvh = k_cache.size(2);
  const auto tiles = pack(paged_context(k_cache, v_cache, table), kvh, context_len);
  auto out = at::empty({n, h, q.size(2)},
                       q.options().memory_format(at::MemoryFormat::Contiguous));
  bf16* op = out.data_ptr<bf16>();
  const int64_t start = context_len - n, group = h / kvh;
  for_each_item(kvh, n, rows, [&](int64_t g, int64_t first) {
    attend(tiles, g, first, start, group, op);
  });
  return out;
}

}  // namespace pdserve
