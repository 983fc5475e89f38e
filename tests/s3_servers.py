"""S3 test servers as pytest fixtures: moto, a fault-injecting proxy, and a real Swift.

Wired into the suite by ``pytest_plugins = ["s3_servers"]`` in tests/conftest.py. With CI=true
a missing service fails the test that needs it; elsewhere it skips.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

FAKE_KEY = "musacache-test-key"
FAKE_SECRET = "musacache-test-secret"


def need(available: bool, what: str) -> None:
    """Skip locally, fail in CI, when a service a test needs is missing."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI (CI=true) but is not available")
    pytest.skip(f"{what} is not available")


def unique_bucket() -> str:
    return f"mc-{uuid.uuid4().hex[:16]}"


@pytest.fixture(scope="session")
def aws_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the user's AWS config and credentials out of every test: fake keys only."""
    missing = tmp_path_factory.mktemp("aws") / "does-not-exist"
    values = {"AWS_CONFIG_FILE": str(missing), "AWS_SHARED_CREDENTIALS_FILE": str(missing),
              "AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
              "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    dropped = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
               "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_CA_BUNDLE")
    saved = {k: os.environ.get(k) for k in (*values, *dropped)}
    os.environ.update(values)
    for k in dropped:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- moto ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_endpoint(aws_env: None) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a ThreadedMotoServer shared by the session (buckets are
    per test: use :func:`unique_bucket`)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        need(False, "moto[server]")
        raise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


# -- fault proxy ---------------------------------------------------------------------------------

_REQUEST_START = re.compile(rb"^(GET|PUT|POST|HEAD|DELETE) /")
_SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                   b"<Message>Please reduce your request rate.</Message>"
                   b"<RequestId>musacache-fault-proxy</RequestId></Error>")
_SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
              b"Content-Length: " + str(len(_SLOW_DOWN_BODY)).encode() +
              b"\r\nConnection: close\r\n\r\n" + _SLOW_DOWN_BODY)


class FaultProxy:
    """A TCP proxy in front of an S3 server that injects faults per HTTP request.

    * ``throttle = n``: answer the next ``n`` requests with ``503 SlowDown`` (and close);
    * ``delay = s``: hold each request ``s`` seconds before forwarding it;
    * ``hang()`` / ``release()``: hold every request until released, so a timeout is certain
      however fast or slow the machine is (a test must never race a timeout against real work);
    * ``stop()`` / ``start()``: the endpoint goes down (new connections are refused, open ones
      reset) and comes back on the same port.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.port = 0
        self.throttle = 0
        self.delay = 0.0
        self.requests = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._flowing = threading.Event()
        self._flowing.set()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        # SO_REUSEADDR (set by create_server) lets a restart take the same port back.
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def hang(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def stop(self) -> None:
        self.release()  # held requests end with their sockets
        listener, self._listener = self._listener, None
        if listener is not None:
            self._close(listener)  # shutdown first: close alone does not wake accept()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            self._close(s)

    @staticmethod
    def _close(s: socket.socket) -> None:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
            upstream.settimeout(None)
        except OSError:
            self._close(client)
            return
        with self._lock:
            self._socks.update((client, upstream))
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if requests and _REQUEST_START.match(data):
                    with self._lock:
                        self.requests += 1
                        throttled = self.throttle > 0
                        if throttled:
                            self.throttle -= 1
                    if throttled:
                        src.sendall(_SLOW_DOWN)
                        break
                    if self.delay:
                        time.sleep(self.delay)
                    self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._close(s)
            with self._lock:
                self._socks.discard(src)
                self._socks.discard(dst)


@pytest.fixture
def fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


# -- Swift ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def swift_server(aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A one-node Swift with s3api (see musacache._testing.swift), started once per session.

    Yields the :class:`SwiftServer` (``endpoint_url``, ``access_key``, ``secret_key``).
    """
    from musacache._testing.swift import SwiftServer, missing_binaries

    missing = missing_binaries()
    if missing:
        need(False, f"OpenStack Swift (missing {', '.join(missing)}; run .ci/swift-install.sh)")
    server = SwiftServer(tmp_path_factory.mktemp("swift"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
