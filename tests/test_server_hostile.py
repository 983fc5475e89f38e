"""Hostile clients, each a process of its own (``musacache.bench.hostile``), against a server
in this process while a well-behaved client makes its calls: every call of the polite client
is answered right, and no turn of the server's loop is a stall (counted as in
``test_server_budgets``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import musacache as mc
from musacache.bench import hostile
from musacache.server import Server, ServerConfig
from test_server_budgets import TURN_CPU_S, most_cpu_per_turn

SECONDS = 2.0


@pytest.mark.parametrize("pattern", list(hostile.PATTERNS))
async def test_a_hostile_client_does_not_hold_the_loop(tmp_path, pattern):
    cfg = ServerConfig(str(tmp_path / "h" / "s.sock"),
                       tiers=(mc.HostTier(hostile.SPEC.nbytes(hostile.CHUNK) * 4096),),
                       chunk_size=hostile.CHUNK)
    toks = np.arange(hostile.CHUNK * 4, dtype=np.int32)
    kv = np.ones(hostile.SPEC.shape(len(toks)), dtype=np.float16)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=hostile.SPEC, namespace="polite",
                              chunk_size=hostile.CHUNK) as polite:
            await polite.put(toks, torch.from_numpy(kv))
            proc = hostile.run_hostile(pattern, cfg.socket_path, SECONDS)
            answers: list[int] = []

            async def calls() -> None:
                while proc.is_alive():
                    answers.append(await polite.lookup(toks))
                    await asyncio.sleep(0.005)

            try:
                most = await most_cpu_per_turn(calls)
            finally:
                await asyncio.to_thread(proc.join, 60)
                if proc.is_alive():
                    proc.kill()
        srv.stop()
        await serving
    assert proc.exitcode == 0, f"the {pattern} client failed (exit code {proc.exitcode})"
    assert answers and set(answers) == {len(toks)}
    assert most < TURN_CPU_S, f"{pattern}: one turn of the loop took {most * 1e3:.0f} ms of CPU"
