"""Developer sessions: ``nox -s tests``, ``nox -s lint``, ``nox -s typecheck``, ``nox -s demo``,
``nox -s lowest`` (the suite at the lowest torch that pyproject.toml declares).

torch is installed first and pinned to the CPU build that this project's machines carry on disk;
an unpinned torch in a fresh environment would download a multi-GB CUDA build. The package's
own torch requirement stays wide.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("MUSACACHE_TORCH", "torch==2.13.0")


def _install(session: nox.Session, extras: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (GPU tests are deselected; run them with `-m gpu` on a GPU machine)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session(venv_backend="none")
def lowest(session: nox.Session) -> None:
    """The torch-dependent tests at torch 2.7.1, the lowest torch declared: .ci/torch-lowest.sh
    (its own venv; PyPI has only the CUDA build of 2.7.1, about 2.8 GB the first time)."""
    session.run("bash", ".ci/torch-lowest.sh", *session.posargs, external=True)


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU tests under tests/gpu (needs a CUDA or MUSA device)."""
    _install(session, "test")
    session.run("pytest", "-m", "gpu", "tests/gpu", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "examples", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    _install(session, "test")
    session.install("mypy>=1.10")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """`musacache demo`: TTFT with and without the cache on a small random Llama."""
    _install(session, "demo")
    session.run("musacache", "demo", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """All benchmarks; each prints ratios measured in the same run."""
    _install(session, "test")
    for which in ("cache", "transfer", "codec", "ipc", "scale"):
        session.run("musacache", "bench", which)
