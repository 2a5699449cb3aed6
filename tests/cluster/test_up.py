"""`pdserve up`: options, the process plan (ports, cores, argv), the secret file, run_up."""

from __future__ import annotations

import argparse
import os
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdserve.cli_args import parse_cpus
from pdserve.cluster import up
from pdserve.cluster.layout import UpConfig, plan_processes, worker_counts
from pdserve.cluster.secret import remove_secret, write_secret
from pdserve.cluster.supervisor import ProcessSpec
from pdserve.cluster.up_process import free_port
from pdserve.common.engine_options import resolve_dtype
from tests.cluster.helpers import fake_spec

SECRET = Path("/run/secret")
PY = sys.executable


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    up.add_up_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["up", *argv])


def _option(spec: ProcessSpec, name: str) -> list[str]:
    """The values after `name` in spec.argv, up to the next option."""
    rest = spec.argv[spec.argv.index(name) + 1:]
    return list(rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))])


def _options(spec: ProcessSpec) -> dict[str, list[str]]:
    """Every option in spec.argv with its values (each option given once, in any order)."""
    names = [a for a in spec.argv if a.startswith("--")]
    assert len(names) == len(set(names)), names
    return {name: _option(spec, name) for name in names}


def test_default_layout_is_one_prefill_one_decode_then_router() -> None:
    args = _args()
    config = UpConfig.from_args(args)
    assert (config.num_prefill, config.num_decode, config.num_collocated) == (1, 1, 0)
    assert config.cpus == tuple(sorted(os.sched_getaffinity(0)))
    assert args.func is up.run_up
    prefill, decode, router = plan_processes(UpConfig(cpus=(0, 1)), SECRET)
    assert prefill.argv[:4] == (PY, "-m", "pdserve.cli", "worker")
    assert _options(prefill) == {
        "--role": ["prefill"], "--model": ["smollm2"], "--dtype": [resolve_dtype("auto", "cpu")],
        "--device": ["cpu"], "--host": ["127.0.0.1"], "--port": ["8001"], "--kv-port": ["8101"],
        "--transport": ["tcp"], "--secret-file": ["/run/secret"], "--cpus": ["0"],
        "--kv-cache-memory": ["512MiB"], "--kv-layerwise": ["auto"], "--kv-lease": ["30.0"],
        "--slo-tpot-ms": ["100.0"]}  # a split layout's workers keep their streams within it
    assert (prefill.name, prefill.health_url) == ("prefill-0", "http://127.0.0.1:8001/health")
    assert (decode.name, decode.health_url) == ("decode-0", "http://127.0.0.1:8002/health")
    assert _option(decode, "--kv-port") == ["8102"] and _option(decode, "--cpus") == ["1"]
    assert router.argv == (
        PY, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", "8000",
        "--model", "smollm2", "--policy", "least_loaded", "--leg-timeout", "60.0",
        "--secret-file", "/run/secret",
        "--prefill", "http://127.0.0.1:8001", "--decode", "http://127.0.0.1:8002")
    assert router.health_url == "http://127.0.0.1:8000/health"
    assert prefill.signed_health and decode.signed_health and router.signed_health


def test_collocated_layout() -> None:
    config = UpConfig(num_prefill=0, num_decode=0, num_collocated=2, max_model_len=512,
                      port=9000, cpus=(3,))
    *workers, router = plan_processes(config, SECRET)
    assert [w.name for w in workers] == ["collocated-0", "collocated-1"]
    assert [_option(w, "--role") for w in workers] == [["collocated"]] * 2
    assert [_option(w, "--cpus") for w in workers] == [["3"]] * 2
    assert _option(workers[1], "--max-model-len") == ["512"]
    assert _option(router, "--collocated") == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert "--prefill" not in router.argv and "--decode" not in router.argv


def test_three_prefill_two_decode_on_two_cores() -> None:
    config = UpConfig(num_prefill=3, num_decode=2, cpus=(0, 1), transport="nixl",
                      policy="prefix", host="0.0.0.0")
    *workers, router = plan_processes(config, SECRET)
    assert [w.name for w in workers] == ["prefill-0", "prefill-1", "prefill-2", "decode-0",
                                         "decode-1"]
    assert [_option(w, "--cpus")[0] for w in workers] == ["0", "1", "0", "1", "0"]
    assert [_option(w, "--port")[0] for w in workers] == ["8001", "8002", "8003", "8004", "8005"]
    assert [_option(w, "--kv-port")[0] for w in workers] == ["8101", "8102", "8103", "8104",
                                                              "8105"]
    assert all(_option(w, "--host") == ["0.0.0.0"] for w in workers)
    assert _option(router, "--prefill") == [f"http://127.0.0.1:{p}" for p in (8001, 8002, 8003)]
    assert _option(router, "--decode") == ["http://127.0.0.1:8004", "http://127.0.0.1:8005"]
    assert _option(router, "--policy") == ["prefix"]


@pytest.mark.parametrize("argv, match", [
    (["--collocated", "2", "--prefill", "1"], "excludes"),
    (["--collocated", "0"], "collocated"),
    (["--prefill", "0"], "prefill >= 1"),
    (["--prefill", "2", "--decode", "0"], "decode >= 1"),
    (["--prefill", "101"], "at most 100"),
    (["--port", "65500"], "does not fit"),
    (["--cpus", "a,b"], "core numbers"),
    (["--cpus", "3-1"], "empty core range"),
    (["--cpus", "99999"], "not available"),
    (["--kv-cache-memory", "lots"], "size"),
    (["--max-model-len", "0"], "max_model_len"),
    (["--max-num-seqs", "0"], "max_num_seqs must be positive"),
    (["--ready-timeout", "0"], "timeout"),
    (["--transport", "nixl", "--kv-encrypt"], "tcp transport only"),
    (["--transport", "nixl", "--kv-congestion", "cubic"], "tcp transport's connections only"),
    (["--kv-congestion", "two words"], r"--kv-congestion: TcpOptions\.congestion must be"),
    (["--prefill-tp", "0"], "--prefill-tp must be an int >= 1, got 0"),
    (["--collocated", "1", "--decode-tp", "2"], "use --collocated-tp with --collocated"),
    (["--collocated-tp", "2"], "use --prefill-tp and --decode-tp"),
    (["--device", "cuda", "--transport", "nixl", "--prefill-tp", "2"],
     "share one KV pool among their ranks on the CPU only"),
])
def test_bad_options_raise_value_error(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UpConfig.from_args(_args(*argv))


def test_counts_and_cpu_lists() -> None:
    assert worker_counts(None, 2, None) == (1, 2, 0)
    assert worker_counts(3, None, None) == (3, 1, 0)
    assert worker_counts(None, None, 4) == (0, 0, 4)
    assert parse_cpus("4-6,0,5") == (4, 5, 6, 0)


def test_secret_file_is_private_random_and_removed() -> None:
    first, second = write_secret(), write_secret()
    try:
        assert stat.S_IMODE(first.stat().st_mode) == 0o600
        assert stat.S_IMODE(first.parent.stat().st_mode) == 0o700
        text = first.read_text()
        assert len(text) == 64 and int(text, 16) >= 0 and text != second.read_text()
    finally:
        remove_secret(first)
        remove_secret(second)
    assert not first.exists() and not first.parent.exists()
    remove_secret(first)  # idempotent


def test_help_explains_layout(capsys) -> None:
    with pytest.raises(SystemExit):
        _args("--help")
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("PORT+1+i", "PORT+101+i", "one prefill and one decode worker", "0600",
                   "--collocated", "--local-prefill-threshold", "--ready-timeout",
                   "--secret-file FILE", "never deleted", "--serve-public",
                   "answers 403 unless --serve-public", "--metrics-key-file FILE",
                   "'Authorization: Bearer <key>'", "signed with the run's cluster secret"):
        assert phrase in text


def _fake_plan(monkeypatch, worker: ProcessSpec, router: ProcessSpec) -> list[Path]:
    secrets: list[Path] = []

    def plan(config: UpConfig, secret_file: Path) -> list[ProcessSpec]:
        secrets.append(secret_file)
        assert secret_file.exists()
        return [worker, router]

    monkeypatch.setattr(up, "plan_processes", plan)
    return secrets


def test_run_up_announces_then_reports_a_dead_router(monkeypatch, capsys) -> None:
    secrets = _fake_plan(monkeypatch, fake_spec("prefill-0"),
                         fake_spec("router", "--die-after", "0.3"))
    assert up.run_up(_args("--cpus", str(min(os.sched_getaffinity(0))))) == 1
    out, err = capsys.readouterr()
    assert ("pdserve is ready: http://127.0.0.1:8000/v1 (model smollm2; 1 prefill, 1 decode "
            "workers over tcp)") in out
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in out
    assert "router exited unexpectedly with code 3" in err
    assert "stopping..." in err and "stopped" in err
    assert not secrets[0].exists()


def test_run_up_reports_a_worker_that_fails(monkeypatch, capsys) -> None:
    secrets = _fake_plan(monkeypatch, fake_spec("prefill-0", "--lines", "1", "--exit-code", "2"),
                         fake_spec("router"))
    assert up.run_up(_args("--collocated", "1", "--ready-timeout", "10")) == 1
    err = capsys.readouterr().err
    assert "pdserve: error: prefill-0 exited with code 2 before it was healthy" in err
    assert "line 0" in err and "[router]" not in err
    assert not secrets[0].exists()


def test_cores_are_split_evenly_when_there_are_enough() -> None:
    one = plan_processes(UpConfig(num_prefill=0, num_decode=0, num_collocated=1, cpus=(0, 1)),
                         SECRET)
    assert _option(one[0], "--cpus") == ["0,1"]
    four = plan_processes(UpConfig(num_prefill=1, num_decode=1, cpus=(0, 1, 2, 3, 4)), SECRET)
    assert [_option(w, "--cpus") for w in four[:2]] == [["0,1"], ["2,3,4"]]


def test_tensor_parallel_workers_get_a_core_share_per_rank_and_their_size() -> None:
    assert _args("--prefill-tp", "2").prefill_tp == 2
    workers = plan_processes(UpConfig(prefill_tp=2, cpus=tuple(range(6))), SECRET)[:-1]
    assert [_option(w, "--cpus") for w in workers] == [["0,1,2,3"], ["4,5"]]
    assert _option(workers[0], "--tensor-parallel-size") == ["2"]
    assert "--tensor-parallel-size" not in workers[1].argv
    # fewer cores than ranks: share u on core u mod C, a worker's cores distinct
    tight = plan_processes(UpConfig(prefill_tp=1, decode_tp=2, cpus=(0, 1)), SECRET)[:-1]
    assert [_option(w, "--cpus") for w in tight] == [["0"], ["1,0"]]
    both = plan_processes(UpConfig(num_prefill=0, num_decode=0, num_collocated=1,
                                   collocated_tp=2, cpus=(0, 1)), SECRET)
    assert _option(both[0], "--cpus") == ["0,1"]
    assert _option(both[0], "--tensor-parallel-size") == ["2"]


def test_chunked_prefill_and_batch_limits_reach_every_worker() -> None:
    config = UpConfig.from_args(_args("--enable-chunked-prefill", "--max-num-batched-tokens",
                                      "256", "--max-num-seqs", "128", "--cpus", "0"))
    workers = plan_processes(config, SECRET)[:-1]
    for w in workers:
        assert "--enable-chunked-prefill" in w.argv
        assert _option(w, "--max-num-batched-tokens") == ["256"]
        assert _option(w, "--max-num-seqs") == ["128"]
    assert not any("--max-num-seqs" in w.argv for w in plan_processes(UpConfig(), SECRET))


def test_device_reaches_every_worker() -> None:
    config = UpConfig.from_args(_args("--device", "cuda", "--transport", "nixl"))
    assert all(_option(w, "--device") == ["cuda"] for w in plan_processes(config, SECRET)[:-1])
    assert all(_option(w, "--device") == ["cpu"] for w in plan_processes(UpConfig(), SECRET)[:-1])
    assert UpConfig(device="cuda:1", num_prefill=0, num_decode=0, num_collocated=2)
    with pytest.raises(ValueError, match="tcp transport moves host memory only"):
        UpConfig(device="cuda:0")
    with pytest.raises(ValueError, match="device must be"):
        UpConfig(device="tpu")


def test_no_cpu_kernels_reaches_every_worker() -> None:
    config = UpConfig.from_args(_args("--no-cpu-kernels"))
    assert all("--no-cpu-kernels" in w.argv for w in plan_processes(config, SECRET)[:-1])
    assert not any("--no-cpu-kernels" in w.argv for w in plan_processes(UpConfig(), SECRET))


def test_enforce_eager_reaches_every_worker() -> None:
    config = UpConfig.from_args(_args("--enforce-eager", "--device", "cuda", "--collocated", "2"))
    assert all("--enforce-eager" in w.argv for w in plan_processes(config, SECRET)[:-1])
    assert not any("--enforce-eager" in w.argv for w in plan_processes(UpConfig(), SECRET))


def test_kv_encryption_reaches_every_worker() -> None:
    config = UpConfig.from_args(_args("--kv-encrypt", "--prefill", "2"))
    workers = plan_processes(config, SECRET)[:-1]
    assert len(workers) == 3 and all("--kv-encrypt" in w.argv for w in workers)
    plain = plan_processes(UpConfig(), SECRET)[:-1]
    assert not any("--kv-encrypt" in w.argv for w in plain)


def test_kv_congestion_control_reaches_every_worker() -> None:
    workers = plan_processes(UpConfig.from_args(_args("--kv-congestion", "cubic")), SECRET)[:-1]
    assert len(workers) == 2
    for w in workers:
        assert w.argv[w.argv.index("--kv-congestion") + 1] == "cubic"
    assert not any("--kv-congestion" in w.argv for w in plan_processes(UpConfig(), SECRET)[:-1])


def test_layerwise_streaming_setting_reaches_every_worker() -> None:
    workers = plan_processes(UpConfig.from_args(_args("--kv-layerwise", "on")), SECRET)[:-1]
    assert all(_option(w, "--kv-layerwise") == ["on"] for w in workers)
    with pytest.raises(ValueError, match="kv_layerwise"):
        UpConfig(kv_layerwise="sometimes")


def test_kv_lease_reaches_every_worker() -> None:
    workers = plan_processes(UpConfig.from_args(_args("--kv-lease", "2.5")), SECRET)[:-1]
    assert all(_option(w, "--kv-lease") == ["2.5"] for w in workers)
    with pytest.raises(ValueError, match="--kv-lease must be > 0 seconds"):
        UpConfig(kv_lease_s=0)


def test_leg_timeout_reaches_the_router() -> None:
    config = UpConfig.from_args(_args("--leg-timeout", "4", "--kv-lease", "2"))
    router = plan_processes(config, SECRET)[-1]
    assert _option(router, "--leg-timeout") == ["4.0"]
    with pytest.raises(ValueError, match="--leg-timeout must be > 0 seconds"):
        UpConfig(leg_timeout_s=-1)
    with pytest.raises(ValueError, match=r"--leg-timeout \(30.0 s\) must exceed --kv-lease"):
        UpConfig(leg_timeout_s=30.0, kv_lease_s=30.0)


def test_split_options_reach_the_router_only_when_given() -> None:
    config = UpConfig.from_args(_args("--local-prefill-threshold", "64", "--slo-tpot-ms", "50"))
    router = plan_processes(config, SECRET)[-1]
    assert _option(router, "--local-prefill-threshold") == ["64"]
    assert _option(router, "--slo-tpot-ms") == ["50"]
    default = plan_processes(UpConfig.from_args(_args()), SECRET)[-1]
    assert "--local-prefill-threshold" not in default.argv and "--slo-tpot-ms" not in default.argv


def test_elastic_options_reach_the_router_only_when_given() -> None:
    config = UpConfig.from_args(_args("--elastic", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"))
    router = plan_processes(config, SECRET)[-1]
    assert "--elastic" in router.argv and _option(router, "--elastic") == []
    assert _option(router, "--slo-ttft-ms") == ["500"]
    assert _option(router, "--slo-tpot-ms") == ["50"]
    # split layouts pace their workers' local prefills to the TPOT target; collocated-only
    # ones prefill whole prompts
    for worker in plan_processes(config, SECRET)[:-1]:
        assert _option(worker, "--slo-tpot-ms") == ["50.0"]
    default = plan_processes(UpConfig.from_args(_args()), SECRET)[-1]
    assert "--elastic" not in default.argv and "--slo-ttft-ms" not in default.argv
    collocated = plan_processes(UpConfig.from_args(_args("--collocated", "2")), SECRET)[:-1]
    assert len(collocated) == 2 and not any("--slo-tpot-ms" in w.argv for w in collocated)
    with pytest.raises(ValueError, match="--elastic flips workers between prefill and decode"):
        UpConfig.from_args(_args("--elastic", "--collocated", "1"))
    with pytest.raises(ValueError, match="--slo-ttft-ms must be > 0"):
        UpConfig.from_args(_args("--elastic", "--slo-ttft-ms", "0"))


def test_elastic_timing_reaches_the_router_only_when_given() -> None:
    config = UpConfig.from_args(_args("--elastic", "--elastic-interval-s", "0.5",
                                      "--elastic-sustain-ticks", "5",
                                      "--elastic-cooldown-s", "12"))
    router = plan_processes(config, SECRET)[-1]
    assert (_option(router, "--elastic-interval-s"), _option(router, "--elastic-sustain-ticks"),
            _option(router, "--elastic-cooldown-s")) == (["0.5"], ["5"], ["12.0"])
    assert "--slo-ttft-ms" not in router.argv
    default = plan_processes(UpConfig.from_args(_args("--elastic")), SECRET)[-1]
    assert not [a for a in default.argv if a.startswith("--elastic-")]
    unused = plan_processes(UpConfig.from_args(_args("--elastic-cooldown-s", "12")), SECRET)[-1]
    assert not [a for a in unused.argv if a.startswith("--elastic")]


@pytest.mark.parametrize(("argv", "match"), [
    (["--elastic-interval-s", "0"], r"--elastic-interval-s must be a number > 0, got 0.0"),
    (["--elastic-cooldown-s", "nan"], r"--elastic-cooldown-s must be a number > 0, got nan"),
    (["--elastic-sustain-ticks", "0"], r"--elastic-sustain-ticks must be an integer >= 1, got 0"),
])
def test_bad_elastic_timing_is_refused_before_anything_starts(argv: list[str],
                                                              match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UpConfig.from_args(_args("--elastic", *argv))
    with pytest.raises(ValueError, match=match):  # a mistake without --elastic too
        UpConfig.from_args(_args(*argv))


def test_admission_options_reach_the_router() -> None:
    config = UpConfig.from_args(_args("--max-queue", "0", "--max-queue-wait-s", "2.5",
                                      "--max-inflight-per-worker", "3"))
    router = plan_processes(config, SECRET)[-1]
    assert (_option(router, "--max-queue"), _option(router, "--max-queue-wait-s"),
            _option(router, "--max-inflight-per-worker")) == (["0"], ["2.5"], ["3"])
    with pytest.raises(ValueError, match="--max-queue-wait-s must be a number of seconds > 0"):
        UpConfig.from_args(_args("--max-queue-wait-s", "0"))


def _file(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_serve_public_and_the_metrics_key_reach_their_processes(tmp_path: Path) -> None:
    key = _file(tmp_path / "metrics-key", "k" * 32)
    config = UpConfig.from_args(_args("--serve-public", "--metrics-key-file", str(key),
                                      "--cpus", "0"))
    *workers, router = plan_processes(config, SECRET)
    for w in workers:
        assert "--serve-public" in w.argv and _option(w, "--metrics-key-file") == [str(key)]
        assert _option(w, "--secret-file") == [str(SECRET)]
    assert _option(router, "--metrics-key-file") == [str(key)]
    assert "--serve-public" not in router.argv
    *plain, router = plan_processes(UpConfig(), SECRET)
    assert not any("--serve-public" in w.argv or "--metrics-key-file" in w.argv
                   for w in [*plain, router])


def test_every_worker_reads_its_argv_back_as_the_configs_values(tmp_path: Path) -> None:
    from pdserve.workers.settings import WorkerLaunch, add_worker_args, launch_from_args

    key, core = _file(tmp_path / "metrics-key", "k" * 32), min(os.sched_getaffinity(0))
    config = UpConfig.from_args(_args(
        "--collocated", "2", "--port", "9000", "--serve-public", "--metrics-key-file", str(key),
        "--enable-chunked-prefill", "--max-num-batched-tokens", "128", "--max-num-seqs", "16",
        "--no-cpu-kernels", "--kv-layerwise", "on", "--kv-lease", "3", "--max-model-len", "512",
        "--dtype", "float32", "--kv-cache-memory", "1GiB", "--max-stop-strings", "4",
        "--cpus", str(core)))
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    for i, worker in enumerate(plan_processes(config, SECRET)[:-1]):
        assert launch_from_args(parser.parse_args(worker.argv[4:])) == WorkerLaunch(
            role="collocated", dtype="float32", port=9001 + i, kv_port=9101 + i,
            secret_file=SECRET, serve_public=True, metrics_key_file=key, kv_layerwise="on",
            cpus=(core,), kv_cache_memory="1GiB", max_model_len=512, max_num_seqs=16,
            enable_chunked_prefill=True, max_num_batched_tokens=128, kv_lease_s=3.0,
            cpu_kernels=False, limits=config.limits)
    assert config.limits.max_stop_strings == 4


@pytest.mark.parametrize("flag, text, match", [
    ("--secret-file", "0123456789abcde", "at least 16 bytes"),
    ("--metrics-key-file", "short", "must be at least 16 characters"),
])
def test_a_bad_secret_or_key_file_is_refused_before_anything_starts(
        tmp_path: Path, capsys, flag: str, text: str, match: str) -> None:
    from pdserve.cli import main

    bad = _file(tmp_path / "bad", text)
    assert main(["up", flag, str(bad), "--ready-timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {bad}" in err and match in err
    assert "starting" not in err
    with pytest.raises(ValueError, match="cannot read --secret-file"):
        UpConfig.from_args(_args("--secret-file", str(tmp_path / "missing")))


def test_run_up_uses_a_given_secret_file_and_keeps_it(monkeypatch, tmp_path: Path) -> None:
    given = _file(tmp_path / "secret", "g" * 32)
    secrets = _fake_plan(monkeypatch, fake_spec("prefill-0"),
                         fake_spec("router", "--die-after", "0.3"))
    assert up.run_up(_args("--secret-file", str(given), "--cpus",
                           str(min(os.sched_getaffinity(0))))) == 1
    assert secrets == [given] and given.read_text() == "g" * 32


def test_request_limits_reach_the_router_and_every_worker() -> None:
    from pdserve.api.limits import limits_from_args

    config = UpConfig.from_args(_args("--max-body-size", "1MiB", "--max-stop-strings", "4",
                                      "--body-timeout", "5", "--special-tokens-in-content",
                                      "parse"))
    specs = plan_processes(config, SECRET)
    for spec in specs:
        parser = argparse.ArgumentParser()
        from pdserve.api.limits import add_limit_args

        add_limit_args(parser)
        limits = limits_from_args(parser.parse_known_args(spec.argv[4:])[0])
        assert limits == config.limits
    assert config.limits.max_body_bytes == 2**20 and config.limits.max_stop_strings == 4
    assert config.limits.special_tokens_in_content.value == "parse"


def test_api_keys_and_the_rate_limit_reach_the_router_only(tmp_path: Path) -> None:
    keys = _file(tmp_path / "keys", "k" * 32 + "\n")
    config = UpConfig.from_args(_args("--api-keys-file", str(keys), "--rate-limit", "2.5"))
    *workers, router = plan_processes(config, SECRET)
    assert _option(router, "--api-keys-file") == [str(keys)]
    assert _option(router, "--rate-limit") == ["2.5"] and _option(router, "--rate-burst") == ["3"]
    assert not any(flag in w.argv for w in workers
                   for flag in ("--api-keys-file", "--rate-limit", "--rate-burst"))


@pytest.mark.parametrize(("argv", "match"), [
    (["--rate-burst", "4"], "give --rate-limit too"),
    (["--rate-limit", "0"], "--rate-limit must be a positive number"),
    (["--max-stop-strings", "0"], "--max-stop-strings must be an integer >= 1"),
])
def test_bad_access_or_limit_options_are_refused_before_anything_starts(
        argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UpConfig.from_args(_args(*argv))


@pytest.mark.parametrize(("cached", "argv", "said"), [
    (False, ["--dtype", "bfloat16"], True),
    (False, [], resolve_dtype("auto", "cpu") == "bfloat16"),  # bf16 where the CPU computes it
    (True, ["--dtype", "bfloat16"], False),
    (False, ["--no-cpu-kernels"], False),
    (False, ["--dtype", "float32"], False),
])
def test_run_up_says_first_when_the_workers_must_compile_the_cpu_operators(
        monkeypatch, capsys, cached: bool, argv: list[str], said: bool) -> None:
    from pdserve.engine import kernels

    def start_workers(*args, **kwargs) -> int:
        print("workers started", file=sys.stderr)
        return 0

    monkeypatch.setattr(kernels, "is_cached", lambda: cached)
    monkeypatch.setattr(up, "run", start_workers)
    assert up.run_up(_args("--cpus", str(min(os.sched_getaffinity(0))), *argv)) == 0
    err = capsys.readouterr().err
    note = ("compiling pdserve's CPU operators once for this environment (about 100 s on 1 core "
            "per worker); workers report ready after that\n")
    assert (note in err) == said
    assert err.endswith(f"{note if said else ''}workers started\n")


_OWN_A_SECRET = ("import sys, time; from pathlib import Path; "
                 "from pdserve.cluster.secret import write_secret; "
                 "print(write_secret(Path(sys.argv[1])), flush=True); time.sleep(60)")


def _secret_owner(root: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process that made a secret directory under `root` as `pdserve up` does, and lives."""
    proc = subprocess.Popen([PY, "-c", _OWN_A_SECRET, str(root)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip()).parent


def test_the_next_run_removes_the_secrets_of_killed_runs_only(monkeypatch, capsys,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_dir = _secret_owner(tmp_path)
    live, live_dir = _secret_owner(tmp_path)
    reused = tmp_path / "pdserve-up-reused"  # its pid now names another process (this one)
    reused.mkdir(mode=0o700)
    (reused / "owner").write_text(f"{os.getpid()} 1")
    unfinished = tmp_path / "pdserve-up-unfinished"  # being made: no owner file yet
    unfinished.mkdir(mode=0o700)
    try:
        killed.kill()
        killed.wait()
        secrets = _fake_plan(monkeypatch, fake_spec("prefill-0"),
                             fake_spec("router", "--die-after", "0.3"))
        assert up.run_up(_args("--cpus", str(min(os.sched_getaffinity(0))))) == 1
        assert (live_dir / "cluster-secret").exists()
    finally:
        live.kill()
        live.wait()
    assert not killed_dir.exists() and not reused.exists()
    assert unfinished.exists() and not secrets[0].parent.exists()
    err = capsys.readouterr().err
    assert f"removed {killed_dir}, left by a pdserve up that is gone" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_dir.name,
                                                                 unfinished.name])


@pytest.mark.parametrize(("offset", "purpose"), [(101, "prefill-0 (KV transfers)"),
                                                 (2, "decode-0 (HTTP)"), (0, "router (HTTP)")])
def test_run_up_refuses_a_port_in_use_before_anything_starts(
        monkeypatch, tmp_path: Path, offset: int, purpose: str) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(up, "run", lambda *a, **k: pytest.fail("started processes"))
    port = free_port((0, 1, 2, 101, 102))
    with socket.create_server(("127.0.0.1", port + offset)), pytest.raises(ValueError) as info:
        up.run_up(_args("--port", str(port)))
    assert str(info.value).startswith(f"port {port + offset} on 127.0.0.1, planned for "
                                      f"{purpose}, is in use (")
    assert str(info.value).endswith("another pdserve up, or something else, is listening "
                                    "there; stop it or use --port")
    assert list(tmp_path.iterdir()) == []  # the run's secret is gone too


def test_the_planned_ports_are_those_the_processes_are_given() -> None:
    from urllib.parse import urlsplit

    from pdserve.cluster.layout import planned_ports

    config = UpConfig.from_args(_args("--prefill", "2", "--decode", "1", "--port", "9000"))
    given = set()
    for spec in plan_processes(config, SECRET):
        given.add((urlsplit(spec.health_url).port, f"{spec.name} (HTTP)"))
        if "--kv-port" in spec.argv:
            given.add((int(_option(spec, "--kv-port")[0]), f"{spec.name} (KV transfers)"))
    assert set(planned_ports(config)) == given and len(given) == 7


def test_log_level_reaches_every_process_and_info_is_left_unsaid() -> None:
    import logging

    from pdserve.cli_args import log_level

    quiet = plan_processes(UpConfig.from_args(_args("--cpus", "0")), SECRET)
    assert all("--log-level" not in spec.argv for spec in quiet)
    loud = plan_processes(UpConfig.from_args(_args("--cpus", "0", "--log-level", "debug")),
                          SECRET)
    assert [_option(spec, "--log-level") for spec in loud] == [["debug"]] * 3
    assert log_level("debug") == logging.DEBUG and log_level("warning") == logging.WARNING
    with pytest.raises(SystemExit):
        _args("--log-level", "verbose")


def test_an_itl_ceiling_reaches_the_pacing_workers_only_and_must_cover_the_tpot_target() -> None:
    config = UpConfig.from_args(_args("--slo-tpot-ms", "50", "--slo-itl-ms", "200"))
    *workers, router = plan_processes(config, SECRET)
    assert [_option(w, "--slo-itl-ms") for w in workers] == [["200.0"], ["200.0"]]
    assert [_option(w, "--slo-ttft-ms") for w in workers] == [["2000.0"], ["2000.0"]]
    assert "--slo-itl-ms" not in router.argv  # the router's decision counts the mean target
    default = plan_processes(UpConfig.from_args(_args()), SECRET)
    assert not any("--slo-itl-ms" in p.argv for p in default)
    assert not any("--slo-ttft-ms" in p.argv for p in default[:-1])  # no ceiling: no use
    collocated = plan_processes(UpConfig.from_args(_args("--collocated", "1", "--slo-itl-ms",
                                                         "300")), SECRET)
    assert not any("--slo-itl-ms" in p.argv for p in collocated)  # whole prompts: no pacing
    with pytest.raises(ValueError, match=r"--slo-itl-ms \(40\) must be at least --slo-tpot-ms "
                                         r"\(50\)"):
        UpConfig.from_args(_args("--slo-tpot-ms", "50", "--slo-itl-ms", "40"))
