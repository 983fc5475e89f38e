"""End to end against the real vLLM (CPU build): two separate vLLM processes, one node server.

Run under the vLLM venv (tests/test_vllm.py does it). Each vLLM is its own process, given the
``--kv-transfer-config`` JSON of docs/vllm.md (read from the doc, with this test's socket and
tiers file in place of its two paths):

    python tests/integrations/vllm_run.py serve --model DIR --prompts P.json --out R.json \\
        --kv-transfer-config JSON
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_env import require

require("vllm", ".ci/vllm-env.sh")

from musacache.server import spawn  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_run.py")
DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
PREFIX = 300   # shared by both prompts: more than one 256-token chunk, ends mid-chunk
# vLLM's CPU backend (blocks of 128 tokens here) is loaded and saved whole blocks at a time
# (docs/vllm.md): a hit counts down to its last whole block.
CPU_BLOCK = 128


def whole(tokens: int) -> int:
    return tokens - tokens % CPU_BLOCK
PROMPT = 400


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def _run(*args: str, timeout: float = 900) -> None:
    r = subprocess.run([sys.executable, str(RUNNER), *args], env=_env(), timeout=timeout,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"vllm_run {args[0]} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-6000:]}")


def kv_transfer_config(socket: str, config: Path | None) -> str:
    """docs/vllm.md's --kv-transfer-config, for this socket and tiers file (or none)."""
    doc = json.loads(re.search(r"```json\n(.*?)```", DOC.read_text(), re.S).group(1))
    extra = doc["kv_connector_extra_config"]
    assert set(extra) == {"musacache.socket", "musacache.config"}, extra
    extra["musacache.socket"] = socket
    if config is None:
        del extra["musacache.config"]
    else:
        extra["musacache.config"] = str(config)
    return json.dumps(doc)


def _serve(tmp: Path, name: str, model: Path, prompts: Path, socket: str | None = None,
           config: Path | None = None, tensor_parallel: int = 1) -> dict:
    out = tmp / f"{name}.json"
    args = ["serve", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
            "--tensor-parallel-size", str(tensor_parallel)]
    if socket:
        args += ["--kv-transfer-config", kv_transfer_config(socket, config)]
    _run(*args)
    return json.loads(out.read_text())


def _tiers(tmp: Path, name: str) -> Path:
    # Only tiers: each vLLM names its cache (model, KV shape, rank) when it connects.
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"""
[[tiers]]
kind = "host"
capacity = "64MiB"
[[tiers]]
kind = "disk"
path = "{tmp / name}-disk"
capacity = "256MiB"
""")
    return cfg


# Each vLLM process takes one to three minutes on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "model"
    _run("make-model", str(model))
    rng = random.Random(1)
    prefix = [rng.randrange(1, 4000) for _ in range(PREFIX)]
    first = prefix + [rng.randrange(1, 4000) for _ in range(PROMPT - PREFIX)]
    second = prefix + [rng.randrange(1, 4000) for _ in range(PROMPT - PREFIX)]
    (tmp / "first.json").write_text(json.dumps([first]))
    (tmp / "second.json").write_text(json.dumps([second, first]))
    # The reference: vLLM alone, the same prompts in the same order as the two runs.
    (tmp / "all.json").write_text(json.dumps([first, second, first]))
    baseline = _serve(tmp, "baseline", model, tmp / "all.json")
    return {"tmp": tmp, "model": model, "baseline": baseline}


def test_second_vllm_process_hits_the_first_ones_prefix(world: dict) -> None:
    tmp, model, base = world["tmp"], world["model"], world["baseline"]
    cfg = _tiers(tmp, "tiers")
    sock = str(tmp / "run" / "node.sock")
    server = spawn(cfg, sock)
    try:
        one = _serve(tmp, "one", model, tmp / "first.json", sock, cfg)
        two = _serve(tmp, "two", model, tmp / "second.json", sock, cfg)
    finally:
        server.stop()
    # A fresh vLLM has an empty prefix cache: cached tokens came through the connector.
    assert one["num_cached_tokens"] == [0]
    # The shared prefix (found as a whole chunk plus 44 tokens of the first prompt's
    # partial tail), then the whole first prompt less the one token vLLM must compute
    # itself; each down to its last whole block.
    assert two["num_cached_tokens"] == [whole(PREFIX), whole(PROMPT - 1)]
    # The same greedy tokens as vLLM computing everything itself.
    assert one["tokens"][0] == base["tokens"][0]
    assert two["tokens"][0] == base["tokens"][1]
    assert two["tokens"][1] == base["tokens"][0]


def test_vllm_keeps_serving_when_the_server_is_killed(world: dict) -> None:
    tmp, model, base = world["tmp"], world["model"], world["baseline"]
    cfg = _tiers(tmp, "tiers2")
    sock = str(tmp / "run2" / "node.sock")
    server = spawn(cfg, sock)
    try:
        _serve(tmp, "before-kill", model, tmp / "first.json", sock, cfg)
    finally:
        server.kill()
    # No musacache.config: the connector may not start a new server, so every lookup,
    # load and save meets a dead socket. vLLM recomputes and answers the same.
    after = _serve(tmp, "after-kill", model, tmp / "second.json", sock)
    # No external hit: the second prompt was computed, and the first found only what vLLM's
    # own prefix cache holds of the prefix they share (as for the second prompt of the
    # baseline run, which served them the other way round).
    assert after["num_cached_tokens"] == [0, base["num_cached_tokens"][1]]
    assert base["num_cached_tokens"][1] < PREFIX
    assert after["tokens"] == [base["tokens"][1], base["tokens"][0]]


def test_tensor_parallel_vllm_saves_what_it_computed_past_its_loads(world: dict) -> None:
    """Two ranks (vLLM's multiprocess executor): a request that loads holds its saves back
    until every rank's output of the load's step is in (docs/vllm.md, "Faults"); vLLM's own
    executor must hand the workers' step numbers back for the hold to open. A third process
    finds what the second computed past its load."""
    tmp, model = world["tmp"], world["model"]
    (tmp / "again.json").write_text(json.dumps(
        [json.loads((tmp / "second.json").read_text())[0]]))
    base = _serve(tmp, "tp-baseline", model, tmp / "second.json", tensor_parallel=2)
    cfg = _tiers(tmp, "tiers-tp")
    sock = str(tmp / "run-tp" / "node.sock")
    server = spawn(cfg, sock)
    try:
        one = _serve(tmp, "tp-one", model, tmp / "first.json", sock, cfg, tensor_parallel=2)
        two = _serve(tmp, "tp-two", model, tmp / "second.json", sock, cfg, tensor_parallel=2)
        three = _serve(tmp, "tp-three", model, tmp / "again.json", sock, cfg,
                       tensor_parallel=2)
    finally:
        server.stop()
    assert one["num_cached_tokens"] == [0]
    assert two["num_cached_tokens"] == [whole(PREFIX), whole(PROMPT - 1)]
    # The second prompt's tail was saved after its load's step came back from both ranks.
    assert three["num_cached_tokens"] == [whole(PROMPT - 1)]
    assert two["tokens"] == base["tokens"]
    assert three["tokens"] == base["tokens"][:1]
