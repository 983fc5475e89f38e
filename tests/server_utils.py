"""Start and stop a real `musacache serve` subprocess, and worker bodies for spawned processes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

import musacache as mc
from helpers import prefix_kv
from musacache import ipc, transfer


def write_config(path: Path, spec: mc.KVSpec, namespace: str, chunk_size: int,
                 capacity: int) -> Path:
    path.write_text(f"""
namespace = "{namespace}"
chunk_size = {chunk_size}
[spec]
num_layers = {spec.num_layers}
num_kv_heads = {spec.num_kv_heads}
head_dim = {spec.head_dim}
dtype = "{str(spec.dtype).removeprefix('torch.')}"
mla = {str(spec.mla).lower()}
[[tiers]]
kind = "host"
capacity = {capacity}
""")
    return path


def write_tiers_config(path: Path, capacity: int, server: str = "") -> Path:
    """A server config with only its tiers (and an optional [server] table body)."""
    path.write_text(f"""
[[tiers]]
kind = "host"
capacity = {capacity}
[server]
{server}
""")
    return path


class ServerProcess:
    """``musacache serve`` in a subprocess. ``log``: a file for its stderr (else a pipe read
    only if it fails to start); ``nofile``: its RLIMIT_NOFILE soft limit."""

    def __init__(self, sock: str, config: Path, *, log: Path | None = None,
                 log_level: str = "WARNING", nofile: int | None = None) -> None:
        self.sock = sock
        self.config = config
        self.log = log
        self.log_level = log_level
        self.nofile = nofile
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> ServerProcess:
        env = dict(os.environ)
        src = str(Path(mc.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        nofile = self.nofile

        def limit_fds() -> None:
            if nofile is not None:
                import resource

                _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

        err_to = open(self.log, "wb") if self.log is not None else subprocess.PIPE
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "musacache", "serve", "--socket", self.sock,
             "--config", str(self.config), "--log-level", self.log_level],
            env=env, stdout=subprocess.DEVNULL, stderr=err_to, preexec_fn=limit_fds)
        if self.log is not None:
            err_to.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read().decode() if self.proc.stderr
                       else Path(self.log).read_text() if self.log else "")
                raise RuntimeError(f"musacache serve exited with {self.proc.returncode}: {err}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.sock)
                return self
            except OSError:
                time.sleep(0.05)
            finally:
                s.close()
        raise RuntimeError("musacache serve did not start listening in time")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self, field: str) -> int:
        """A number from /proc/<pid>/status (VmRSS, VmHWM in kB; Threads)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def pages_for(spec: mc.KVSpec, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    pages = [ipc.empty_shared(shape, spec.dtype) for _ in range(spec.num_layers)]
    for p in pages:
        p.fill_(-3)
    return pages


def spec_from(d: dict) -> mc.KVSpec:
    return mc.KVSpec.from_dict(d)


def worker_store(sock: str, spec_d: dict, ns: str, tokens: list[int], slots: list[int],
                 num_blocks: int, block_size: int) -> int:
    """A worker: computes KV into its own shared pages, registers them, stores the prompt."""
    spec = spec_from(spec_d)

    async def run() -> int:
        pages = pages_for(spec, num_blocks, block_size)
        transfer.scatter(prefix_kv(spec, tokens), pages, torch.tensor(slots), "vllm")
        async with mc.connect(sock, spec=spec, namespace=ns, timeout=30) as c:
            await c.register_kv_caches(pages, "vllm")
            ready = ipc.IpcEvent.create("cpu")

            async def produce() -> None:
                await asyncio.sleep(0.05)  # the server must wait for this, not read early
                ready.set()

            setter = asyncio.create_task(produce())
            n = await c.store(tokens, slots, ready=ready)
            await setter
            return n

    return asyncio.run(run())


def worker_retrieve(sock: str, spec_d: dict, ns: str, tokens: list[int], slots: list[int],
                    num_blocks: int, block_size: int) -> tuple[int, bool]:
    """A worker: retrieves a prompt into its own pages at its own slots, checks the bytes."""
    spec = spec_from(spec_d)

    async def run() -> tuple[int, bool]:
        pages = pages_for(spec, num_blocks, block_size)
        async with mc.connect(sock, spec=spec, namespace=ns, timeout=30) as c:
            await c.register_kv_caches(pages, "vllm")
            done = ipc.IpcEvent.create("cpu")
            n = await c.retrieve(tokens, slots, done=done)
            ok_done = await done.wait(timeout=5)
        out = torch.empty(spec.shape(n), dtype=spec.dtype)
        transfer.gather(pages, torch.tensor(slots[:n]), out, "vllm")
        return n, bool(ok_done) and torch.equal(out, prefix_kv(spec, tokens[:n]))

    return asyncio.run(run())


def worker_hang_in_store(sock: str, spec_d: dict, ns: str, tokens: list[int],
                         slots: list[int], num_blocks: int, block_size: int, started) -> None:
    """A worker that starts a store whose ready event it never sets (then gets SIGKILLed)."""
    spec = spec_from(spec_d)

    async def run() -> None:
        pages = pages_for(spec, num_blocks, block_size)
        async with mc.connect(sock, spec=spec, namespace=ns, timeout=300) as c:
            await c.register_kv_caches(pages, "vllm")
            never = ipc.IpcEvent.create("cpu")
            task = asyncio.create_task(c.store(tokens, slots, ready=never))
            await asyncio.sleep(0.3)
            started.set()
            await task

    asyncio.run(run())
