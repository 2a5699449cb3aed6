"""Tensor parallelism inside one engine (Megatron-LM's split, Shoeybi et al. 2019).

An engine with `tensor_parallel_size` N is N processes on one host. Rank 0 is the engine
process itself: it schedules, owns the block manager, samples. Ranks 1..N-1 are children it
spawns at construction (`rank_group.py`), each running `rank_process.py`: receive a step's
inputs, run the forward, nothing else. Every rank holds
- its share of the attention heads (`shard_plan.py`: whole KV heads with their query heads,
  or one KV head replicated on N / kv_heads ranks; with MLA a run of query heads over the
  whole latent), of the MLP columns and of every expert's columns, sliced from the full
  tensors at load (`shard_weights.py`): q|k|v and gate|up column-parallel, o_proj and down
  row-parallel (a MoE block summed once, whole), followed by a sum over the ranks
  (`row_parallel.py`; through shared memory on an x86-64 CPU, `shm_all_reduce.py`, else a
  process group, `collective.py`);
- a view of the KV pool (`rank_pool.py`): on the CPU one whole-model pool every rank maps
  (`shared_pool.py`), each rank's views narrowed to its KV heads, so the transfer plane moves
  it as any pool; on CUDA a pool of its heads on its own device. A block id means the same
  token slots everywhere, so rank 0's block manager serves every rank;
- the whole embedding, norms, routers and LM head (after the last sum every rank has the
  full hidden state; only rank 0 computes logits).
Each rank is pinned to its own share of the cores (`cpu_split.py`).
"""
