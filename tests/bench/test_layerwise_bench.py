"""`pdserve bench layerwise`: both modes move a prompt's KV to a decode-side process and are
timed; on a GPU (marker `gpu`) both pools are in its memory over nixl."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.bench import layerwise_bench, transfer_bench


def _rows(tiny_model, transport: str, device: str) -> list[layerwise_bench.LayerwiseRow]:
    """One run of the bench, which pins this process to a core and one thread (as a prefill
    worker): both are given back after it."""
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        return layerwise_bench.run(str(tiny_model("llama")), transport, 40, 1, lambda m: None,
                                   device)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def _check(rows: list[layerwise_bench.LayerwiseRow], transport: str) -> None:
    assert [(r.transport, r.mode, r.prompt_tokens) for r in rows] == [
        (transport, "whole", 40), (transport, "layerwise", 40)]
    # 3 blocks of 16 tokens: 2 layers x K and V x 16 x 2 KV heads x 16 dims x 2 bytes each
    assert {r.kv_bytes for r in rows} == {3 * 2 * 2 * 16 * 2 * 16 * 2}
    for r in rows:
        assert 0 < r.prefill_s <= r.prompt_to_ready_s and r.ready_after_token0_ms >= 0


def test_both_modes_deliver_the_kv_and_are_timed(tiny_model) -> None:
    _check(_rows(tiny_model, "tcp", "cpu"), "tcp")


def test_a_gpu_run_takes_nixl_only(monkeypatch) -> None:
    monkeypatch.setattr(transfer_bench, "available_transports", lambda: ["tcp", "nixl"])
    with pytest.raises(ValueError, match="--transport must be one of nixl on cuda"):
        layerwise_bench.main("smollm2", "tcp", 100, 1, False, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layerwise_streaming_from_gpu_memory_over_nixl(tiny_model) -> None:
    pytest.importorskip("nixl_cu12")
    _check(_rows(tiny_model, "nixl", "cuda"), "nixl")
