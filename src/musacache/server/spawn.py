"""Start a ``musacache serve`` process and wait until it listens.

Public as :func:`musacache.server.spawn`. The serving-engine connectors use it to start the
node server themselves when none listens yet; tests, benchmarks and examples use it instead of
each carrying their own copy of the start-and-poll loop.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from musacache._errors import CacheUnavailableError, ConfigError

__all__ = ["SpawnedServer", "is_listening", "spawn"]


def is_listening(socket_path: str) -> bool:
    """Whether a server accepts connections on ``socket_path`` right now."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(socket_path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class SpawnedServer:
    """A ``musacache serve`` child process (``proc`` is ``None`` when another process had
    already started the server: then there is nothing of ours to stop)."""

    def __init__(self, socket_path: str, proc: subprocess.Popen[bytes] | None) -> None:
        self.socket_path = socket_path
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the server drains its writes and closes its tiers), SIGKILL after
        ``timeout`` seconds."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> SpawnedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn(config: str | os.PathLike[str], socket_path: str, *, timeout: float = 60.0,
          log_level: str = "WARNING", detach: bool = False,
          env: Mapping[str, str] | None = None, log: str | os.PathLike[str] | None = None,
          nofile: int | None = None, args: Sequence[str] = ()) -> SpawnedServer:
    """Run ``python -m musacache serve --socket SOCKET --config CONFIG`` and return once it
    accepts connections.

    If a server already listens on ``socket_path``, nothing is started (the result's ``proc``
    is ``None``). Concurrent callers (a vLLM scheduler and its workers start together) are
    serialised by a lock file beside the socket, so exactly one server is started.
    ``detach=True`` puts the server in its own session so it outlives the caller (a cache
    shared by engine processes that come and go). The server's log goes to ``log`` (default:
    ``SOCKET.log``); ``nofile`` caps its open files (RLIMIT_NOFILE); ``args`` are more
    options of ``musacache serve`` (``["--metrics", "127.0.0.1:9464"]``). Raises
    :class:`ConfigError` if the config
    file is missing and :class:`CacheUnavailableError` if the server exits or does not listen
    within ``timeout`` seconds (its stderr is in the message).
    """
    sock = str(socket_path)
    cfg = Path(config)
    if not cfg.is_file():
        raise ConfigError(f"musacache server config {cfg} does not exist")
    if is_listening(sock):
        return SpawnedServer(sock, None)
    run_dir = Path(sock).parent
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(str(sock) + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_listening(sock):  # another process won the race while we waited
                return SpawnedServer(sock, None)
            return _start(cfg, sock, timeout, log_level, detach, env,
                          Path(log) if log is not None else Path(sock + ".log"), nofile,
                          tuple(args))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _start(cfg: Path, sock: str, timeout: float, log_level: str, detach: bool,
           env: Mapping[str, str] | None, log_path: Path, nofile: int | None,
           args: tuple[str, ...] = ()) -> SpawnedServer:
    child_env = dict(os.environ if env is None else env)
    # The child must import this very musacache (a source checkout need not be installed).
    src = str(Path(__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = src + os.pathsep + child_env.get("PYTHONPATH", "")
    # The server's log goes to a file beside the socket, not a pipe: nobody would drain a
    # pipe once we return, and a server blocked on a full pipe would hang its clients.
    def limit_fds() -> None:
        if nofile is not None:
            import resource

            # Both limits: the server raises its soft limit to the hard one at start.
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            cap = nofile if hard == resource.RLIM_INFINITY else min(nofile, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (cap, cap))

    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "musacache", "serve", "--socket", sock, "--config",
             str(cfg), "--log-level", log_level, *args],
            env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            start_new_session=detach, preexec_fn=limit_fds if nofile is not None else None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CacheUnavailableError(
                f"musacache serve exited with status {proc.returncode} before listening on "
                f"{sock}: {_tail(log_path)}")
        if is_listening(sock):
            return SpawnedServer(sock, proc)
        time.sleep(0.05)
    proc.kill()
    proc.wait(10)
    raise CacheUnavailableError(f"musacache serve did not listen on {sock} within {timeout} s: "
                                f"{_tail(log_path)}")


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace").strip() or "(no output)"
    except OSError as e:
        return f"(cannot read {path}: {e})"
