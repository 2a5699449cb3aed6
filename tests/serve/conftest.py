"""Clusters started once per test session (each is `pdserve up` with a tiny model)."""

from __future__ import annotations

import pytest

from tests.serve.cluster import Cluster

# Prompts at or under this many uncached tokens run whole on the decode worker; longer ones
# are split into prefill and decode legs. Tests use prompts on both sides of it.
LOCAL_THRESHOLD = 16


def _cluster(request, tiny_model, *args: str) -> Cluster:
    cluster = Cluster(tiny_model(), "--local-prefill-threshold", str(LOCAL_THRESHOLD), *args)
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.fixture(scope="session")
def disagg_tcp(request, tiny_model) -> Cluster:
    # layer-wise streaming on (auto is off on CPU): the tcp cluster serves both ways of sending
    return _cluster(request, tiny_model, "--transport", "tcp", "--kv-layerwise", "on")


@pytest.fixture(scope="session")
def disagg_tcp_sealed(request, tiny_model) -> Cluster:
    return _cluster(request, tiny_model, "--transport", "tcp", "--kv-encrypt")


@pytest.fixture(scope="session")
def disagg_nixl(request, tiny_model) -> Cluster:
    return _cluster(request, tiny_model, "--transport", "nixl")


@pytest.fixture(scope="session")
def collocated(request, tiny_model) -> Cluster:
    # --serve-public: a test addresses the worker's own /v1 as well as the router's
    return _cluster(request, tiny_model, "--collocated", "1", "--serve-public")


@pytest.fixture(params=["collocated", "disagg_tcp", "disagg_nixl"])
def any_cluster(request) -> Cluster:
    return request.getfixturevalue(request.param)
