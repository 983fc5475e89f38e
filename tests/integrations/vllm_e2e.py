"""End to end against the real vLLM (CPU build): two separate vLLM processes, one node server.

Run under the vLLM venv (tests/test_vllm.py does it), each vLLM serve being its own process
started exactly as docs/vllm.md shows:

    python tests/integrations/vllm_run.py serve --model DIR --prompts P.json --out R.json \\
        --socket SOCK --config TIERS.toml
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_env import require

require("vllm", ".ci/vllm-env.sh")

from musacache._spawn import spawn  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_run.py")
PREFIX = 300   # shared by both prompts: more than one 256-token chunk, ends mid-chunk
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


def _serve(tmp: Path, name: str, model: Path, prompts: Path, socket: str | None = None,
           config: Path | None = None) -> dict:
    out = tmp / f"{name}.json"
    args = ["serve", "--model", str(model), "--prompts", str(prompts), "--out", str(out)]
    if socket:
        args += ["--socket", socket]
    if config:
        args += ["--config", str(config)]
    _run(*args)
    return json.loads(out.read_text())


def _tiers(tmp: Path, model: Path) -> Path:
    # The spec and namespace are what the connector derives from vLLM: the model path, tp0.
    cfg = tmp / "tiers.toml"
    cfg.write_text(f"""
namespace = "{model}/tp0"
[spec]
num_layers = 2
num_kv_heads = 2
head_dim = 32
dtype = "float32"
[[tiers]]
kind = "host"
capacity = "64MiB"
[[tiers]]
kind = "disk"
path = "{tmp / 'disk'}"
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
    cfg = _tiers(tmp, model)
    sock = str(tmp / "run" / "node.sock")
    server = spawn(cfg, sock)
    try:
        one = _serve(tmp, "one", model, tmp / "first.json", sock, cfg)
        two = _serve(tmp, "two", model, tmp / "second.json", sock, cfg)
    finally:
        server.stop()
    # A fresh vLLM has an empty prefix cache: cached tokens came through the connector.
    assert one["num_cached_tokens"] == [0]
    # The shared prefix (a whole chunk plus 44 tokens of the first prompt's partial tail),
    # then the whole first prompt less the one token vLLM must compute itself.
    assert two["num_cached_tokens"] == [PREFIX, PROMPT - 1]
    # The same greedy tokens as vLLM computing everything itself.
    assert one["tokens"][0] == base["tokens"][0]
    assert two["tokens"][0] == base["tokens"][1]
    assert two["tokens"][1] == base["tokens"][0]


def test_vllm_keeps_serving_when_the_server_is_killed(world: dict) -> None:
    tmp, model, base = world["tmp"], world["model"], world["baseline"]
    cfg = _tiers(tmp, model)
    sock = str(tmp / "run2" / "node.sock")
    server = spawn(cfg, sock)
    try:
        _serve(tmp, "before-kill", model, tmp / "first.json", sock, cfg)
    finally:
        server.kill()
    # No musacache.config: the connector may not start a new server, so every lookup,
    # load and save meets a dead socket. vLLM recomputes and answers the same.
    after = _serve(tmp, "after-kill", model, tmp / "second.json", sock)
    assert after["num_cached_tokens"] == [0, 0]
    assert after["tokens"] == [base["tokens"][1], base["tokens"][0]]
