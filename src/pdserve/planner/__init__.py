"""Planner: KV bytes, transfer time, prefill/decode rooflines and a disaggregation verdict.

`pdserve plan` (cli.add_plan_parser) is the command-line face; `make_plan` the library one.
The sub-package `simulate` is `pdserve simulate`, priced by the same cost model; this
package never imports it.
"""

from pdserve.planner.cost import DEFAULT_MBU, DEFAULT_MFU, Efficiency, PhaseTime
from pdserve.planner.hardware import HARDWARE, Hardware, get_hardware
from pdserve.planner.kv_math import (
    DTYPE_BYTES,
    kv_bytes,
    kv_bytes_per_token,
    kv_bytes_per_token_per_rank,
    transfer_seconds,
)
from pdserve.planner.model_shape import (
    PRESETS,
    AttentionKind,
    ModelShape,
    MoEShape,
    load_model_shape,
    shape_from_config,
)
from pdserve.planner.plan import Plan, Verdict, Workload, make_plan, plan_to_dict, render_text

__all__ = [
    "DEFAULT_MBU",
    "DEFAULT_MFU",
    "DTYPE_BYTES",
    "HARDWARE",
    "PRESETS",
    "AttentionKind",
    "Efficiency",
    "Hardware",
    "MoEShape",
    "ModelShape",
    "PhaseTime",
    "Plan",
    "Verdict",
    "Workload",
    "get_hardware",
    "kv_bytes",
    "kv_bytes_per_token",
    "kv_bytes_per_token_per_rank",
    "load_model_shape",
    "make_plan",
    "plan_to_dict",
    "render_text",
    "shape_from_config",
    "transfer_seconds",
]
