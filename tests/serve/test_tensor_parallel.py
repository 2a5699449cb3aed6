"""`pdserve up` with prefill and decode workers at different tensor-parallel sizes: the KV moves
over the transfer plane between a worker on 2 processes and one on 1 (either way round), the
tokens are the one-process engine's (Llama, and DeepSeek-V3's latent pool), every block comes
back; and a killed rank ends its whole
worker (exit status 1, restarted by `up`) with the peer's blocks back."""

from __future__ import annotations

import functools
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import psutil
import pytest

from pdserve.transfer.layout import LAYOUT_PAGED_MLA
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import LENGTHS, _complete, _offline_texts, prompts

PREFILL, DECODE = 0, 1
# (prefill TP, decode TP, the tiny Llama's KV heads): 2 KV heads split one a rank; 1 KV head
# replicated on both ranks
LAYOUTS = {"p2-d1-two-kv-heads": (2, 1, 2), "p1-d2-one-kv-head": (1, 2, 1)}
RESTART_S = 120  # the killed worker's exit, restart and reload of a tiny model: far less


@pytest.fixture(scope="module", params=list(LAYOUTS))
def tp_cluster(request, tiny_model) -> Cluster:
    prefill_tp, decode_tp, kv_heads = LAYOUTS[request.param]
    cluster = Cluster(tiny_model("llama", num_key_value_heads=kv_heads),
                      "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                      "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp))
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="module")
def deepseek_tp_cluster(request, tiny_model) -> Cluster:
    cluster = Cluster(tiny_model("deepseek_v3"), "--local-prefill-threshold",
                      str(LOCAL_THRESHOLD), "--prefill-tp", "2", "--decode-tp", "1")
    request.addfinalizer(cluster.stop)
    return cluster


def _ranks(pid: int) -> list[psutil.Process]:
    """The tensor-parallel child ranks of worker process `pid`."""
    return [p for p in psutil.Process(pid).children()
            if "spawn_main" in " ".join(p.cmdline())]


def test_greedy_tokens_equal_the_one_process_engine_and_every_block_returns(
        tp_cluster: Cluster) -> None:
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, tp_cluster), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(tp_cluster.model))
    prefill, decode = tp_cluster.health(PREFILL), tp_cluster.health(DECODE)
    assert prefill["kv_layout"] == decode["kv_layout"]  # whole models' pools, both
    assert metric(tp_cluster.worker_url(DECODE),
                  'pdserve_transfer_bytes_total{direction="recv"}') > 0
    assert len(_ranks(prefill["pid"])) + len(_ranks(decode["pid"])) == 1
    tp_cluster.wait_blocks_free([PREFILL, DECODE])


def test_deepseek_latent_kv_moves_from_two_ranks_to_one(deepseek_tp_cluster: Cluster) -> None:
    """MLA + MoE on a prefill worker at TP 2: its latent pool is one every rank writes alike,
    moved whole to a one-process decode worker."""
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, deepseek_tp_cluster), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(deepseek_tp_cluster.model))
    assert deepseek_tp_cluster.health(PREFILL)["kv_layout"]["layout"] == LAYOUT_PAGED_MLA
    assert metric(deepseek_tp_cluster.worker_url(DECODE),
                  'pdserve_transfer_bytes_total{direction="recv"}') > 0
    deepseek_tp_cluster.wait_blocks_free([PREFILL, DECODE])


def test_a_killed_rank_ends_its_worker_and_the_peer_frees_its_blocks(
        tp_cluster: Cluster) -> None:
    """SIGKILL the child rank of the tensor-parallel worker: the next step there fails, that
    worker fails its legs and exits with status 1 (its requests end, none hangs), `up`
    restarts it, the other worker holds no block, and requests are served again."""
    index = PREFILL if _ranks(tp_cluster.health(PREFILL)["pid"]) else DECODE
    before = tp_cluster.health(index)["pid"]
    (rank,) = _ranks(before)
    rank.send_signal(signal.SIGKILL)
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(_outcome, [tp_cluster] * 4, prompts()[2:6]))
    assert all(o == "completed" or o.startswith("error") for o in outcomes), outcomes
    _wait_restarted(tp_cluster, index, before)
    assert not psutil.pid_exists(before) and not rank.is_running()
    name = "prefill-0" if index == PREFILL else "decode-0"
    assert any(f"{name} exited with code 1; restarting it" in line for line in tp_cluster.log)
    tp_cluster.wait_blocks_free([1 - index])
    after = _complete(tp_cluster, prompts()[3])
    assert after.choices[0].text == _offline_texts(tp_cluster.model)[3]
    tp_cluster.wait_blocks_free([PREFILL, DECODE])


def _outcome(cluster: Cluster, prompt: list[int]) -> str:
    try:
        return "completed" if _complete(cluster, prompt).usage.completion_tokens else "empty"
    except openai.APIError as e:
        return f"error: {e}"


def _wait_restarted(cluster: Cluster, index: int, old_pid: int) -> None:
    deadline = time.monotonic() + RESTART_S
    while time.monotonic() < deadline:
        try:
            if cluster.health(index)["pid"] != old_pid:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"worker {index} was not restarted:\n" + "\n".join(cluster.log))

