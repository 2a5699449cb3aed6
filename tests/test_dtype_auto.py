"""`--dtype auto`: bfloat16 where the device computes it or pdserve's AVX2 kernel runs it,
float32 on a CPU that would only emulate it."""

from __future__ import annotations

import pytest

from pdserve.common import cpu_features, engine_options
from pdserve.common.cpu_features import cpu_computes_bf16, cpu_flags, cpu_has_avx2_fma
from pdserve.common.engine_options import resolve_dtype
from pdserve.config import EngineConfig

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
ZEN4 = ZEN3.replace("f16c", "f16c avx512f avx512dq avx512bw avx512vl avx512_bf16")


@pytest.mark.parametrize("flags, native", [
    ("fpu sse2 avx avx2 fma", False),  # AVX2 only: emulated
    ("avx2 avx512f avx512bw avx512vl", False),  # no DQ: oneDNN's bf16 path needs all three
    ("avx2 avx512f avx512dq avx512bw avx512vl", True),
    ("avx2 avx_ne_convert", True),
    ("avx2 amx_bf16 amx_tile", True),
    ("fp asimd bf16", True),  # Arm "Features"
])
def test_native_bf16_from_flags(flags, native):
    assert cpu_computes_bf16(frozenset(flags.split())) is native


@pytest.mark.parametrize("flags, kernel", [
    ("fpu sse2 avx avx2 fma", True),
    ("fpu sse2 avx avx2", False),  # no FMA
    ("fpu sse2 avx fma", False),  # no AVX2
])
def test_the_avx2_kernel_from_flags(flags, kernel):
    assert cpu_has_avx2_fma(frozenset(flags.split())) is kernel


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """Write a /proc/cpuinfo of the given text for `cpu_flags` to read."""
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_features, "CPUINFO", info)

    def write(text: str) -> None:
        info.write_text(text)
        cpu_flags.cache_clear()

    yield write
    cpu_flags.cache_clear()


@pytest.mark.parametrize("text, native", [(ZEN3, False), (ZEN4, True)])
def test_flags_are_read_from_cpuinfo(cpuinfo, text, native):
    cpuinfo(text)
    assert ("avx2" in cpu_flags()) and cpu_computes_bf16() is native


@pytest.mark.parametrize("compiler", [True, False])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_an_avx2_cpu_gets_bfloat16_where_the_kernel_builds(cpuinfo, monkeypatch, compiler,
                                                           cpu_kernels):
    """AVX2 + FMA without bf16 arithmetic: bf16 on pdserve's kernel, which needs the compiled
    operators on and a compiler to build them; float32 otherwise (PyTorch emulates bf16)."""
    cpuinfo(ZEN3)
    monkeypatch.setattr(cpu_features, "compiler_present", lambda: compiler)
    expected = "bfloat16" if compiler and cpu_kernels else "float32"
    assert resolve_dtype("auto", "cpu", cpu_kernels) == expected
    assert EngineConfig(dtype="auto", cpu_kernels=cpu_kernels).dtype == expected
    cpuinfo(ZEN3.replace(" fma", ""))  # AVX2 without FMA: no kernel
    assert resolve_dtype("auto", "cpu", cpu_kernels) == "float32"


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_native_bf16_gets_bfloat16_with_or_without_the_operators(cpuinfo, monkeypatch,
                                                                 cpu_kernels):
    cpuinfo(ZEN4)
    monkeypatch.setattr(cpu_features, "compiler_present", lambda: False)
    assert resolve_dtype("auto", "cpu", cpu_kernels) == "bfloat16"
    assert EngineConfig(dtype="auto", cpu_kernels=cpu_kernels).dtype == "bfloat16"


def test_the_compiler_is_looked_up_as_torch_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not cpu_features.compiler_present()
    monkeypatch.setenv("CXX", "sh")  # any program on PATH
    assert cpu_features.compiler_present()


def test_unreadable_flags_keep_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "missing")
    cpu_flags.cache_clear()
    try:
        assert cpu_flags() is None and resolve_dtype("auto", "cpu") == "bfloat16"
    finally:
        cpu_flags.cache_clear()


def test_explicit_dtypes_and_gpus_are_kept(monkeypatch):
    monkeypatch.setattr(engine_options, "cpu_serves_bf16", lambda cpu_kernels=True: False)
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert EngineConfig(dtype="float16", device="cpu").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, "
                                         "got 'int8'"):
        EngineConfig(dtype="int8")
