"""``musacache bench gpu`` off the GPU: it says so and exits 0; ``--device cpu`` runs its
rows end to end (the figures mean nothing on a CPU, the code paths are what is checked)."""

from __future__ import annotations

import json

import pytest

from musacache import cli, devices
from musacache.bench import gpu


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(devices._module_overrides, "cuda", None)
    monkeypatch.setitem(devices._module_overrides, "musa", None)
    devices._reset_probes()


def test_no_gpu_exits_zero_and_says_so(no_accelerator: None,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "gpu"]) == 0
    assert capsys.readouterr().out.strip() == gpu.NO_GPU


def test_help_lists_every_row_and_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for needle in ("--model-size", "host put", "device-tier", "store", "retrieve",
                   "transfer.gather", "one-chunk get", "server", "TTFT"):
        assert needle in text


def test_unknown_skip_group_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--skip", "host,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_rows_run_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code = gpu.main(["--device", "cpu", "--layers", "2", "--heads", "2", "--head-dim", "16",
                     "--tokens", "64", "--chunk-size", "16", "--repeats", "1",
                     "--skip", "server,ttft", "--json"])
    report = json.loads(capsys.readouterr().out)
    names = [row["name"] for row in report["rows"]]
    assert code == 0, [row["note"] for row in report["rows"]]
    assert names == ["host put, steady", "host get", "one-chunk get", "host put, cold",
                     "device-tier put", "device-tier get", "store (vllm pages -> host)",
                     "retrieve (host -> vllm pages)", "transfer.gather on the device"]
    assert all(row["ratio"] > 0 for row in report["rows"])
