"""The comparison's pictures are written from records and traces of the shapes the bench
produces (PNG files that matplotlib really rendered)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench import plots
from pdserve.bench.compare import pictures, worker_roles
from pdserve.bench.plots import (
    LONG_PREFILL_TOKENS,
    _window,
    latency_cdfs,
    role_timeline,
    step_timeline,
)

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


def _span(role: str, since: float, old: str | None = None, seconds: float | None = None
          ) -> dict:
    return {"role": role, "since": since, "from": old, "flip_seconds": seconds}


DECODE = [[100.0 + 0.05 * i, 100.04 + 0.05 * i, 0, 4, 4, 400] for i in range(100)]
PREFILL = [[101.0, 101.5, LONG_PREFILL_TOKENS, 0, 1, 0], [103.0, 103.1, 40, 0, 1, 0]]
TRACES = {"elastic": {"decode-0": DECODE, "prefill-0": PREFILL}}
# decode-0 becomes a prefill worker inside step_timeline's window (100.6 .. 104.6), and back
# after it; prefill-0 never changes role
ROLES = {"elastic": {"decode-0": [_span("decode", 0.0), _span("prefill", 102.0, "decode", 0.3),
                                  _span("decode", 150.0, "prefill", 0.2)],
                     "prefill-0": [_span("prefill", 0.0)]}}


@pytest.fixture
def figure_texts(monkeypatch) -> list[str]:
    """The text drawn on each figure the plots close (after saving it)."""
    texts: list[str] = []
    close = plots.plt.close

    def keep(fig) -> None:
        texts.extend(t.get_text() for ax in fig.axes for t in ax.texts)
        close(fig)

    monkeypatch.setattr(plots.plt, "close", keep)
    return texts


def test_the_step_timeline_marks_a_flip_inside_its_window(tmp_path: Path,
                                                           figure_texts: list[str]) -> None:
    out = step_timeline(TRACES, tmp_path / "timeline.png", roles=ROLES)
    assert out.read_bytes().startswith(PNG)
    assert figure_texts == ["decode->prefill"]  # the change back lies after the window


def test_the_role_timeline_marks_every_flip_of_the_run(tmp_path: Path,
                                                       figure_texts: list[str]) -> None:
    out = role_timeline(TRACES, ROLES, {"elastic": (100.0, 160.0)}, tmp_path / "roles.png")
    assert out.read_bytes().startswith(PNG)
    assert figure_texts == ["decode->prefill", "prefill->decode"]


def test_the_pictures_include_the_roles_only_when_a_configuration_flipped(tmp_path: Path
                                                                          ) -> None:
    def result(roles: dict) -> dict:
        return {"requests": _records(1.0), "run_window": [100.0, 160.0],
                "workers": {w: worker_roles(i, f"http://w{i}", spans, 100.0, 160.0)
                            for i, (w, spans) in enumerate(roles.items())}}

    steady = {"prefill-0": [_span("prefill", 0.0)], "decode-0": [_span("decode", 0.0)]}
    results = {"disagg": result(steady), "elastic": result(ROLES["elastic"])}
    traces = {"disagg": TRACES["elastic"], "elastic": TRACES["elastic"]}
    names = [p.name for p in pictures(results, traces, tmp_path / "all")]
    assert names == ["ttft_cdf.png", "itl_cdf.png", "timeline.png", "roles.png"]
    names = [p.name for p in pictures({"disagg": results["disagg"]}, {"disagg": traces["disagg"]},
                                      tmp_path / "steady")]
    assert names == ["ttft_cdf.png", "itl_cdf.png", "timeline.png"]
