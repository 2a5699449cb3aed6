"""`pdserve bench compare`'s elastic configuration: `pdserve up --elastic` with disagg's
workers, and the router's role flips read into the results and the table."""

from __future__ import annotations

import argparse

from pdserve.bench.compare import (
    CONFIGS,
    METRIC_KEYS,
    add_compare_args,
    combine_repeats,
    flips_from_metrics,
    format_table,
    paced_ceiling,
    settings,
)

METRICS = """# TYPE pdserve_role_flips_total counter
pdserve_role_flips_total{from="decode",to="prefill"} 2
pdserve_role_flips_total{from="prefill",to="decode"} 1
pdserve_worker_role{worker="127.0.0.1:8002",role="prefill"} 1
pdserve_core_loans_total{event="lent"} 2
pdserve_core_loans_total{event="reclaimed"} 1
"""


def test_elastic_is_disagg_with_the_router_flipping_roles() -> None:
    assert CONFIGS["elastic"] == (*CONFIGS["disagg"], "--elastic")


def test_flips_are_read_from_the_routers_metrics() -> None:
    assert flips_from_metrics(METRICS) == {
        "role_flips": 3, "role_flips_by": {"decode->prefill": 2, "prefill->decode": 1},
        "core_loans": 2, "core_reclaims": 1}
    assert flips_from_metrics("") == {"role_flips": 0, "role_flips_by": {}, "core_loans": 0,
                                      "core_reclaims": 0}


def test_flips_are_a_row_of_the_table_and_a_median_over_repeats() -> None:
    runs = [{**dict.fromkeys(METRIC_KEYS, 1.0), "errors": [], "role_flips": n}
            for n in (0, 3, 1)]
    combined = combine_repeats(runs)
    assert combined["role_flips"] == 1 and [r["role_flips"] for r in combined["repeats"]] == \
        [0, 3, 1]
    external = combine_repeats([{**dict.fromkeys(METRIC_KEYS, 1.0), "errors": []}] * 2)
    assert "role_flips" not in external
    table = format_table({"disagg": {"role_flips": 0}, "elastic": {"role_flips": 2},
                          "vllm": {}})
    row = next(line for line in table.splitlines() if line.startswith("role_flips"))
    assert row.split()[1:] == ["0", "2", "n/a"]


def test_the_slo_measured_is_the_clusters_target() -> None:
    """Goodput at a 400 ms TPOT is measured against workers that pace to 400 ms, not to
    `pdserve up`'s default; without an SLO the cluster keeps its defaults."""
    p = argparse.ArgumentParser()
    add_compare_args(p)
    given = settings(p.parse_args(["--slo-ttft-ms", "4000", "--slo-tpot-ms", "400"]))
    assert given.up_args == ("--transport", "tcp", "--slo-ttft-ms", "4000",
                             "--slo-tpot-ms", "400")
    assert settings(p.parse_args([])).up_args == ("--transport", "tcp")
    assert settings(p.parse_args(["--slo-tpot-ms", "0"])).up_args == ("--transport", "tcp")


def test_an_itl_ceiling_reaches_the_cluster_and_each_split_layouts_result() -> None:
    """`--slo-itl-ms` goes to every `pdserve up`; a result records it where the layout's
    workers paced to it (split layouts), for `pdserve simulate --compare-measured`."""
    p = argparse.ArgumentParser()
    add_compare_args(p)
    given = settings(p.parse_args(["--slo-tpot-ms", "100", "--slo-itl-ms", "300"]))
    assert given.up_args == ("--transport", "tcp", "--slo-tpot-ms", "100", "--slo-itl-ms", "300")
    assert paced_ceiling("elastic", given.up_args) == 300.0
    assert paced_ceiling("disagg", given.up_args) == 300.0
    assert paced_ceiling("collocated", given.up_args) is None
    assert paced_ceiling("elastic", settings(p.parse_args([])).up_args) is None
