"""A throw-away one-node OpenStack Swift with the s3api middleware, for tests and benchmarks.

Debian packages Swift (``.ci/swift-install.sh``); no server starts by itself. :class:`SwiftServer`
writes every config, ring and data file under one folder, starts the account, container,
object and proxy servers on free ports of 127.0.0.1, waits until an S3 ``CreateBucket``
succeeds, and stops the four processes by their pids. S3 credentials: ``test:tester`` /
``testing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path
from types import TracebackType

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SWIFT_BINARIES", "SwiftServer", "missing_binaries"]

ACCESS_KEY = "test:tester"
SECRET_KEY = "testing"
SWIFT_BINARIES = ("swift-account-server", "swift-container-server", "swift-object-server",
                  "swift-proxy-server")
_SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-swift lives there, not in a venv

# The rings are built with Swift's Python API in one process: the swift-ring-builder CLI costs
# about 1.6 s per call here, nine calls in all.
_RING_SCRIPT = textwrap.dedent("""
    import sys
    from swift.common.ring import RingBuilder
    etc = sys.argv[1]
    for kind, port in zip(("account", "container", "object"), sys.argv[2:5]):
        builder = RingBuilder(8, 1, 1)
        builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": "127.0.0.1",
                         "port": int(port), "device": "sdb1", "weight": 1})
        builder.rebalance()
        builder.save(f"{etc}/{kind}.builder")
        builder.get_ring().save(f"{etc}/{kind}.ring.gz")
""")


# Each server is started through this shim: it asks the kernel to SIGTERM it when its parent
# (the test run or benchmark) dies, then execs the server. A crashed or killed pytest thus
# never leaves four Swift servers behind. PR_SET_PDEATHSIG is 1 (Linux).
_EXEC_WITH_PARENT = textwrap.dedent("""
    import ctypes, os, signal, sys
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    if os.getppid() == 1:
        sys.exit("swift: the parent exited before the server started")
    os.execvp(sys.argv[1], sys.argv[1:])
""")


def missing_binaries() -> list[str]:
    """The Swift programs that are not installed (empty when Swift can run here)."""
    missing = [b for b in SWIFT_BINARIES if shutil.which(b) is None]
    if not os.path.exists(_SYSTEM_PYTHON):
        missing.append(_SYSTEM_PYTHON)
    return missing


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SwiftServer:
    """``with SwiftServer() as swift: swift.endpoint_url`` (or ``start()``/``stop()``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="swift-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.port = 0
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _write_configs(self, ports: dict[str, int]) -> None:
        etc, srv, run = self.root / "etc", self.root / "srv", self.root / "run"
        for d in (etc, srv / "sdb1", run):
            d.mkdir(parents=True, exist_ok=True)
        user = getpass.getuser()
        (etc / "swift.conf").write_text(textwrap.dedent("""
            [swift-hash]
            swift_hash_path_suffix = musacache-test
            swift_hash_path_prefix = musacache-test

            [storage-policy:0]
            name = Policy-0
            default = yes
        """))
        # workers = 0: each server is one process with no forked workers, so the four pids we
        # start are all there is to stop (with workers >= 1 the orphaned workers linger).
        common = textwrap.dedent(f"""
            bind_ip = 127.0.0.1
            workers = 0
            devices = {srv}
            mount_check = false
            swift_dir = {etc}
            user = {user}
            log_level = WARNING
        """)
        for kind in ("account", "container", "object"):
            (etc / f"{kind}-server.conf").write_text(
                f"[DEFAULT]\nbind_port = {ports[kind]}\n{common}\n"
                f"[pipeline:main]\npipeline = {kind}-server\n\n"
                f"[app:{kind}-server]\nuse = egg:swift#{kind}\n")
        pipeline = ("catch_errors gatekeeper healthcheck proxy-logging cache listing_formats "
                    "s3api tempauth copy slo dlo proxy-logging proxy-server")
        filters = {"catch_errors": "catch_errors", "gatekeeper": "gatekeeper",
                   "healthcheck": "healthcheck", "proxy-logging": "proxy_logging",
                   "listing_formats": "listing_formats", "copy": "copy", "slo": "slo",
                   "dlo": "dlo"}
        lines = [f"[DEFAULT]\nbind_ip = 127.0.0.1\nbind_port = {ports['proxy']}\nworkers = 0\n"
                 f"swift_dir = {etc}\nuser = {user}\nlog_level = WARNING\n",
                 f"[pipeline:main]\npipeline = {pipeline}\n",
                 "[app:proxy-server]\nuse = egg:swift#proxy\naccount_autocreate = true\n",
                 # Points at a port nothing listens on: Swift works without memcached.
                 f"[filter:cache]\nuse = egg:swift#memcache\n"
                 f"memcache_servers = 127.0.0.1:{ports['memcache']}\n",
                 "[filter:s3api]\nuse = egg:swift#s3api\nlocation = us-east-1\n",
                 "[filter:tempauth]\nuse = egg:swift#tempauth\n"
                 "user_test_tester = testing .admin\n"]
        lines += [f"[filter:{name}]\nuse = egg:swift#{egg}\n" for name, egg in filters.items()]
        (etc / "proxy-server.conf").write_text("\n".join(lines))

    def start(self, timeout: float = 30.0) -> SwiftServer:
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"OpenStack Swift is not installed (missing {missing}); run "
                               ".ci/swift-install.sh")
        names = ("account", "container", "object", "proxy", "memcache")
        ports = dict(zip(names, _free_ports(len(names))))
        self.port = ports["proxy"]
        self._write_configs(ports)
        etc = self.root / "etc"
        subprocess.run([_SYSTEM_PYTHON, "-c", _RING_SCRIPT, str(etc), str(ports["account"]),
                        str(ports["container"]), str(ports["object"])],
                       check=True, capture_output=True, timeout=60)
        log = open(self.root / "run" / "servers.log", "ab")
        try:
            for kind in ("account", "container", "object", "proxy"):
                # A new session per server, so that stop() can end its worker children too.
                self.procs.append(subprocess.Popen(
                    [_SYSTEM_PYTHON, "-c", _EXEC_WITH_PARENT, f"swift-{kind}-server",
                     str(etc / f"{kind}-server.conf")],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        finally:
            log.close()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            dead = [str(p.args) for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Swift server(s) {dead} exited at start; see "
                                   f"{self.root / 'run' / 'servers.log'}: {self.log_tail()}")
            try:
                asyncio.run(self._probe())
                return
            except Exception as e:
                last = e
                time.sleep(0.2)
        raise RuntimeError(f"Swift did not become ready within {timeout} s (last error: "
                           f"{last!r}); {self.log_tail()}")

    async def _probe(self) -> None:
        """Ready means: an S3 bucket PUT through aiobotocore succeeds."""
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        config = AioConfig(connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1},
                           s3={"addressing_style": "path"})
        async with get_session().create_client(
                "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
                config=config) as client:
            try:
                await client.create_bucket(Bucket="musacache-ready")
            except Exception as e:
                if "BucketAlreadyOwnedByYou" not in repr(e):
                    raise

    def log_tail(self, nbytes: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "run" / "servers.log").read_bytes()[-nbytes:].decode(
                "utf-8", "replace")
        return ""

    def stop(self) -> None:
        """SIGTERM each server we started, then SIGKILL its session if it lingers."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # the group we created for this server
                p.wait(timeout=5)
        self.procs.clear()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SwiftServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
