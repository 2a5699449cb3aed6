"""`pdserve k8s render|crd` and `pdserve operator`: parsers here, work imported when run (kopf,
the Kubernetes client and jsonschema are the `k8s` extra; `pdserve --help` needs none)."""

from __future__ import annotations

import argparse
import sys

from pdserve.k8s.operator_settings import OperatorSettings

MODEL_CONFIG_HELP = ("a planner preset (e.g. llama-3.1-70b) or a config.json / model folder "
                     "here, to check tensorParallelSize against the model's heads when "
                     "spec.model.path exists only in the cluster")


def add_k8s_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "k8s", help="Kubernetes: the DisaggregatedServingCluster CRD and its manifests",
        description="A DisaggregatedServingCluster (pdserve.dev/v1alpha1) is a whole "
                    "cluster: router, prefill and decode pools. `crd` prints its "
                    "CustomResourceDefinition; `render` turns resources into the plain "
                    "manifests that run them (what `pdserve operator` applies).")
    sub = p.add_subparsers(dest="k8s_command", required=True)
    render = sub.add_parser("render", help="a resource file -> plain manifests (YAML)",
                            description="Print the manifests that run each "
                                        "DisaggregatedServingCluster in FILE ('-': standard "
                                        "input), for kubectl apply -f -. Refuses, naming the "
                                        "field, what the schema or the checks refuse.")
    render.add_argument("file", metavar="FILE")
    render.add_argument("--model-config", default=None, metavar="PRESET|PATH",
                        help=MODEL_CONFIG_HELP)
    render.set_defaults(func=_render)
    crd = sub.add_parser("crd", help="print the CustomResourceDefinition (YAML)")
    crd.set_defaults(func=_crd)


def add_operator_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "operator", help="run the DisaggregatedServingCluster operator (kopf)",
        description="Watch DisaggregatedServingCluster resources and keep their children "
                    "(the manifests `pdserve k8s render` prints) and status in line; with "
                    "elastic pools, keep the pods' role labels and the role bounds in line "
                    "with the router. Uses the pod's ServiceAccount in a cluster, else the "
                    "current kubeconfig context.")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="watch this namespace (repeat for more; default: every namespace)")
    p.add_argument("--interval", type=float, default=10.0, metavar="SECONDS",
                   help="how often each resource is looked at again (default: %(default)s)")
    p.add_argument("--model-config", default=None, metavar="PRESET|PATH",
                   help=MODEL_CONFIG_HELP)
    p.set_defaults(func=_operator)


def _render(args: argparse.Namespace) -> int:
    from pdserve.k8s.documents import dump_documents, read_documents
    from pdserve.k8s.render import render

    manifests = []
    for i, doc in enumerate(read_documents(args.file)):
        try:
            manifests += render(doc, args.model_config)
        except ValueError as e:
            raise ValueError(f"{args.file}, document {i + 1}: {e}") from None
    sys.stdout.write(dump_documents(manifests))
    return 0


def _crd(args: argparse.Namespace) -> int:
    from pdserve.k8s.crd import crd_manifest
    from pdserve.k8s.documents import dump_documents

    sys.stdout.write(dump_documents([crd_manifest()]))
    return 0


def _operator(args: argparse.Namespace) -> int:
    settings = OperatorSettings(namespaces=tuple(args.namespace), interval_s=args.interval,
                                model_config=args.model_config)
    from pdserve.k8s.operator import run

    run(settings)
    return 0
