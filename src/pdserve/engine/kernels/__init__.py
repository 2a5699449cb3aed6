"""pdserve's fused CPU operators for the bf16 decoder, compiled once per machine.

On CPU most of a small model's step outside its matmuls is PyTorch dispatch: an RMSNorm is
several aten calls, rotary embedding five, decode attention a block gather, a padded copy and a
masked SDPA per layer. The C++ operators in `csrc/` do each in one pass (see `csrc/ops.h`),
and the linear layers run on pdserve's own kernels: AMX tiles where the CPU has them
(`amx_linear.cpp`), else AVX512-BF16's VDPBF16PS (`dpbf16_linear.cpp`).
They are built with `-fopenmp`, so `at::parallel_for` uses ATen's thread pool (without it
the loops silently run on one thread); the library then shares torch's libgomp, already
loaded under the same soname.

Lifetime: `cpu_ops()` compiles the sources with the host compiler the first time a process
asks (about 40 s on 2 cores), into a cache folder named by a hash of the sources, the
torch version and the CPU's flags, then loads the library; later processes and later calls
load it straight away. Compilation is serialised by torch's lock file in that folder, so
workers started together compile once. When no compiler is there or the build fails, it
logs why once and returns None, and the model runs on PyTorch operators alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.hub import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "norm.cpp", "activation.cpp", "rope.cpp", "kv_store.cpp",
           "decode_attention.cpp", "amx_linear.cpp", "dpbf16_linear.cpp", "argmax.cpp",
           "decode_layer.cpp")
HEADERS = ("ops.h", "vec.h", "linear_call.h")


def supports(cfg: ModelConfig) -> bool:
    """Whether the operators cover this model: decode attention is compiled for head sizes 64
    and 128 with up to 8 query heads per KV head (csrc/decode_attention.cpp, `pick`)."""
    return cfg.head_dim in (64, 128) and cfg.num_heads // cfg.num_kv_heads <= 8


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Cache folder of this source tree built for this torch on this CPU (-march=native)."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update((CSRC / name).read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    h.update(" ".join(_cflags()).encode())
    return cache_root() / "kernels" / h.hexdigest()[:16]


def _cflags() -> list[str]:
    """-march=native, and the ISA ATen's vector types (csrc/vec.h) should compile for."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2" or "DEFAULT"
    flags = ["-O3", "-march=native", "-fopenmp"]
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return flags


@functools.cache
def cpu_ops() -> ModuleType | None:
    """The compiled operators, or None (logged once) where they cannot be built here."""
    from torch.utils.cpp_extension import load

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):
        log.warning("compiling pdserve's fused CPU operators into %s (once per machine, "
                    "about 40 s on 2 cores)", folder)
    try:
        return load(name="pdserve_cpu_ops", sources=[str(CSRC / s) for s in SOURCES],
                    extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], build_directory=str(folder),
                    verbose=False)
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, failed build
        log.warning("fused CPU operators unavailable, using PyTorch operators: %s", e)
        return None
