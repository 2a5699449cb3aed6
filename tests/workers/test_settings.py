"""`pdserve worker` options: what a worker refuses before it loads anything, and why."""

from __future__ import annotations

import argparse
import re
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


def test_layerwise_streaming_is_on_for_cuda_engines_unless_set(tmp_path: Path) -> None:
    def streams(*argv: str) -> bool:
        return _settings(tmp_path, "--role", "collocated", *argv).stream_layers

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


def _parse(*argv: str):
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return settings_from_args(p.parse_args(list(argv)))


@pytest.mark.parametrize("role", ["prefill", "decode", "collocated"])
def test_every_worker_needs_the_cluster_secret(role: str) -> None:
    with pytest.raises(ValueError, match=r"needs the cluster secret .*give --secret-file"):
        _parse("--role", role)


def test_only_a_public_collocated_worker_may_run_without_a_secret() -> None:
    s = _parse("--role", "collocated", "--serve-public")
    assert s.secret is None and s.serve_public
    with pytest.raises(ValueError, match="--secret-file"):
        _parse("--role", "decode", "--serve-public")


def test_a_short_or_unreadable_secret_file_is_refused_naming_it(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 15 + b"\n")
    refusal = re.escape(f"--secret-file {short}: ") + ".*at least 16 bytes"
    with pytest.raises(ValueError, match=refusal):
        _parse("--role", "collocated", "--secret-file", str(short))
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match=re.escape(f"cannot read --secret-file {missing}")):
        _parse("--role", "collocated", "--serve-public", "--secret-file", str(missing))


def test_the_secret_is_read_and_never_shown(tmp_path: Path) -> None:
    s = _settings(tmp_path, "--role", "decode")
    assert s.secret == b"x" * 32 and not s.serve_public
    assert "xxxx" not in repr(s)


def test_a_metrics_key_file_gives_the_keys_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# scrapers\n" + "a" * 16 + "\n\n" + "b" * 20 + "\n")
    s = _settings(tmp_path, "--metrics-key-file", str(keys))
    assert s.metrics_keys == ("a" * 16, "b" * 20) and "aaaa" not in repr(s)
    assert _settings(tmp_path).metrics_keys == ()
    keys.write_text("short\n")
    refusal = re.escape(f"--metrics-key-file {keys}: key 1 must be at least")
    with pytest.raises(ValueError, match=refusal):
        _settings(tmp_path, "--metrics-key-file", str(keys))
    keys.write_text("\n# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        _settings(tmp_path, "--metrics-key-file", str(keys))


def test_block_size_reaches_the_engine(tmp_path: Path) -> None:
    assert _settings(tmp_path).engine.block_size == 16
    assert _settings(tmp_path, "--block-size", "32").engine.block_size == 32
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        _settings(tmp_path, "--block-size", "24")
