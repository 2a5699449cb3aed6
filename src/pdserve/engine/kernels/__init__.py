"""pdserve's fused CPU operators for the bf16 decoder, compiled once per environment.

On CPU most of a small model's step outside its matmuls is PyTorch dispatch: an RMSNorm is
several aten calls, rotary embedding five, decode attention a block gather, a padded copy and a
masked SDPA per layer. The C++ operators in `csrc/` do each in one pass (see `csrc/ops.h`),
and the linear layers run on pdserve's own kernels: AMX tiles where the CPU has them
(`amx_linear.cpp`), else AVX512-BF16's VDPBF16PS (`dpbf16_linear.cpp`), else fp32 FMAs over
bf16 weights on AVX2 (`avx2_linear.cpp`); so does prefill attention (`prefill_attention_amx.cpp`,
`prefill_attention.cpp`, `prefill_attention_fma.cpp`).
They are built with `-fopenmp`, so `at::parallel_for` uses ATen's thread pool (without it
the loops silently run on one thread); the library then shares torch's libgomp, already
loaded under the same soname.

Lifetime: `cpu_ops()` compiles the sources with the host compiler the first time a process of
this environment asks (about 100 s of compiler time, spread over the process's cores), into
`<cache root>/kernels/<key>`, the key naming everything the build depends on (`build_key.py`:
the sources, flags, CPU, torch installation, Python ABI and compiler), so environments never
share or rebuild each other's builds. The folder appears only finished, and workers started
together build once (`build_cache.py`); later processes import the library from it without
running the build tools. When no compiler is there or the build fails, it logs why once and
returns None, and the model runs on PyTorch operators alone. `python -m pdserve.engine.kernels`
builds ahead of first use (`make test` runs it beside its first tests).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import cache_root
from pdserve.engine.kernels.build_cache import build_once, is_built
from pdserve.engine.kernels.build_key import BuildFacts, source_digest, this_environment

log = logging.getLogger(__name__)

NAME = "pdserve_cpu_ops"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "norm.cpp", "activation.cpp", "rope.cpp", "kv_store.cpp",
           "decode_attention.cpp", "prefill_attention.cpp", "prefill_attention_fma.cpp",
           "prefill_attention_amx.cpp", "amx_linear.cpp", "dpbf16_linear.cpp",
           "avx2_linear.cpp", "argmax.cpp", "sample.cpp", "kernel_linear.cpp",
           "fused_layer.cpp", "moe_experts.cpp", "mla_decode.cpp", "moe_route.cpp",
           "router_logits.cpp")
HEADERS = ("ops.h", "vec.h", "linear_call.h", "thread_buffer.h", "paged_context.h",
           "prefill_tiles.h", "amx_tiles.h")
BUILD_CORE_SECONDS = 100  # compiler time of a build over its sources (110 s on 1 Zen 4 core, busy)


def supports(cfg: ModelConfig) -> bool:
    """Whether the operators cover the whole layer of this model (`fused_layer`): the Llama
    family with attention they cover. MoE, q/k-norm and MLA models take the operators for
    parts of their layers (their decoders say which)."""
    return cfg.mla is None and cfg.moe is None and not cfg.qk_norm and covers_attention(cfg)


def covers_attention(cfg: ModelConfig) -> bool:
    """Whether the operators' paged attention covers this model's heads: decode attention is
    compiled for head sizes 64 and 128 with up to 8 query heads per KV head
    (csrc/decode_attention.cpp, `pick`); MLA attends over latents and is not covered."""
    return (cfg.mla is None and cfg.head_dim in (64, 128)
            and cfg.num_heads // cfg.num_kv_heads <= 8)


def build_facts() -> BuildFacts:
    """What a build here depends on (the compiler's identity is asked once a process)."""
    files = [CSRC / name for name in (*SOURCES, *HEADERS)]
    return this_environment(source_digest(files), tuple(compile_flags()))


def build_dir() -> Path:
    """Cache folder of this source tree built in this environment on this CPU."""
    return cache_root() / "kernels" / build_facts().key()


def is_cached() -> bool:
    """Whether this environment's build is in the cache, so `cpu_ops()` only loads it."""
    return is_built(build_dir())


def build_estimate(cores: int) -> str:
    """About how long a build takes on `cores` cores (one source per core at a time), in
    words: "about 50 s on 2 cores"."""
    seconds = max(10, round(BUILD_CORE_SECONDS / max(1, min(cores, len(SOURCES)))))
    return f"about {seconds} s on {cores} core{'s' if cores != 1 else ''}"


def compile_flags() -> list[str]:
    """-march=native, and the ISA ATen's vector types (csrc/vec.h) should compile for."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2" or "DEFAULT"
    flags = ["-O3", "-march=native", "-fopenmp"]
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled operators, or None (logged once) where they cannot be built here."""
    folder = build_dir()
    try:
        built = build_once(folder, functools.partial(_compile, folder))
        return built if built is not None else _import(folder / f"{NAME}.so")
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, failed build
        log.warning("fused CPU operators unavailable, using PyTorch operators: %s", e)
        return None


def _compile(final: Path, tmp: Path) -> ModuleType:
    """Build into the empty folder `tmp` (renamed to `final` afterwards) and import it."""
    from torch.utils.cpp_extension import load

    log.warning("compiling pdserve's fused CPU operators into %s (once for this environment, "
                "%s)", final, build_estimate(len(os.sched_getaffinity(0))))
    (tmp / "build-key.json").write_text(build_facts().describe())
    module = load(name=NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=compile_flags(),
                  extra_ldflags=["-fopenmp"], build_directory=str(tmp), verbose=False)
    module.__file__ = str(final / f"{NAME}.so")  # where it lives once the build is published
    return module


def _import(library: Path) -> ModuleType:
    """Import a finished build's extension module."""
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
