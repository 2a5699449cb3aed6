"""The admission flags are declared once (cli_args.add_admission_flags) for the router and for
`pdserve simulate`: the same names, types and meaning; only the defaults and their help differ,
the simulator's None standing for the router's measured default."""

from __future__ import annotations

import argparse

import pytest

from pdserve.planner.simulate.admission import DEFAULT_MAX_QUEUE_WAIT_S
from pdserve.planner.simulate.cli import add_simulate_parser
from pdserve.router.admission_settings import add_admission_args, admission_from_args

FLAGS = ("--max-inflight-per-worker", "--max-queue", "--max-queue-wait-s")


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in p._actions if a.option_strings[0] in FLAGS}


def _router() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_admission_args(p)
    return p


def _simulate() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    add_simulate_parser(sub)
    return sub.choices["simulate"]


def test_both_commands_declare_the_same_flags():
    router, simulate = _flags(_router()), _flags(_simulate())
    assert list(router) == list(simulate) == list(FLAGS)
    for flag in FLAGS:
        same = ("type", "metavar", "dest")
        assert [getattr(router[flag], k) for k in same] == \
            [getattr(simulate[flag], k) for k in same]


def test_the_router_defaults_to_its_values_the_simulator_to_none():
    router, simulate = _router().parse_args([]), _simulate().parse_args([])
    assert admission_from_args(router).max_queue_wait_s == DEFAULT_MAX_QUEUE_WAIT_S
    assert (router.max_inflight_per_worker, router.max_queue) == (None, None)
    assert all(getattr(simulate, a.dest) is None for a in _flags(_simulate()).values())


@pytest.mark.parametrize("flag", FLAGS)
def test_each_help_states_its_own_default(flag):
    router, simulate = _flags(_router())[flag].help, _flags(_simulate())[flag].help
    assert "default: the router's" in simulate and "Retry-After" not in simulate
    assert "the router's" not in router.split("default: ")[1]
    refusal = {"--max-queue": "429", "--max-queue-wait-s": "503"}.get(flag)
    if refusal:
        assert f"{refusal} and Retry-After" in router and f"refused with {refusal} (" in simulate
    if flag == "--max-queue-wait-s":
        assert f"the router's, {DEFAULT_MAX_QUEUE_WAIT_S:g})" in simulate
        assert "(default: %(default)s)" in router  # argparse writes the 30.0 in
