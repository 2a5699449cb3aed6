"""The CPU operators' build cache: one folder per environment, published whole, built once.

The build step is faked (a few bytes for a library) wherever the behaviour is about the cache,
so no test here runs the compiler.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from pdserve.engine import kernels
from pdserve.engine.kernels.build_cache import build_once, is_built
from pdserve.engine.kernels.build_key import BuildFacts

KERNELS_DIR = Path(kernels.__file__).parent
FACTS = BuildFacts(
    sources="0" * 64, cflags=("-O3", "-march=native"), cpu_flags="flags : avx512f",
    torch_dir="/envs/a/lib/python3.11/site-packages/torch", torch_version="2.13.0+cpu",
    torch_git_version="cf30153c", cxx11_abi=True, python_tag="cpython-311",
    soabi="cpython-311-x86_64-linux-gnu", compiler="/usr/bin/c++",
    compiler_version="c++ (Debian 12.2.0-14) 12.2.0")
OTHER_VALUES = {
    "sources": "1" * 64, "cflags": ("-O2", "-march=native"), "cpu_flags": "flags : avx2",
    "torch_dir": "/envs/b/lib/python3.11/site-packages/torch", "torch_version": "2.13.0",
    "torch_git_version": "0123abcd", "cxx11_abi": False, "python_tag": "cpython-312",
    "soabi": "cpython-312-x86_64-linux-gnu", "compiler": "/usr/local/bin/c++",
    "compiler_version": "c++ (GCC) 13.1.0"}


def test_every_fact_of_a_build_names_its_own_folder() -> None:
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(BuildFacts)}
    assert FACTS.key() == dataclasses.replace(FACTS).key()
    assert len(FACTS.key()) == 16 and int(FACTS.key(), 16) >= 0
    keys = {dataclasses.replace(FACTS, **{name: value}).key()
            for name, value in OTHER_VALUES.items()}
    assert len(keys) == len(OTHER_VALUES) and FACTS.key() not in keys


def _python(code: str, *, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_two_torch_installations_get_two_build_folders(tmp_path: Path) -> None:
    """A second environment is simulated by torch imported through another folder (a link to
    this one's): its build files would name that folder, so it must not share the build."""
    site = tmp_path / "other-env"
    site.mkdir()
    (site / "torch").symlink_to(Path(torch.__file__).parent)
    code = """
        import torch
        from pdserve.engine import kernels
        print(torch.__file__)
        print(kernels.build_dir())
    """
    env = {"PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    here = _python(code, env=env).split()
    there = _python(code, env={**env, "PYTHONPATH": str(site)}).split()
    assert there[0] == str(site / "torch" / "__init__.py") and here[0] == torch.__file__
    assert Path(here[1]).parent == Path(there[1]).parent == tmp_path / "cache" / "kernels"
    assert here[1] != there[1]


# A process that runs build_cache.build_once with a fake build: it logs its pid, waits
# `hold` seconds half-way (a library half written), then writes the rest.
BUILDER = """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, {kernels_dir!r})
    from build_cache import build_once

    final, log, go = map(Path, sys.argv[1:4])
    hold = float(sys.argv[4])

    def compile_into(tmp):
        with open(log, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        (tmp / "lib.so").write_bytes(b"half")
        print("compiling", flush=True)
        time.sleep(hold)
        (tmp / "lib.so").write_bytes(b"whole library")
        return "built"

    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    print(build_once(final, compile_into), (final / "lib.so").read_bytes().decode(), flush=True)
"""


def _builder(tmp_path: Path, hold: float) -> subprocess.Popen:
    code = textwrap.dedent(BUILDER.format(kernels_dir=str(KERNELS_DIR)))
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "kernels" / "key"),
                          str(tmp_path / "compiles.log"), str(tmp_path / "go"), str(hold)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def test_builds_started_together_build_once(tmp_path: Path) -> None:
    first, second = _builder(tmp_path, hold=1.0), _builder(tmp_path, hold=1.0)
    (tmp_path / "go").touch()
    outputs = sorted(p.communicate(timeout=60)[0] for p in (first, second))
    assert [p.returncode for p in (first, second)] == [0, 0]
    assert len((tmp_path / "compiles.log").read_text().split()) == 1
    assert outputs == ["None whole library\n", "compiling\nbuilt whole library\n"]
    assert sorted(os.listdir(tmp_path / "kernels")) == ["key", "key.lock"]


def test_an_interrupted_build_is_never_loaded_and_is_cleaned_up(tmp_path: Path) -> None:
    final = tmp_path / "kernels" / "key"
    killed = _builder(tmp_path, hold=60.0)
    (tmp_path / "go").touch()
    assert killed.stdout is not None and killed.stdout.readline() == "compiling\n"
    killed.kill()
    killed.wait(timeout=10)
    partial = tmp_path / "kernels" / f".key.partial-{killed.pid}"
    assert (partial / "lib.so").read_bytes() == b"half"
    assert not is_built(final) and not final.exists()

    def compile_into(tmp: Path) -> str:
        assert not any(tmp.iterdir()), "a build starts from an empty folder"
        (tmp / "lib.so").write_bytes(b"whole library")
        return "built"

    assert build_once(final, compile_into) == "built"
    assert (final / "lib.so").read_bytes() == b"whole library"
    assert not partial.exists()
    assert sorted(os.listdir(final.parent)) == ["key", "key.lock"]


def test_a_failed_build_leaves_no_folder_and_is_tried_again(tmp_path: Path) -> None:
    final = tmp_path / "key"

    def broken(tmp: Path) -> str:
        (tmp / "lib.so").write_bytes(b"half")
        raise RuntimeError("c++: internal compiler error")

    def working(tmp: Path) -> str:
        (tmp / "lib.so").write_bytes(b"whole library")
        return "built"

    with pytest.raises(RuntimeError, match="internal compiler error"):
        build_once(final, broken)
    assert os.listdir(tmp_path) == ["key.lock"]
    assert build_once(final, working) == "built"
    assert build_once(final, broken) is None  # built: nothing runs again
    assert (final / "lib.so").read_bytes() == b"whole library"


def test_cpu_ops_builds_in_a_fresh_folder_past_a_killed_builds_leftovers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `cpu_ops` itself, with torch's compile-and-import step faked."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    folder = kernels.build_dir()
    leftover = folder.parent / f".{folder.name}.partial-99999"
    leftover.mkdir(parents=True)
    (leftover / "pdserve_cpu_ops.so").write_bytes(b"\x7fELF half")
    assert not kernels.is_cached()
    seen: list[set[str]] = []

    def fake_load(name: str, sources: list[str], build_directory: str, **kwargs) -> object:
        seen.append(set(os.listdir(build_directory)))
        (Path(build_directory) / "pdserve_cpu_ops.so").write_bytes(b"\x7fELF whole")
        return types.ModuleType(name)

    monkeypatch.setattr(ext, "load", fake_load)
    module = kernels.cpu_ops.__wrapped__()
    assert isinstance(module, types.ModuleType)
    assert module.__file__ == str(folder / "pdserve_cpu_ops.so")
    assert seen == [{"build-key.json"}]
    assert kernels.is_cached() and not leftover.exists()
    assert (folder / "pdserve_cpu_ops.so").read_bytes() == b"\x7fELF whole"
    assert f'"torch_dir": "{Path(torch.__file__).parent}"' in \
        (folder / "build-key.json").read_text()


def test_the_build_estimate_is_spread_over_the_cores() -> None:
    assert kernels.build_estimate(1) == "about 100 s on 1 core"
    assert kernels.build_estimate(2) == "about 50 s on 2 cores"
    assert kernels.build_estimate(64) == "about 10 s on 64 cores"
