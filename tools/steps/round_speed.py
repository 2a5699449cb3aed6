"""How fast each worker ran in each round of a `pdserve bench compare --repeats N --out X.json`
run, from its steps (X.steps.json keeps every round's, `steps_rounds`): whether a figure that
moved between rounds moved with the machine.

Each worker's steps are cut into the run's rounds at the N - 1 longest gaps between its
consecutive steps (rounds run minutes apart; a worker never idles that long within one), N
from the results beside the steps (`steps_rounds`, else 1). Per round and worker:
- decode-only steps of B - 2 to B streams, B the worker's most common batch over the whole run
  (one shape for every round, so their medians compare; a range, since a stream whose next
  prompt is prefilled elsewhere leaves the batch while the neighbour computes): the median
  duration, and for a decode worker beside a computing neighbour and alone
  (`planner/simulate/neighbour.py`: alone, no other worker's step overlaps it), since a
  neighbour's prefill slows a decode step;
- prompt work: tokens over the seconds of the steps that computed them (decode part included);
- the round's split decisions (local / remote) where the results kept them.

    .venv/bin/python tools/steps/round_speed.py X.steps.json [--config disagg]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from pdserve.planner.simulate.file_spec import FileSpec, results_path
from pdserve.planner.simulate.neighbour import place
from pdserve.planner.simulate.step_fit import Step, select_steps

BATCH_SPAN = 2  # decode steps of B - BATCH_SPAN to B streams count as the modal batch B's


def cut_rounds(steps: Sequence[Step], rounds: int) -> list[list[Step]]:
    """`steps` (in start order) in `rounds` runs, cut at the rounds - 1 longest gaps."""
    gaps = sorted(range(1, len(steps)), key=lambda i: steps[i].start_s - steps[i - 1].end_s)
    cuts = sorted(gaps[len(gaps) - rounds + 1:]) if rounds > 1 else []
    bounds = [0, *cuts, len(steps)]
    return [list(steps[a:b]) for a, b in itertools.pairwise(bounds)]


def _ms(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms (n={len(values)})" if values else "-"


def worker_line(name: str, steps: Sequence[Step], batch: int | None,
                beside: dict[Step, bool | None] | None) -> str:
    if batch is None:
        return f"  {name}: no decode-only step" + prompt_part(steps)
    decode = [s for s in steps if s.prefill_tokens == 0 and
              batch - BATCH_SPAN <= s.decode_tokens <= batch]
    low = max(1, batch - BATCH_SPAN)
    shape = f"{low}-{batch}" if low < batch else f"{batch}"
    line = f"  {name}: decode at batch {shape} {_ms([s.end_s - s.start_s for s in decode])}"
    if beside is not None:
        for side, want in (("beside", True), ("alone", False)):
            picked = [s.end_s - s.start_s for s in decode if beside.get(s) is want]
            line += f", {side} {_ms(picked)}"
    return line + prompt_part(steps)


def prompt_part(steps: Sequence[Step]) -> str:
    prompt = [s for s in steps if s.prefill_tokens]
    seconds = sum(s.end_s - s.start_s for s in prompt)
    tokens = sum(s.prefill_tokens for s in prompt)
    rate = f"{tokens / seconds:.0f} tokens/s" if seconds else "-"
    return f"; prompts {tokens} tokens in {seconds:.1f} s ({rate})"


def report(path: Path, config: str) -> list[str]:
    results = json.loads(results_path(path).read_text()).get(config, {})
    rounds = int(results.get("steps_rounds", 1))
    steps = select_steps(json.loads(path.read_text()), FileSpec(path, config, "steps"))
    ordered = {w: sorted(rows, key=lambda s: s.start_s) for w, rows in steps.items()}
    placed = {w: {s: q.beside if q.beside or q.alone else None
                  for s, q in zip(ordered[w], ps, strict=True)}
              for w, ps in place(ordered).items()}
    by_round = {w: cut_rounds(rows, rounds) for w, rows in ordered.items()}
    modal = {w: Counter(s.decode_tokens for s in rows if s.prefill_tokens == 0).most_common(1)
             for w, rows in ordered.items()}
    batch = {w: top[0][0] if top else None for w, top in modal.items()}
    decisions = [r.get("split_decisions") for r in results.get("repeats", [results])]
    lines = [f"{path}:{config}, {rounds} round(s)"]
    for i in range(rounds):
        split = decisions[i] if i < len(decisions) and decisions[i] else None
        told = f": {split.get('local', 0)} local, {split.get('remote', 0)} remote" if split else ""
        lines.append(f"round {i + 1}{told}")
        for w, parts in by_round.items():
            if i < len(parts):
                lines.append(worker_line(w, parts[i], batch[w], placed.get(w)))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", type=Path, help="a bench compare X.steps.json")
    p.add_argument("--config", default="disagg", help="the configuration (default: disagg)")
    args = p.parse_args()
    print("\n".join(report(args.steps, args.config)))


if __name__ == "__main__":
    main()
