"""cffi build script (API mode) for ``musacache._native_lib``.

Used by setup.py through ``cffi_modules=["src/native/build.py:ffibuilder"]``, so
``pip install -e .`` and ``pip install .`` compile it. For a quick in-place build during
development run ``python src/native/build.py``.

The package version is read from ``src/musacache/_version.py`` as text (importing the package
would need its dependencies at build time) and compiled in as ``MC_VERSION``; the loader
compares it with ``musacache._version.__version__`` at import to catch a stale build.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import cffi

NATIVE_DIR = Path(__file__).resolve().parent
SRC_DIR = NATIVE_DIR.parent
HEADER = NATIVE_DIR / "musacache_native.h"
SOURCE = NATIVE_DIR / "musacache_native.c"
VERSION_FILE = SRC_DIR / "musacache" / "_version.py"


def read_version(path: Path = VERSION_FILE) -> str:
    """The ``__version__ = "..."`` string of the version file."""
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", path.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"no __version__ = '...' line in {path}")
    return match.group(1)


def cdef_from_header(text: str) -> str:
    """The header without preprocessor lines and the C++ guard braces, which cdef rejects."""
    kept = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or stripped in ('extern "C" {', "}"):
            continue
        kept.append(line)
    return "\n".join(kept)


def _relative(path: Path) -> str:
    # setuptools wants source paths relative to the project root it runs in (pip runs this
    # script there); an absolute path is kept when the file is not under the current folder.
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _compile_args() -> list[str]:
    if sys.platform == "win32":
        return ["/O2"]
    # No -m flags: SIMD kernels carry target attributes and are chosen at run time, so the
    # module runs on any x86-64 and compiles unchanged on aarch64.
    return ["-O3", "-std=c11", "-pthread", "-fvisibility=hidden"]


def make_builder(*, absolute_paths: bool = False) -> cffi.FFI:
    """The FFI builder; ``absolute_paths`` for ``FFI.compile``, which changes directory."""
    where = str if absolute_paths else _relative
    builder = cffi.FFI()
    builder.cdef(cdef_from_header(HEADER.read_text()))
    builder.set_source(
        "musacache._native_lib",
        '#include "musacache_native.h"',
        sources=[where(SOURCE)],
        include_dirs=[where(NATIVE_DIR)],
        define_macros=[("MC_VERSION", f'"{read_version()}"')],
        extra_compile_args=_compile_args(),
        extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
        depends=[where(HEADER)],
    )
    return builder


ffibuilder = make_builder()


if __name__ == "__main__":
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        built = Path(make_builder(absolute_paths=True).compile(tmpdir=scratch, verbose=True))
        # pip names the module *.abi3.so, and a *.cpython-3XY-*.so beside it would win the
        # import and shadow every later `pip install -e .`, so take pip's name.
        name = "_native_lib.abi3.so" if sys.platform.startswith("linux") else built.name
        target = SRC_DIR / "musacache" / name
        # Copy beside the target, then rename: processes that have the old module mapped
        # keep their inode instead of seeing it rewritten under them.
        staged = target.with_suffix(".tmp")
        shutil.copyfile(built, staged)
        staged.replace(target)
        print(f"built {target}")
