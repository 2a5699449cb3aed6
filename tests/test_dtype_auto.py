"""`--dtype auto`: bfloat16 where the device computes it, float32 on a CPU that only emulates it."""

from __future__ import annotations

import pytest

from pdserve.common import cpu_features, engine_options
from pdserve.common.cpu_features import cpu_computes_bf16, cpu_flags
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


@pytest.mark.parametrize("text, native", [(ZEN3, False), (ZEN4, True)])
def test_flags_are_read_from_cpuinfo(tmp_path, monkeypatch, text, native):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    monkeypatch.setattr(cpu_features, "CPUINFO", info)
    cpu_flags.cache_clear()
    try:
        assert ("avx2" in cpu_flags()) and cpu_computes_bf16() is native
        assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
        assert EngineConfig(dtype="auto").dtype == ("bfloat16" if native else "float32")
    finally:
        cpu_flags.cache_clear()


def test_unreadable_flags_keep_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "missing")
    cpu_flags.cache_clear()
    try:
        assert cpu_flags() is None and resolve_dtype("auto", "cpu") == "bfloat16"
    finally:
        cpu_flags.cache_clear()


def test_explicit_dtypes_and_gpus_are_kept(monkeypatch):
    monkeypatch.setattr(engine_options, "cpu_computes_bf16", lambda: False)
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert EngineConfig(dtype="float16", device="cpu").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, "
                                         "got 'int8'"):
        EngineConfig(dtype="int8")
