"""The comparison's pictures are written from records and traces of the shapes the bench
produces (PNG files that matplotlib really rendered)."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.plots import LONG_PREFILL_TOKENS, _window, latency_cdfs, step_timeline

PNG = b"\x89PNG\r\n\x1a\n"


def _records(scale: float) -> list[dict]:
    return [{"ok": True, "ttft_s": scale * (i + 1) / 100, "itl_s": [scale * 0.01] * 5}
            for i in range(20)] + [{"ok": False, "ttft_s": None, "itl_s": []}]


def test_latency_cdfs_are_pngs(tmp_path: Path) -> None:
    paths = latency_cdfs({"collocated": _records(2.0), "disagg": _records(1.0)}, tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf.png", "itl_cdf.png"]
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in paths)


def test_timeline_window_starts_at_the_first_long_prefill(tmp_path: Path) -> None:
    decode = [[100.0 + 0.05 * i, 100.04 + 0.05 * i, 0, 4, 4] for i in range(100)]
    prefill = [[101.0, 101.5, LONG_PREFILL_TOKENS, 0, 1], [102.0, 102.1, 40, 0, 1]]
    traces = {"disagg": {"prefill-0": prefill, "decode-0": decode},
              "collocated": {"collocated-0": sorted(prefill + decode)}}
    assert _window(traces["disagg"], 4.0) == (101.0 - 0.4, 101.0 - 0.4 + 4.0)
    out = step_timeline(traces, tmp_path / "timeline.png")
    assert out.read_bytes().startswith(PNG)
