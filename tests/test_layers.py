"""Dependencies point down only (docs/architecture.md, "Layers").

The import graph of the package, read from the source (module-level and function-level imports
alike: a lazy import that points up is still a cycle, only a hidden one), must be acyclic. And
the modules that a cycle used to make order-dependent import first in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import musacache

PACKAGE_ROOT = Path(musacache.__file__).parent


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's own modules that ``name`` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve(name, is_package, node.level, node.module) if node.level
                    else node.module or "")
            # `from . import devices` imports a module; `from ._config import X` a name in one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("musacache"):
                # importing a.b.c runs a, a.b and a.b.c
                parts = target.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                             if ".".join(parts[:i]) in known)
    # A module's own parent packages are already being imported when it runs: that the parent
    # facade imports its children is not a dependency of the children on it.
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return found - ancestors - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_import_graph_has_no_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# The folders and the ground-floor modules, and what each may import (besides itself).
# Everything not named here (the facade, bench, demo, cli, _testing) stands above them all.
_GROUND = frozenset({"_errors", "_validate", "_log", "_chunkmeta", "_version", "_keys",
                     "_spec", "_native", "_executor", "codec", "devices", "stats"})
_MAY_IMPORT = {
    **{g: _GROUND for g in _GROUND},
    "tiers": _GROUND,
    "transfer": _GROUND,
    "ipc": _GROUND,
    "_config": _GROUND | {"tiers"},
    "engine": _GROUND | {"_config", "tiers", "transfer"},
    "cache": _GROUND | {"_config", "engine", "tiers", "transfer"},
    "_api": _GROUND | {"cache"},
    "metrics": _GROUND | {"cache", "engine"},
    "server": _GROUND | {"_api", "_config", "cache", "engine", "ipc", "metrics", "tiers",
                         "transfer"},
    "integrations": _GROUND | {"_api", "_config", "cache", "ipc", "server", "tiers",
                               "transfer"},
}


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "musacache"


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(graph.items()):
        allowed = _MAY_IMPORT.get(_group(module))
        if allowed is None:
            continue
        for dep in sorted(deps):
            group = _group(dep)
            if group != _group(module) and group not in allowed:
                bad.append(f"{module} -> {dep}")
    return bad


def test_each_folder_imports_only_the_layers_below_it():
    bad = _layer_violations(_graph())
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_the_layer_rule_finds_an_upward_import():
    graph = {"musacache.tiers.disk": {"musacache.engine.core"},
             "musacache.engine.core": {"musacache.tiers.disk", "musacache._errors"}}
    assert _layer_violations(graph) == ["musacache.tiers.disk -> musacache.engine.core"]


@pytest.mark.parametrize("low,high", [
    ("musacache._validate", "musacache._config"),
    ("musacache._chunkmeta", "musacache.tiers.base"),
    ("musacache.codec", "musacache.tiers"),
    ("musacache.tiers.disk", "musacache._config"),
    ("musacache.tiers.s3", "musacache._config"),
    ("musacache.tiers", "musacache._config"),
])
def test_lower_layers_do_not_import_higher_ones(low, high):
    graph = _graph()
    seen: set[str] = set()
    todo = [low]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(graph[node])
    assert high not in seen, f"{low} reaches {high}"


def test_the_ground_floor_imports_nothing_of_the_package_but_errors():
    graph = _graph()
    assert graph["musacache._validate"] == {"musacache._errors"}
    assert graph["musacache._log"] == set()
    assert graph["musacache._chunkmeta"] == set()


@pytest.mark.slow
def test_each_formerly_cyclic_module_imports_first_in_a_fresh_interpreter():
    # One interpreter per module: with a cycle, which module is imported first decides
    # whether a half-initialised module is seen. torch is imported by the package either way.
    code = ("import importlib, sys\n"
            "importlib.import_module(sys.argv[1])\n"
            "import musacache\n"
            "cfg = musacache.CacheConfig.from_dict({'namespace': 'm', 'spec': {'num_layers': 1, "
            "'num_kv_heads': 1, 'head_dim': 8}, 'tiers': [{'kind': 'disk', 'path': '/nonexistent',"
            " 'capacity': '1MiB'}, {'kind': 's3', 'bucket': 'b'}]})\n"
            "assert [t.kind for t in cfg.tiers] == ['disk', 's3'], cfg\n")
    env = {"PYTHONPATH": str(PACKAGE_ROOT.parent), "PATH": "/usr/bin:/bin"}
    for module in ("musacache.tiers.disk", "musacache.tiers.s3"):
        done = subprocess.run([sys.executable, "-c", code, module], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"importing {module} first:\n{done.stderr[-2000:]}"
