"""A speed reference: one fixed engine job, timed just before a serving run, that says how fast
the machine was at that moment.

A shared machine's speed drifts by more than the simulator's model misses: the same engine
step ran 25-30% faster in one hour than in the next here, with nothing else running. A
calibration fitted on a run at one speed then prices a held-out run at another wrongly, and the
miss reads as the model's. `pdserve bench compare` times this job before each configuration's
run and again after it (on the threads that configuration's workers compute on), and keeps both
in the results as `speed_reference`; `pdserve simulate --calibrate A --compare-measured B`
scales A's fitted costs by B's reference over A's (planner/simulate/speed_scale.py). One timing
is a snapshot: the same job timed twice a minute apart here differed by up to 16%, so the two
that bracket the run are averaged.

The job, on the run's model in the engine alone (no worker, no HTTP), `threads` compute threads
pinned to the first `threads` cores this process may use (a configuration's first worker is
pinned there too: `pdserve up` splits the cores in order): one prompt of PREFILL_TOKENS random
tokens prefilled whole, the median of REPEATS after one untimed (first-use costs). A prefill
of a few hundred milliseconds is the steadiest step to time; the decode steps of eight streams
(~25 ms each) were tried beside it as the reference of the memory-bound part and moved more
between two timings a minute apart than the machine drifted (docs/benchmarks.md).
About 8 s with SmolLM2 on 2 cores, half of it the model's load.

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
KV_BLOCKS = 64  # room for the job (the prompt: 33 blocks of 16), not 512 MiB


def _time_job(model: str) -> dict[str, Any]:
    # imported here, in the child: bench compare, which imports this module, stays light
    from pdserve.bench.engine_bench import RandomPrompts
    from pdserve.common.model_config import ModelConfig
    from pdserve.common.model_folder import resolve_model
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.config import EngineConfig
    from pdserve.engine.engine import Engine

    cfg = ModelConfig.from_folder(resolve_model(model))
    need = PREFILL_TOKENS + 8
    if need > cfg.max_context:
        raise ValueError(f"the speed reference's {PREFILL_TOKENS}-token prompt does not fit "
                         f"{model}'s {cfg.max_context} positions")
    engine = Engine(EngineConfig(model=model, max_model_len=need, enable_prefix_caching=False,
                                 num_kv_blocks=KV_BLOCKS))
    prompts = RandomPrompts(cfg.vocab_size)
    try:
        prefill = [_prefill_s(engine, prompts(1, PREFILL_TOKENS)[0], SamplingParams(max_tokens=1))
                   for _ in range(REPEATS + 1)][1:]
    finally:
        engine.close()
    return {"prefill_tokens": PREFILL_TOKENS, "prefill_s": statistics.median(prefill)}


def _prefill_s(engine: Engine, prompt: list[int], params: SamplingParams) -> float:
    engine.add_request(prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def pin(threads: int) -> None:
    """Compute on `threads` threads pinned to the first `threads` cores this process may use."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(cores):
        raise ValueError(f"--threads must be in 1..{len(cores)}, got {threads}")
    os.sched_setaffinity(0, set(cores[:threads]))
    torch.set_num_threads(threads)


def measure(model: str, threads: int) -> dict[str, Any]:
    """The job timed in a child process: {"threads", "prefill_tokens", "prefill_s"}.
    RuntimeError when the child fails."""
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
    """The results' `speed_reference`: the job's shape once, its timings as [before, after]."""
    return {**before, "prefill_s": [before["prefill_s"], after["prefill_s"]]}


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
