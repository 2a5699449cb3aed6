"""`pdserve ctl workers` as a table for people: one row a worker, columns padded to fit."""

from __future__ import annotations

from typing import Any

COLUMNS = ("NAME", "ROLE", "STATE", "QUEUE", "LEGS", "KV BLOCKS", "URL", "NOTE")


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
        ("" if w.get("registered") else "static")
    return (str(w["name"]), str(w["role"]), str(w["state"]), str(w.get("queue", "-")),
            str(w.get("legs", "-")), kv, str(w["url"]), note)
