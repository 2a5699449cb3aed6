"""`pdserve k8s render|crd` and `pdserve operator` from the command line, and the promise that
the rest of pdserve needs neither kopf nor torch for them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import yaml

from pdserve.cli import main
from pdserve.k8s.render import render
from tests.k8s.resources import CPU_EXAMPLE, EXAMPLES, GPU_EXAMPLE, cpu


def test_render_prints_the_manifests_of_every_resource_in_the_file(capsys, tmp_path) -> None:
    two = tmp_path / "two.yaml"
    second = cpu()
    second["metadata"]["name"] = "second"
    two.write_text(CPU_EXAMPLE.read_text() + "\n---\n" + yaml.safe_dump(second))
    assert main(["k8s", "render", str(two)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render(cpu()) + render(second)


def test_render_refuses_with_the_file_document_and_field(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(CPU_EXAMPLE.read_text().replace("replicas: 2", "replicas: -1"))
    assert main(["k8s", "render", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"pdserve: error: {bad}, document 1: the resource does not match the " \
           "DisaggregatedServingCluster schema:\n  spec.decodePool.replicas: -1 is less than " \
           "the minimum of 0" in captured.err


def test_render_refuses_the_gpu_seed_example_saying_why(capsys) -> None:
    assert main(["k8s", "render", str(GPU_EXAMPLE)]) == 2
    assert "the transfer plane does not move such pools yet" in capsys.readouterr().err


def test_render_refuses_a_file_of_another_kind(capsys, tmp_path) -> None:
    other = tmp_path / "pod.yaml"
    other.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n")
    assert main(["k8s", "render", str(other)]) == 2
    assert "expected apiVersion pdserve.dev/v1alpha1, kind DisaggregatedServingCluster; " \
           "got ('v1', 'Pod')" in capsys.readouterr().err


def test_crd_prints_the_examples_crd(capsys) -> None:
    assert main(["k8s", "crd"]) == 0
    assert capsys.readouterr().out == (EXAMPLES / "crd.yaml").read_text()


def test_operator_refuses_a_bad_interval_before_it_starts(capsys) -> None:
    assert main(["operator", "--interval", "0"]) == 2
    assert "--interval must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


def test_render_needs_neither_kopf_nor_torch() -> None:
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        sys.modules["kopf"] = None  # an import of kopf now fails
        sys.modules["kubernetes"] = None
        from pdserve.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["k8s", "render", {str(CPU_EXAMPLE)!r}]) == 0
        assert "kind: Deployment" in out.getvalue()
        print("torch loaded" if "torch" in sys.modules else "torch-free")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "torch-free"
