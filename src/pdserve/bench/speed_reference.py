"""A speed reference: two fixed engine jobs, timed just before a serving run, that say how fast
the machine was at that moment.

A shared machine's speed drifts by more than the simulator's model misses: the same engine
step ran 25-30% faster in one hour than in the next here, with nothing else running. A
calibration fitted on a run at one speed then prices a held-out run at another wrongly, and the
miss reads as the model's. `pdserve bench compare` times the jobs before each configuration's
run and again after it (on the threads that configuration's workers compute on), and keeps both
in the results as `speed_reference`; `pdserve simulate --calibrate A --compare-measured B`
scales A's fitted costs by B's reference over A's (planner/simulate/speed_scale.py). One timing
is a snapshot: the same job timed twice a minute apart here differed by up to 16%, so the two
that bracket the run are averaged.

The jobs, on the run's model in the engine alone (no worker, no HTTP), `threads` compute threads
pinned to the first `threads` cores this process may use (a configuration's first worker is
pinned there too: `pdserve up` splits the cores in order):
- prefill: one prompt of PREFILL_TOKENS random tokens prefilled whole, the median of REPEATS
  after one untimed (first-use costs). A prefill of a few hundred milliseconds is the steadiest
  step to time, and it prices the compute-bound part.
- decode: DECODE_STREAMS streams of DECODE_PROMPT random tokens, prefilled (untimed), then
  DECODE_WINDOWS windows of DECODE_STEPS decode steps, the median of the windows' median
  steps. A decode step reads every weight for a few rows of arithmetic: memory-bound, as the
  decode part of a serving step, so a machine whose memory slows more than its arithmetic
  (held-out decode steps 1.16-1.38x their price while the prefill timings moved 0-8%, on one
  afternoon here) should show it here and not in the prefill. Measured so far it tracked the
  serving decode steps on one thread and not on two (docs/benchmarks.md, "A decode job beside
  the prefill"): `pdserve simulate` reports its factor and prices by it only when asked.
About 13 s with SmolLM2 on 2 threads and 20 s on 1, 3-4 s of it the model's load.

Run as `python -m pdserve.bench.speed_reference --model M --threads T`: one JSON object on
stdout (`measure` runs it so, in a process of its own that is gone before the cluster starts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.engine import Engine

PREFILL_TOKENS = 512
REPEATS = 7
DECODE_STREAMS = 8
DECODE_PROMPT = 128
DECODE_STEPS = 32
DECODE_WINDOWS = 3
KV_BLOCKS = 128  # room for either job (the prompt: 33 blocks of 16; the streams: 8 x 15)


def _time_job(model: str) -> dict[str, Any]:
    # imported here, in the child: bench compare, which imports this module, stays light
    from pdserve.bench.engine_bench import RandomPrompts
    from pdserve.common.model_config import ModelConfig
    from pdserve.common.model_folder import resolve_model
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine

    cfg = ModelConfig.from_folder(resolve_model(model))
    need = max(PREFILL_TOKENS + 8, DECODE_PROMPT + DECODE_STEPS * DECODE_WINDOWS + 8)
    if need > cfg.max_context:
        raise ValueError(f"the speed reference's {PREFILL_TOKENS}-token prompt does not fit "
                         f"{model}'s {cfg.max_context} positions")
    engine = Engine(EngineConfig(model=model, max_model_len=need, enable_prefix_caching=False,
                                 num_kv_blocks=KV_BLOCKS))
    prompts = RandomPrompts(cfg.vocab_size)
    try:
        prefill = [_prefill_s(engine, prompts(1, PREFILL_TOKENS)[0], SamplingParams(max_tokens=1))
                   for _ in range(REPEATS + 1)][1:]
        decode = _decode_step_s(engine, prompts(DECODE_STREAMS, DECODE_PROMPT))
    finally:
        engine.close()
    return {"prefill_tokens": PREFILL_TOKENS, "prefill_s": statistics.median(prefill),
            "decode_streams": DECODE_STREAMS, "decode_prompt_tokens": DECODE_PROMPT,
            "decode_step_s": decode}


def _prefill_s(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    engine.add_request(prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def _decode_step_s(engine: Engine, prompts: list[list[int]]) -> float:
    """The decode job (module docstring): the median of the windows' median step, timed once
    every stream decodes (one untimed step first: first-use costs)."""
    from pdserve.bench.context_bench import decode_step_times  # in the child, as above

    times = decode_step_times(engine, prompts, DECODE_STEPS * DECODE_WINDOWS, warm_steps=1)
    return statistics.median(statistics.median(times[i:i + DECODE_STEPS])
                             for i in range(0, len(times), DECODE_STEPS))


def pin(threads: int) -> None:
    """Compute on `threads` threads pinned to the first `threads` cores this process may use."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cores):
        raise ValueError(f"--threads must be in 1..{len(cores)}, got {threads}")
    os.sched_setaffinity(0, set(cores[:threads]))
    torch.set_num_threads(threads)


def measure(model: str, threads: int) -> dict[str, Any]:
    """The jobs timed in a child process: {"threads", "prefill_tokens", "prefill_s",
    "decode_streams", "decode_prompt_tokens", "decode_step_s"}. RuntimeError when the child
    fails."""
    argv = [sys.executable, "-m", "pdserve.bench.speed_reference", "--model", model,
            "--threads", str(threads)]
    print(f"speed reference: timing {model} on {threads} thread{'s' if threads > 1 else ''}",
          file=sys.stderr, flush=True)
    done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the speed reference failed on {threads} threads "
                           f"(exit {done.returncode})")
    return json.loads(done.stdout)


def bracket(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The results' `speed_reference`: the jobs' shapes once, their timings as [before,
    after]."""
    return {**before, "prefill_s": [before["prefill_s"], after["prefill_s"]],
            "decode_step_s": [before["decode_step_s"], after["decode_step_s"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.speed_reference",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, required=True)
    args = p.parse_args(argv)
    pin(args.threads)
    print(json.dumps({"threads": args.threads, **_time_job(args.model)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
