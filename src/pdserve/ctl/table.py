"""`pdserve ctl workers` as a table for people: one row a worker, columns padded to fit."""

from __future__ import annotations

from typing import Any

COLUMNS = ("NAME", "ROLE", "STATE", "QUEUE", "LEGS", "KV BLOCKS", "CPUS", "URL", "NOTE")


def workers_table(workers: list[dict[str, Any]]) -> str:
    """The table of `workers` (the router's `GET /internal/workers` list)."""
    if not workers:
        return "no workers in the pool"
    rows = [COLUMNS, *(_row(w) for w in workers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                     .rstrip() for row in rows)


def _row(w: dict[str, Any]) -> tuple[str, ...]:
    used, total = w.get("kv_blocks_used"), w.get("kv_blocks_total")
    kv = f"{used}/{total}" if used is not None and total is not None else "-"
    note = f"refused: {w['refused']}" if w.get("refused") else \
        f"cores lent to {w['lent_to']}" if w.get("lent_to") else \
        ("" if w.get("registered") else "static")
    return (str(w["name"]), str(w["role"]), str(w["state"]), str(w.get("queue", "-")),
            str(w.get("legs", "-")), kv, _cpus(w.get("cpus")), str(w["url"]), note)


def _cpus(cpus: object) -> str:
    """Cores as `0,2-3`; "-" when the worker reports none."""
    if not isinstance(cpus, list) or not cpus:
        return "-"
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
