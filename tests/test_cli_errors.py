"""Bad command lines get one clear line and a non-zero exit, never a traceback (issue 10,
item 15). Each runs the real ``python -m musacache`` in a subprocess."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import musacache as mc
from helpers import small_spec
from server_utils import ServerProcess, write_config


def musacache(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    src = str(Path(mc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "musacache", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def one_clear_line(run: subprocess.CompletedProcess[str], *words: str) -> str:
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    # argparse adds its usage line before the error; anything else says one line only.
    if lines and lines[0].startswith("usage:"):
        lines = [line for line in lines if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, run.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    # A one-cache config file, which servers before and after tenants both accept.
    return write_config(tmp_path / "server.toml", small_spec(), "ns", 16, 1 << 20)


def test_serve_in_a_folder_that_cannot_exist(config):
    one_clear_line(musacache("serve", "--socket", "/proc/x/cache.sock", "--config", str(config)),
                   "/proc/x")


def test_serve_with_a_socket_path_too_long(config, tmp_path):
    path = str(tmp_path / ("d" * 120) / "cache.sock")
    one_clear_line(musacache("serve", "--socket", path, "--config", str(config)), "bytes")


def test_serve_with_an_unknown_log_level(config, tmp_path):
    one_clear_line(musacache("serve", "--socket", str(tmp_path / "r" / "s.sock"), "--config",
                             str(config), "--log-level", "foo"), "--log-level", "foo")


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--tokens", "-5"], ["--tokens", "0"]])
def test_bench_cache_refuses_counts_below_one(args):
    one_clear_line(musacache("bench", "cache", *args), args[0])


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_stats_refuses_a_tight_loop(interval, tmp_path):
    one_clear_line(musacache("stats", "--socket", str(tmp_path / "s.sock"),
                             f"--interval={interval}"), "--interval")


def test_stats_into_a_closed_pipe(tmp_path):
    spec = small_spec()
    cfg = write_config(tmp_path / "server.toml", spec, "ns", 16, spec.nbytes(16) * 8)
    server = ServerProcess(str(tmp_path / "run" / "s.sock"), cfg).start()
    try:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(Path(mc.__file__).resolve().parent.parent)
        # `musacache stats --socket S | head -3`: the reader leaves after three lines.
        stats = subprocess.Popen(
            [sys.executable, "-m", "musacache", "stats", "--socket", server.sock,
             "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert stats.stdout is not None and stats.stderr is not None
        for _ in range(3):
            stats.stdout.readline()
        stats.stdout.close()
        stats.wait(30)
        err = stats.stderr.read().decode()
        stats.stderr.close()
        run = subprocess.CompletedProcess(stats.args, stats.returncode, "", err)
        one_clear_line(run, "output")
    finally:
        server.stop()


def test_serve_says_what_it_did_when_it_stops(tmp_path):
    spec = small_spec()
    cfg = tmp_path / "server.toml"
    cfg.write_text(f"""
[[tiers]]
kind = "host"
capacity = {spec.nbytes(16) * 8}
[[tiers]]
kind = "disk"
path = "{tmp_path / 'disk'}"
capacity = "64MiB"
[server]
max_caches = 2
""")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(mc.__file__).resolve().parent.parent)
    sock = str(tmp_path / "run" / "s.sock")
    serve = subprocess.Popen([sys.executable, "-m", "musacache", "serve", "--socket", sock,
                              "--config", str(cfg)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env, text=True)
    assert serve.stdout is not None
    assert "listening on" in serve.stdout.readline()

    async def use() -> None:
        async with mc.connect(sock, spec=spec, namespace="ns", chunk_size=16) as c:
            await c.put(list(range(40)), torch.ones(spec.shape(40), dtype=spec.dtype))

    asyncio.run(use())
    serve.terminate()
    out = serve.stdout.read()
    assert serve.wait(30) == 0
    # 40 tokens are 3 chunks of 16; all of them held only in memory are written to disk.
    assert "stopping" in out and "stopped" in out, out
    assert "ns: 3 chunk(s) held, 3 written to disk while closing" in out, out

