"""`pdserve worker` options: what a worker refuses before it loads anything, and why."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from pdserve.api.limits import RequestLimits
from pdserve.common.engine_options import Role
from pdserve.config import EngineConfig
from pdserve.workers.settings import (
    TransportName,
    WorkerLaunch,
    WorkerSettings,
    add_worker_args,
    launch_from_args,
    settings_from_args,
    worker_argv,
)


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


def test_kv_congestion_is_a_checked_tcp_option(tmp_path: Path) -> None:
    assert _settings(tmp_path, "--role", "prefill", "--kv-congestion", "cubic").kv_congestion \
        == "cubic"
    assert _settings(tmp_path, "--role", "prefill").kv_congestion == ""
    with pytest.raises(ValueError, match="--kv-congestion sets the tcp transport's"):
        _settings(tmp_path, "--role", "decode", "--transport", "nixl", "--kv-congestion", "reno")
    with pytest.raises(ValueError, match=r"--kv-congestion: TcpOptions\.congestion must be"):
        _settings(tmp_path, "--role", "decode", "--kv-congestion", "two words")


def test_an_itl_ceiling_comes_with_a_tpot_target_at_most_it(tmp_path: Path) -> None:
    s = _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100", "--slo-itl-ms", "300")
    assert (s.tpot_target_s, s.itl_target_s) == (0.1, 0.3)
    assert _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100").itl_target_s is None
    with pytest.raises(ValueError, match="--slo-itl-ms paces the steps of prompts beside "
                                         "streams: give --slo-tpot-ms too"):
        _settings(tmp_path, "--role", "decode", "--slo-itl-ms", "300")
    with pytest.raises(ValueError, match=r"--slo-itl-ms \(99\) must be at least --slo-tpot-ms "
                                         r"\(100\)"):
        _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100", "--slo-itl-ms", "99")
    with pytest.raises(ValueError, match="must be at least"):
        _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100", "--slo-itl-ms", "nan")


def test_a_ttft_target_comes_with_a_tpot_target(tmp_path: Path) -> None:
    s = _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100", "--slo-ttft-ms", "2000")
    assert s.ttft_target_s == 2.0
    assert _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100").ttft_target_s is None
    with pytest.raises(ValueError, match="--slo-ttft-ms paces the steps of prompts beside "
                                         "streams: give --slo-tpot-ms too"):
        _settings(tmp_path, "--role", "decode", "--slo-ttft-ms", "2000")
    with pytest.raises(ValueError, match=r"--slo-ttft-ms must be > 0, got -5"):
        _settings(tmp_path, "--role", "decode", "--slo-tpot-ms", "100", "--slo-ttft-ms", "-5")


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


def test_enforce_eager_reaches_the_engine_config(tmp_path: Path) -> None:
    assert not _settings(tmp_path, "--role", "decode").engine.enforce_eager
    assert _settings(tmp_path, "--role", "decode", "--enforce-eager").engine.enforce_eager


def test_cpus_takes_the_same_ranges_as_pdserve_up(tmp_path: Path) -> None:
    n = len(os.sched_getaffinity(0))
    assert _settings(tmp_path, "--role", "decode", "--cpus", f"0-{n - 1}").cpus == \
        tuple(range(n))


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


def _reparse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return p.parse_args(argv)


LAUNCHES = [
    WorkerLaunch(),
    WorkerLaunch(role=Role.PREFILL, transport=TransportName.NIXL, device="cuda:1", port=9001,
                 kv_host="10.0.0.2", kv_port=9101, secret_file=Path("/run/s"),
                 kv_layerwise="on", kv_lease_s=2.5, cpus=(0, 3),
                 limits=RequestLimits(max_body_bytes=2**20, max_stop_strings=4,
                                      body_timeout_s=5.0)),
    WorkerLaunch(role=Role.DECODE, model="/models/x", served_model_name="x", dtype="float32",
                 host="0.0.0.0", kv_encrypt=True, kv_congestion="cubic", kv_cache_memory="2GiB",
                 num_kv_blocks=77,
                 block_size=32, max_model_len=512, max_num_seqs=128, seed=7,
                 secret_file=Path("/run/s"), metrics_key_file=Path("/run/m")),
    WorkerLaunch(serve_public=True, enable_chunked_prefill=True, max_num_batched_tokens=256,
                 cpu_kernels=False, max_num_seqs=1, enforce_eager=True),
]


@pytest.mark.parametrize("launch", LAUNCHES)
def test_the_worker_argv_reads_back_as_its_launch(launch: WorkerLaunch) -> None:
    assert launch_from_args(_reparse(worker_argv(launch))) == launch


def test_the_worker_argv_names_the_files_and_gives_these_settings(tmp_path: Path) -> None:
    secret, keys = tmp_path / "secret", tmp_path / "keys"
    secret.write_bytes(b"s" * 32)
    keys.write_text("k" * 16 + "\n")
    core = min(os.sched_getaffinity(0))
    launch = WorkerLaunch(
        role=Role.DECODE, dtype="float32", host="0.0.0.0", port=9002, kv_port=9102,
        secret_file=secret, serve_public=True, metrics_key_file=keys, kv_encrypt=True,
        kv_layerwise="off", cpus=(core,), kv_cache_memory="1MiB", max_model_len=256,
        max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=64,
        kv_lease_s=4.0, cpu_kernels=False, limits=RequestLimits(max_stop_strings=2))
    argv = worker_argv(launch)
    assert argv[argv.index("--secret-file") + 1] == str(secret)
    assert "s" * 16 not in " ".join(argv) and "k" * 16 not in " ".join(argv)
    engine = EngineConfig(model="smollm2", dtype="float32", role=Role.DECODE,
                          kv_cache_bytes=2**20, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=256, enable_chunked_prefill=True, cpu_kernels=False)
    assert settings_from_args(_reparse(argv)) == WorkerSettings(
        role=Role.DECODE, engine=engine, served_model_name="smollm2", host="0.0.0.0",
        port=9002, kv_host="0.0.0.0", kv_port=9102, secret=b"s" * 32, serve_public=True,
        metrics_keys=("k" * 16,), cpus=(core,), kv_lease_s=4.0, kv_encrypt=True,
        kv_layerwise="off", limits=RequestLimits(max_stop_strings=2))
