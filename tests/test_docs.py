"""The docs' Python blocks run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def blocks(path: Path) -> list[str]:
    return FENCE.findall(path.read_text())


DOCS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")) + ["README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run_in_order(doc, capsys):
    found = blocks(ROOT / doc)
    if doc == "docs/quickstart.md":
        assert len(found) >= 5
    namespace: dict = {"__name__": "__docs__"}
    for i, code in enumerate(found):
        try:
            exec(compile(code, f"{doc}[block {i}]", "exec"), namespace)
        except Exception as e:  # name the block that broke
            raise AssertionError(f"{doc} block {i} failed: {e!r}\n{code}") from e


def test_configuration_md_names_every_setting():
    import dataclasses

    import musacache as mc
    from musacache.server import ServerConfig

    text = (ROOT / "docs/configuration.md").read_text()
    missing = []
    for cls in (mc.CacheConfig, mc.KVSpec, mc.HostTier, mc.DeviceTier, mc.DiskTier,
                mc.S3Tier, ServerConfig):
        for f in dataclasses.fields(cls):
            name = {"socket_path": "socket", "cache": None, "spec": None, "tiers": None}.get(
                f.name, f.name)
            if f.init and name and f"`{name}`" not in text:
                missing.append(f"{cls.__name__}.{f.name}")
    assert missing == []


def test_configuration_md_toml_example_loads(tmp_path):
    import musacache as mc

    text = (ROOT / "docs/configuration.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "c.toml").write_text(toml)
    cfg = mc.CacheConfig.from_toml(tmp_path / "c.toml")
    assert [t.kind for t in cfg.tiers] == ["device", "host", "disk", "s3"]
