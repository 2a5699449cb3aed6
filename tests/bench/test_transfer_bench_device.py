"""`pdserve bench transfer --device`: which transports a GPU run measures, what it refuses, and
(marker `gpu`) VRAM moved over NIXL between two processes beside a device-to-device copy."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import transfer_bench
from pdserve.cli import main


def test_a_gpu_run_measures_nixl_alone_and_needs_it(monkeypatch) -> None:
    monkeypatch.setattr(transfer_bench, "available_transports", lambda: ["tcp", "tcp-aes", "nixl"])
    assert transfer_bench.transports_for("cpu") == ["tcp", "tcp-aes", "nixl"]
    assert transfer_bench.transports_for("cuda:1") == ["nixl"]
    monkeypatch.setattr(transfer_bench, "available_transports", lambda: ["tcp", "tcp-aes"])
    with pytest.raises(ValueError, match=r"moves over nixl only \(tcp sends host memory\)"):
        transfer_bench.transports_for("cuda")


def test_the_testbed_takes_no_device(capsys) -> None:
    assert main(["bench", "transfer", "--testbed", "--device", "cuda"]) == 2
    assert "--testbed moves host memory between network namespaces" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vram_moves_over_nixl_between_two_processes() -> None:
    pytest.importorskip("nixl_cu12")
    rows = transfer_bench.move_gbps("nixl", [1, 4], 1, "cuda")
    assert [(mode, n // 368640) for mode, n, _ in rows] == [
        ("push", 3), ("pull", 3), ("push", 12), ("pull", 12)]
    assert all(gbps > 0 for _, _, gbps in rows)
    assert transfer_bench.memcpy_gbps(2**20, 1, "cuda") > 0
    overhead = transfer_bench.session_overhead("nixl", 1, "cuda")  # verified on the GPU
    assert overhead.bytes == 63 * 368640 and overhead.crc32c_ms > 0
