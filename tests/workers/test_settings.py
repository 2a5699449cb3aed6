"""`pdserve worker` options: what a worker refuses before it loads anything, and why."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.workers.settings import add_worker_args, settings_from_args


def _settings(tmp_path: Path, *argv: str):
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 32)
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return settings_from_args(p.parse_args(["--secret-file", str(secret), *argv]))


def test_kv_encryption_is_a_tcp_option(tmp_path: Path) -> None:
    s = _settings(tmp_path, "--role", "prefill", "--kv-encrypt")
    assert s.kv_encrypt and s.transport == "tcp"
    assert not _settings(tmp_path, "--role", "prefill").kv_encrypt
    with pytest.raises(ValueError, match="tcp transport only"):
        _settings(tmp_path, "--role", "decode", "--transport", "nixl", "--kv-encrypt")


def test_a_gpu_worker_that_moves_kv_needs_nixl(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tcp transport moves host memory only: use --transport"):
        _settings(tmp_path, "--role", "decode", "--device", "cuda")
    s = _settings(tmp_path, "--role", "decode", "--device", "cuda:1", "--transport", "nixl")
    assert s.engine.device == "cuda:1"
    assert _settings(tmp_path, "--role", "collocated", "--device", "cuda").engine.device == "cuda"


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cpu:0"])
def test_an_unknown_device_is_a_usage_error(tmp_path: Path, capsys, device: str) -> None:
    with pytest.raises(SystemExit):
        _settings(tmp_path, "--device", device)
    assert f"device must be 'cpu', 'cuda' or 'cuda:N', got '{device}'" in capsys.readouterr().err


def test_no_cpu_kernels_reaches_the_engine_config(tmp_path: Path) -> None:
    assert _settings(tmp_path, "--role", "decode").engine.cpu_kernels
    assert not _settings(tmp_path, "--role", "decode", "--no-cpu-kernels").engine.cpu_kernels


def test_layerwise_streaming_is_on_for_cuda_engines_unless_set() -> None:
    p = argparse.ArgumentParser()
    add_worker_args(p)

    def streams(*argv: str) -> bool:
        return settings_from_args(p.parse_args(["--role", "collocated", *argv])).stream_layers

    assert not streams()  # auto on CPU: sending would share the compute core
    assert streams("--device", "cuda", "--kv-layerwise", "auto")
    assert streams("--kv-layerwise", "on") and not streams("--device", "cuda", "--kv-layerwise",
                                                            "off")


@pytest.mark.parametrize(("argv", "match"), [
    (["--kv-lease", "0"], "--kv-lease"),
    (["--cpus", "a"], "core numbers"),
    (["--cpus", "99999"], "subset"),
    (["--port", "0"], "ports"),
    (["--kv-cache-memory", "lots"], "size"),
])
def test_bad_options_say_what_to_fix(tmp_path: Path, argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _settings(tmp_path, "--role", "prefill", *argv)


def test_a_prefill_or_decode_worker_needs_the_secret() -> None:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    with pytest.raises(ValueError, match="--secret-file"):
        settings_from_args(p.parse_args(["--role", "decode"]))
    assert settings_from_args(p.parse_args(["--role", "collocated"])).secret is None
