"""The name of a build of the CPU operators: everything that changes what the compiler makes.

Two Python environments on one machine share the kernels cache. Torch's build files name the
include and library folders of the torch that compiles them, so a folder that one environment
built must never be picked up, or rebuilt in place, by another: the key holds the torch
installation (its folder as imported, not resolved, since that is the path the build files
name, and its build identity), the Python ABI, the compiler (path and `--version`), the CPU,
the compiler flags and the sources. A build folder is immutable once it has its name.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

KEY_LENGTH = 16  # hex digits of the sha256 that name a build folder


@dataclass(frozen=True)
class BuildFacts:
    """What a build of the operators depends on; `key()` names its cache folder."""

    sources: str  # sha256 of the sources and headers, in build order
    cflags: tuple[str, ...]
    cpu_flags: str  # -march=native compiles for this CPU
    torch_dir: str  # the imported torch's folder, as its build files name it
    torch_version: str
    torch_git_version: str
    cxx11_abi: bool
    python_tag: str  # sys.implementation.cache_tag
    soabi: str
    compiler: str  # resolved path of torch's compiler ($CXX or c++), or its name if not found
    compiler_version: str  # first line of `compiler --version`; "" if it does not run

    def key(self) -> str:
        """KEY_LENGTH hex digits; equal facts give equal keys in every process."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:KEY_LENGTH]

    def describe(self) -> str:
        """The facts as indented JSON, written beside a build for whoever looks at the cache."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)


def source_digest(files: list[Path]) -> str:
    """sha256 over the files' bytes, in the order given."""
    h = hashlib.sha256()
    for file in files:
        h.update(file.read_bytes())
    return h.hexdigest()


def this_environment(sources: str, cflags: tuple[str, ...]) -> BuildFacts:
    """The facts of this interpreter, its torch and its compiler, for the given sources and
    flags."""
    compiler, version = compiler_identity(os.environ.get("CXX", "c++"))
    return BuildFacts(
        sources=sources, cflags=cflags, cpu_flags=cpu_flags(),
        torch_dir=os.path.dirname(os.path.abspath(torch.__file__)),
        torch_version=torch.__version__, torch_git_version=torch.version.git_version,
        cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        python_tag=sys.implementation.cache_tag or "",
        soabi=sysconfig.get_config_var("SOABI") or "",
        compiler=compiler, compiler_version=version)


@functools.cache
def compiler_identity(name: str) -> tuple[str, str]:
    """(resolved path, first line of --version) of the compiler `name`; run once a process."""
    path = shutil.which(name)
    if path is None:
        return name, ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return path, ""
    return path, (out.splitlines() or [""])[0]


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
