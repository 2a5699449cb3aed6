"""The engine: one model, one KV pool, one scheduler; `step()` is schedule, run, update.

Roles (config.role; `set_role` changes it while no request moves KV in or out):
- COLLOCATED: prefill and decode.
- PREFILL: a request stops after token 0 unless that token already finishes it. Its blocks
  stay held (state PREFILLED) and its output carries `kv_block_ids`, until `release()`.
  That is the default of `add_request(hand_over=None)` in this role; any role can hand a
  single request over (`hand_over=True`) or run one whole (`hand_over=False`).
- DECODE: also takes `add_remote_request()`: blocks for the prompt are reserved (queued until
  the pool has room; `reserved_blocks()` says when), filled from outside, and the request joins
  the decode batch at `kv_ready()` with the token 0 that the prefill side sampled.

Any role can also `park` a running request (its decoding stops, its blocks are held, PREFILLED)
and hand the KV of a prefix of its tokens over as a prefill would (`hand_over_parked`): a worker
changing role hands its streams to another worker this way, without computing anything again.

Every request ends with all its blocks back in the pool: finished and aborted requests free
theirs at once, preempted ones are recomputed, PREFILLED ones at `release()`.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from pdserve.common.engine_options import Role
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import load_tokenizer
from pdserve.config import EngineConfig
from pdserve.engine import decode_path
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decode_graphs import Capture
from pdserve.engine.model.loader import eos_token_ids, load_model
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.outputs import CompletionOutput, EngineLoad, RequestOutput, StepStats
from pdserve.engine.parallel.rank_group import RankGroup
from pdserve.engine.parallel.rank_pool import kv_pool, rank_kv_cache
from pdserve.engine.parallel.shard_plan import check_tensor_parallel, shard_plan
from pdserve.engine.request import Request, RequestState
from pdserve.engine.runner import LayerHook, ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ChunkSite, Scheduler

DEFAULT_CHUNK_TOKENS = 512


class Engine:
    """`graph_capture`: how decode graphs are captured; None captures CUDA graphs where they
    apply (`decode_path.graph_capture`). Tests pass a stand-in that runs the forward at each
    replay, to take the graph path on a CPU."""

    def __init__(self, config: EngineConfig, graph_capture: Capture | None = None) -> None:
        path = resolve_model(config.model)
        self.model_config = ModelConfig.from_folder(path)
        self.config = config = _resolve(config, self.model_config)
        self.tokenizer = load_tokenizer(path)
        tp = config.tensor_parallel_size
        plan = shard_plan(self.model_config, tp, 0) if tp > 1 else None  # rank 0's share
        num_blocks, pool = kv_pool(config, self.model_config)
        self.ranks: RankGroup | None = None
        try:
            if plan is not None:
                self.ranks = RankGroup(config, path, num_blocks, pool)
            self.model = load_model(path, self.model_config, torch_dtype(config),
                                    config.device, config.max_model_len, config.cpu_kernels,
                                    shard=plan)
            if self.ranks is not None:
                self.ranks.connect(self.model, torch.device(config.device))
            self.kv_cache = rank_kv_cache(config, self.model_config, num_blocks, pool, plan)
        except BaseException:
            self.close()
            raise
        finally:
            if pool is not None:  # every rank has mapped it
                pool.close()
        kernels = decode_path.paged_kernels(config, self.kv_cache.data.dtype, graph_capture)
        if graph_capture is None:
            graph_capture = decode_path.graph_capture(config, self.model_config, self.kv_cache,
                                                      kernels)
        # decode graphs' padding rows write to the pool's last block: never handed out
        usable = self.kv_cache.num_blocks - (graph_capture is not None)
        self.block_manager = BlockManager(usable, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        graphs = None if graph_capture is None else decode_path.build_graphs(
            self.model, self.kv_cache, config, usable, graph_capture)
        self.runner = ModelRunner(self.model, self.kv_cache, config.device, self.ranks,
                                  kernels, graphs)
        self.sampler = Sampler(config.seed, self.model.fused)
        self.outputs = OutputProcessor(self.tokenizer, eos_token_ids(path, self.tokenizer),
                                       config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step()
        # The last step that ran a batch, until `take_step_stats()` takes it.
        self._step_stats: StepStats | None = None
        # Called inside step() after each layer (ModelRunner.run): layer-wise KV streaming.
        self.on_layer: LayerHook | None = None
        self._ids = itertools.count()

    def check_ranks(self) -> None:
        """Raise `RankFailed` if a rank of a tensor-parallel engine has exited: no step can
        run again. Nothing to check with one rank."""
        if self.ranks is not None:
            self.ranks.check()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (bounded wait; idempotent). An
        engine with one rank holds nothing to stop."""
        if self.ranks is not None:
            self.ranks.close()

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None, hand_over: bool | None = None, output_offset: int = 0,
        waited_s: float = 0.0,
    ) -> str:
        """`output_offset`: the prompt ends with that many output tokens of a request moved here
        (a continuation); its k-th new token is sampled as output position output_offset + k.
        `waited_s`: how long the request waited before it came here (its arrival time is that
        much earlier: what its wait for a first token counts from, `Scheduler.prompt_queue`)."""
        if type(output_offset) is not int or output_offset < 0:
            raise ValueError(f"output_offset must be an int >= 0, got {output_offset!r}")
        if not 0 <= waited_s < float("inf"):
            raise ValueError(f"waited_s must be a finite number of seconds >= 0, got "
                             f"{waited_s!r}")
        req = self._new_request(prompt, params, request_id, remote_prefill=False)
        req.arrival_time -= waited_s
        req.hand_over = self.config.role == Role.PREFILL if hand_over is None else hand_over
        req.output_offset = output_offset
        self.scheduler.add(req)
        return req.request_id

    def add_remote_request(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None,
        request_id: str | None = None, output_offset: int = 0,
    ) -> str:
        """Decode role: queue a request whose prompt KV will be written into its blocks.
        `output_offset` as for `add_request` (a continuation whose KV comes from elsewhere)."""
        if self.config.role != Role.DECODE:
            raise ValueError("add_remote_request() needs an engine in the decode role")
        if type(output_offset) is not int or output_offset < 0:
            raise ValueError(f"output_offset must be an int >= 0, got {output_offset!r}")
        req = self._new_request(prompt_token_ids, params, request_id, remote_prefill=True)
        req.output_offset = output_offset
        self.scheduler.add(req)
        self.scheduler.reserve_remote()
        return req.request_id

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """The blocks reserved for a remote request's prompt KV, or None while it waits."""
        req = self._get(request_id)
        if req.state != RequestState.WAITING_FOR_KV:
            raise ValueError(f"request {request_id} is not waiting for KV")
        return list(req.block_ids) or None

    def kv_ready(
        self, request_id: str, first_token: int, logprob: float | None = None,
        top_logprobs: dict[int, float] | None = None,
    ) -> None:
        """The reserved blocks hold the prompt's verified KV; decoding continues from token 0."""
        req = self._get(request_id)
        if req.state != RequestState.WAITING_FOR_KV or not req.block_ids:
            raise ValueError(f"request {request_id} has no reserved blocks waiting for KV")
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first_token {first_token} is outside the vocabulary")
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.commit_computed(req)
        finished = self.outputs.append_token(req, first_token, logprob, top_logprobs)
        self.scheduler.kv_ready(req)
        if finished is not None:
            self._finish(req, finished)
            self._pending.append(self.outputs.make_output(req))

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks. For a reserved remote request the caller
        guarantees that no writer can still write into them."""
        req = self.requests.get(request_id)
        if req is None:
            return
        self.scheduler.remove(req)
        self._finish(req, RequestState.FINISHED_ABORTED)
        self._pending.append(self.outputs.make_output(req))

    def release(self, request_id: str) -> None:
        """Prefill role: the KV of a PREFILLED request has been handed over; free its blocks."""
        req = self._get(request_id)
        if req.state != RequestState.PREFILLED:
            raise ValueError(f"request {request_id} is not prefilled and holding blocks")
        self.block_manager.free(req)
        self.outputs.drop(request_id)
        del self.requests[request_id]

    def park(self, request_id: str) -> bool:
        """Stop a running request that has sampled a token and whose every other token has its
        KV computed (any decoding request between steps), holding its blocks (PREFILLED) for
        `hand_over_parked` and then `release`. False, nothing changed: it is not one (waiting,
        still computing its prompt, or handing over already)."""
        req = self.requests.get(request_id)
        if req is None or req.state != RequestState.RUNNING or req.hand_over or \
                not req.output_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            return False
        self.scheduler.running.remove(req)
        req.state, req.hand_over = RequestState.PREFILLED, True
        return True

    def hand_over_parked(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """The parked request's KV of `prompt_token_ids`, a prefix of its tokens whose KV is
        computed and that ends at or after its own prompt, goes out as a prefill's: the output,
        returned by the next `step`, carries the blocks that hold it and, as token 0, the
        request's token after that prefix (with its logprobs when they were asked for; its text is
        left to the decode side, which detokenizes it after that prefix: `held_tokens` 1)."""
        req = self._get(request_id)
        n = len(prompt_token_ids)
        if req.state != RequestState.PREFILLED or \
                not req.num_prompt_tokens <= n <= req.num_computed_tokens or \
                req.token_ids[:n] != list(prompt_token_ids):
            raise ValueError(f"request {request_id} holds no computed KV for that prompt")
        token, at = req.token_ids[n], n - req.num_prompt_tokens  # its output position
        wants = req.params.logprobs is not None
        self._pending.append(RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(
                index=0, text="", token_ids=[token], finish_reason=None,
                logprobs=[req.output_logprobs[at]] if wants else None,
                top_logprobs=[req.output_top_logprobs[at]] if req.params.logprobs else None,
                new_token_ids=[token], held_tokens=1)],  # its text: the decode side's
            finished=False, num_cached_tokens=n,
            kv_block_ids=req.block_ids[:self.block_manager.blocks_needed(n)]))

    @property
    def role(self) -> Role:
        return self.config.role

    def set_role(self, role: Role) -> None:
        """Take later requests in `role`; the model, the KV pool and its prefix cache stay.
        A request's role-given behaviour (hand-over at token 0, a reservation filled from
        outside) is fixed when it is added, so requests that run whole (decoding, or a local
        prompt) go on in any role; the role changes only while no request moves KV in or out
        (`moves_kv`; ValueError otherwise), so that no held or reserved block outlives the role
        that gave it its meaning."""
        if self.moves_kv():
            raise ValueError("requests of this engine hand KV over or wait for it; its role "
                             "changes only once they have been released or have their KV")
        self.config = dataclasses.replace(self.config, role=Role(role))
        self.scheduler.config = self.config

    def moves_kv(self) -> bool:
        """Some request hands its KV over (computing its prompt for that, or PREFILLED) or
        waits for KV written from outside."""
        return any(r.hand_over or r.state == RequestState.WAITING_FOR_KV
                   for r in self.requests.values())

    def set_prefill_chunk(self, tokens: int | None) -> None:
        """While a request decodes, compute at most `tokens` prompt tokens per step (None: no
        cap beyond the step budget); see `scheduler.py`."""
        if tokens is not None and (type(tokens) is not int or tokens < 1):
            raise ValueError(f"a prefill chunk is an int >= 1 tokens or None, got {tokens!r}")
        self.scheduler.prefill_chunk = tokens

    @property
    def prefill_chunk(self) -> int | None:
        return self.scheduler.prefill_chunk

    def chunk_site(self) -> ChunkSite:
        """The streams the next step decodes and the context its first prompt tokens come
        after (`Scheduler.chunk_site`)."""
        return self.scheduler.chunk_site()

    def prompt_queue(self) -> tuple[tuple[float, int], ...]:
        """The prompts waiting for their first token and their work (`Scheduler.prompt_queue`)."""
        return self.scheduler.prompt_queue()

    def reserve_remote(self) -> None:
        """Decode role: reserve blocks for the queued remote requests the pool has room for now
        (first come, first served), e.g. after blocks were freed outside a step."""
        self.scheduler.reserve_remote()

    def block_generation(self, block_id: int) -> int:
        """The allocation generation of `block_id` (bumped whenever the block is handed out)."""
        return self.block_manager.generation(block_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def has_compute_work(self) -> bool:
        """A step would compute: requests wait for admission or run. False while the only
        requests wait for their KV from outside."""
        return self.scheduler.has_work()

    def load(self) -> EngineLoad:
        s, bm = self.scheduler, self.block_manager
        return EngineLoad(running=len(s.running), waiting=len(s.waiting),
                          waiting_for_kv=len(s.waiting_for_kv),
                          kv_blocks_used=bm.num_used_blocks, kv_blocks_total=bm.num_blocks)

    def take_step_stats(self) -> StepStats | None:
        """What the last step that ran a batch computed, once: None if no batch ran since the
        previous call."""
        stats, self._step_stats = self._step_stats, None
        return stats

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        outputs, self._pending = self._pending, []
        if not batch.requests:
            return outputs
        self._step_stats = StepStats.of(batch)
        logits, sampling = self.runner.run(batch, self.on_layer)
        sampled = self.sampler(logits, [r.params for r in sampling],
                               [r.output_offset + r.num_output_tokens for r in sampling]
                               ) if sampling else None
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            req.num_computed_tokens += n
            self.block_manager.commit_computed(req)
        for i, req in enumerate(sampling):
            outputs.append(self._update(req, sampled.token_ids[i], sampled.logprobs[i],
                                        sampled.top_logprobs[i]))
        return outputs

    def _update(self, req: Request, token: int, logprob, top) -> RequestOutput:
        finished = self.outputs.append_token(req, token, logprob, top)
        if finished is not None:
            self._finish(req, finished)
            return self.outputs.make_output(req)
        if req.hand_over:
            self.scheduler.running.remove(req)
            req.state = RequestState.PREFILLED
            return self.outputs.make_output(req, kv_block_ids=list(req.block_ids))
        return self.outputs.make_output(req)

    def _finish(self, req: Request, state: RequestState) -> None:
        if req in self.scheduler.running:
            self.scheduler.running.remove(req)
        self.block_manager.free(req)
        req.state = state
        del self.requests[req.request_id]

    # -- validation ----------------------------------------------------------------------------

    def _new_request(self, prompt, params, request_id, remote_prefill: bool) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids, text = self._tokenize(prompt)
        req = Request(request_id, token_ids, len(token_ids), params, remote_prefill=remote_prefill)
        if self.block_manager.blocks_needed(len(token_ids) + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens needs more KV blocks than the "
                             f"pool has ({self.block_manager.num_blocks}); raise the KV memory")
        self.requests[request_id] = req
        self.outputs.add(req, text)
        return req

    def _tokenize(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token")
            token_ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, list | tuple):
            token_ids, text = list(prompt), None
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, "
                                 f"{self.model_config.vocab_size}); got {bad[:5]}")
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got "
                             f"{type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but the context is "
                             f"{self.config.max_model_len} (max_model_len), which must also "
                             f"leave room for one new token; shorten the prompt")
        return token_ids, text

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id!r}")
        return req


def _resolve(config: EngineConfig, model: ModelConfig) -> EngineConfig:
    """Fill in defaults that depend on the model; refuse settings that could never run."""
    max_len = config.max_model_len or model.max_context
    if max_len > model.max_context:
        raise ValueError(f"max_model_len {max_len} exceeds the model's context "
                         f"{model.max_context}")
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_CHUNK_TOKENS if config.enable_chunked_prefill else max_len
    if not config.enable_chunked_prefill and budget < max_len:
        raise ValueError(f"max_num_batched_tokens ({budget}) is below max_model_len "
                         f"({max_len}): long prompts could never run; enable chunked prefill "
                         f"or raise the budget")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r} requested but CUDA is not available")
    check_tensor_parallel(model, config.tensor_parallel_size)
    return dataclasses.replace(config, max_model_len=max_len, max_num_batched_tokens=budget)


def torch_dtype(config: EngineConfig) -> torch.dtype:
    """The torch dtype named by `config.dtype` (one of `DTYPE_NAMES`)."""
    return getattr(torch, config.dtype)
