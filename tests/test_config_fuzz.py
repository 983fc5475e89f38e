"""Every config loader lets only ConfigError escape, whatever it is fed, and every command
says a bad config or argument in one line (issue 37, "typed errors everywhere").

The loaders are fed random TOML text (deep nesting, wrong types at every known field,
unknown keys, huge ints, NaN and infinity, tops that are not tables) and random JSON-like
values; a value that builds a config is fine, any exception but ConfigError is a failure.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musacache as mc
from musacache.server import ServerConfig

SOCK = "/run/musacache-fuzz/c.sock"
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

BASE: dict[str, Any] = {
    "namespace": "m", "chunk_size": 16, "tenant": "t", "copy_threads": 1,
    "inline_copy_bytes": "1MiB", "write_queue_bytes": 4096, "refresh_interval": 1.0,
    "persist_on_close": False, "device": "cpu", "close_timeout": 1.0,
    "promotion": "sync",
    "spec": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
             "mla": False},
    "tiers": [
        {"kind": "host", "capacity": "1MiB", "pinned": False, "segment_bytes": 65536,
         "name": "h", "prealloc": 0},
        {"kind": "disk", "path": "/nonexistent/musacache-fuzz", "capacity": "1GiB",
         "codec": "raw", "write_through": True, "timeout": 1.0, "max_concurrency": 2,
         "fsync": False, "name": "d"},
        {"kind": "s3", "bucket": "b", "prefix": "p", "retries": 1, "timeout": 1.0,
         "multipart_threshold": 0, "part_size": "8MiB", "name": "s"},
    ],
}
SERVER: dict[str, Any] = {
    "max_caches": 2, "max_frame_size": 1 << 20, "max_connections": 8,
    "max_requests_per_peer": 4, "max_fds_per_peer": 8, "max_buffers_per_peer": 4,
    "max_stage_bytes": 1 << 20, "max_buffered_bytes": 1 << 22, "max_mappings_per_peer": 8,
    "max_mappings": 64, "max_request_bytes_per_peer": 1 << 22, "min_chunk_size": 16,
    "ready_timeout": 1.0, "hello_timeout": 1.0, "idle_timeout": 1.0, "frame_timeout": 1.0,
    "allow_uids": [1001],
}
#: (path, a value no field there accepts): the message must name the field's last part.
KNOWN_FIELDS = [
    *[((k,), k) for k in BASE if k not in ("spec", "tiers")],
    *[(("spec", k), k) for k in BASE["spec"]],
    *[(("tiers", i, k), k) for i, t in enumerate(BASE["tiers"]) for k in t],
]
#: Past 64 bits, and near int()'s digit limit (hypothesis prints what it draws: not past it).
HUGE = [2**63, 2**64 + 1, 10**100, 10**4000, -(10**4000)]

scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
keys = st.sampled_from([k for _, k in KNOWN_FIELDS] + list(SERVER) + ["kind", "socket"]) \
    | st.text(max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=12)


def only_config_error(load: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """Run a loader; return the ConfigError's message, None when it built a config."""
    try:
        load(*args, **kwargs)
    except mc.ConfigError as e:
        assert str(e), "a ConfigError without a message"
        return str(e)
    return None


def toml_value(v: Any) -> str | None:
    """``v`` as an inline TOML value (None where TOML has none: null)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < 10**4000 else "1" * 4400  # past int()'s digit limit
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") \
            if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        items = [x for x in map(toml_value, v) if x is not None]
        return "[" + ", ".join(items) + "]"
    if isinstance(v, dict):
        pairs = [f"{json.dumps(str(k))} = {x}" for k, x in
                 ((k, toml_value(x)) for k, x in v.items()) if x is not None]
        return "{" + ", ".join(pairs) + "}"
    return None


def toml_text(data: Any) -> str:
    if not isinstance(data, dict):  # a top that is not a table is no TOML document
        return f"top = {toml_value(data) or 0}\n"
    return "".join(f"{json.dumps(str(k))} = {t}\n" for k, t in
                   ((k, toml_value(v)) for k, v in data.items()) if t is not None)


def env_of(data: Any, prefix: str = "MUSACACHE_") -> dict[str, str]:
    """The environment spelling of a nested mapping (``__`` nests, list indexes are numbers)."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        items: Iterator[tuple[Any, Any]] = iter(data.items())
    elif isinstance(data, list):
        items = iter(enumerate(data))
    else:
        return {prefix.removesuffix("_"): str(data)}
    for k, v in items:
        name = f"{prefix}{str(k).upper()}"
        if isinstance(v, (dict, list)) and v:
            out.update(env_of(v, name + "__"))
        else:
            out[name] = "" if v is None else str(v)
    return {k: v for k, v in out.items() if "\0" not in k + v}


def with_change(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out: Any = json.loads(json.dumps(data))
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    """The valid base config with a few fields replaced, added, dropped or its top swapped."""
    data: Any = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["field", "field", "unknown", "drop", "top", "tier"]))
        if how == "field":
            path, _ = draw(st.sampled_from(KNOWN_FIELDS))
            if isinstance(data, dict):
                try:
                    data = with_change(data, path, draw(values))
                except (KeyError, IndexError, TypeError):
                    pass
        elif how == "unknown" and isinstance(data, dict):
            data[draw(st.text(min_size=1, max_size=6))] = draw(values)
        elif how == "drop" and isinstance(data, dict) and data:
            data.pop(draw(st.sampled_from(sorted(data))))
        elif how == "tier" and isinstance(data, dict):
            data["tiers"] = draw(st.lists(values | st.fixed_dictionaries(
                {"kind": st.sampled_from(["host", "device", "disk", "s3"]) | values},
                optional={k: values for k in ("capacity", "name", "path", "bucket",
                                              "device", "pinned", "codec")}), max_size=3))
        elif how == "top":
            data = draw(values)
    return data


def deep_text(depth: int, opener: str) -> str:
    closer = {"[": "]", "{a=": "}"}[opener]
    return "x = " + opener * depth + ("1" if opener != "[" else "") + closer * depth + "\n"


deep = st.builds(deep_text, st.integers(1, 6000), st.sampled_from(["[", "{a="]))
texts = st.text(max_size=60) | deep | mutated().map(toml_text)


# -- the loaders ------------------------------------------------------------------------------


def test_a_ten_kilobyte_file_of_nested_arrays_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "deep.toml"
    f.write_text(deep_text(5000, "["))
    with pytest.raises(mc.ConfigError, match="nest"):
        mc.CacheConfig.from_toml(f)
    with pytest.raises(mc.ConfigError, match="nest"):
        mc.CacheConfig.from_env({"MUSACACHE_CONFIG": str(f)})
    with pytest.raises(mc.ConfigError, match="nest"):
        ServerConfig.from_toml(f, socket_path=SOCK)


def test_nesting_within_the_parser_but_past_the_limit_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "tables.toml"  # dotted headers nest without recursing in the parser
    f.write_text("".join(f"[{'.'.join(['a'] * i)}]\n" for i in range(1, 200)))
    with pytest.raises(mc.ConfigError, match="nest"):
        mc.CacheConfig.from_toml(f)
    deep_dict: dict[str, Any] = {}
    node = deep_dict
    for _ in range(100_000):
        node = node.setdefault("a", {})
    with pytest.raises(mc.ConfigError, match="nest"):
        mc.CacheConfig.from_dict({**BASE, "tenant": deep_dict})


@pytest.mark.parametrize("top", [[1], 1, "x", None, (("namespace", "m"),)])
def test_a_top_that_is_not_a_table_is_a_config_error(top: Any) -> None:
    with pytest.raises(mc.ConfigError, match="table"):
        mc.CacheConfig.from_dict(top)


@pytest.mark.parametrize(("path", "name"), KNOWN_FIELDS,
                         ids=[".".join(map(str, path)) for path, _ in KNOWN_FIELDS])
def test_a_wrong_type_at_every_known_field_is_named(tmp_path: Path, path: tuple[Any, ...],
                                                    name: str) -> None:
    # A table is no field's value (a kind or a dtype, a size or a count, a name or a flag).
    bad = with_change(BASE, path, {"x": [1]})
    field = "capacity" if name == "capacity" else name
    for message in (only_config_error(mc.CacheConfig.from_dict, bad),
                    only_config_error(mc.CacheConfig.from_env, env_of(bad))):
        assert message is not None and field in message, message
    f = tmp_path / "bad.toml"
    f.write_text(toml_text(bad))
    message = only_config_error(mc.CacheConfig.from_toml, f)
    assert message is not None and field in message, message


@pytest.mark.parametrize("value", [10**5000, -(10**5000), math.nan, math.inf, -math.inf],
                         ids=["huge", "-huge", "nan", "inf", "-inf"])
def test_huge_ints_and_non_finite_floats_are_config_errors(value: Any) -> None:
    for path, _ in KNOWN_FIELDS:
        only_config_error(mc.CacheConfig.from_dict, with_change(BASE, path, value))


def test_the_base_config_is_valid(tmp_path: Path) -> None:
    # The fuzzing starts from a config every loader builds.
    f = tmp_path / "ok.toml"
    f.write_text(toml_text(BASE))
    assert mc.CacheConfig.from_dict(BASE) == mc.CacheConfig.from_toml(f) \
        == mc.CacheConfig.from_env(env_of(BASE))
    ServerConfig.from_toml(f, socket_path=SOCK)
    ServerConfig(socket_path=SOCK, tiers=tuple(BASE["tiers"]), cache_options={"copy_threads": 1},
                 **{**SERVER, "allow_uids": (1001,)})


@FUZZ
@given(data=mutated() | values)
def test_from_dict_raises_only_config_errors(data: Any) -> None:
    only_config_error(mc.CacheConfig.from_dict, data)


@FUZZ
@given(text=texts)
def test_from_toml_raises_only_config_errors(tmp_path_factory: pytest.TempPathFactory,
                                             text: str) -> None:
    f = tmp_path_factory.getbasetemp() / "fuzz.toml"
    f.write_text(text, encoding="utf-8", errors="surrogatepass")
    only_config_error(mc.CacheConfig.from_toml, f)
    only_config_error(ServerConfig.from_toml, f, socket_path=SOCK)
    only_config_error(mc.CacheConfig.from_env, {"MUSACACHE_CONFIG": str(f)})


@FUZZ
@given(data=mutated(), base=st.booleans())
def test_the_environment_raises_only_config_errors(tmp_path_factory: pytest.TempPathFactory,
                                                   data: Any, base: bool) -> None:
    env = env_of(data)
    if base:  # a file to start from, which the variables override
        f = tmp_path_factory.getbasetemp() / "env.toml"
        f.write_text(toml_text(BASE))
        env["MUSACACHE_CONFIG"] = str(f)
    only_config_error(mc.CacheConfig.from_env, env)
    # The default reads os.environ, patched here only for the call.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        only_config_error(mc.CacheConfig.from_env)


@FUZZ
@given(options=values | st.dictionaries(keys, values, max_size=4),
       tiers=values | st.lists(values | mutated().map(
           lambda d: d["tiers"][0] if isinstance(d, dict) and isinstance(d.get("tiers"), list)
           and d["tiers"] else d), max_size=3),
       server=st.dictionaries(st.sampled_from(sorted(SERVER)), values, max_size=3))
def test_server_configs_raise_only_config_errors(options: Any, tiers: Any,
                                                 server: dict[str, Any]) -> None:
    only_config_error(ServerConfig, socket_path=SOCK, tiers=tiers, cache_options=options,
                      **server)
    only_config_error(ServerConfig, socket_path=SOCK, tiers=tuple(BASE["tiers"]),
                      cache_options=options)
    only_config_error(ServerConfig, SOCK, tiers=tuple(BASE["tiers"]), **server)


@FUZZ
@given(server=values | st.dictionaries(st.sampled_from([*SERVER, "socket"]) | keys, values,
                                       max_size=4))
def test_server_files_raise_only_config_errors(tmp_path_factory: pytest.TempPathFactory,
                                               server: Any) -> None:
    f = tmp_path_factory.getbasetemp() / "server.toml"
    f.write_text(toml_text({**BASE, "server": server}))
    only_config_error(ServerConfig.from_toml, f, socket_path=None)


def test_server_options_that_no_cache_takes_are_config_errors() -> None:
    tiers = tuple(BASE["tiers"])
    with pytest.raises(mc.ConfigError, match="bogus"):
        ServerConfig(SOCK, tiers=tiers, cache_options={"bogus": 1})
    with pytest.raises(mc.ConfigError, match="cache_options"):
        ServerConfig(SOCK, tiers=tiers, cache_options=[1])  # type: ignore[arg-type]
    with pytest.raises(mc.ConfigError, match="allow_uids"):
        ServerConfig(SOCK, tiers=tiers, allow_uids=5)  # type: ignore[arg-type]
    with pytest.raises(mc.ConfigError, match="tiers"):
        ServerConfig(SOCK, tiers=5)  # type: ignore[arg-type]


def test_server_tiers_given_as_tables_are_built() -> None:
    cfg = ServerConfig(SOCK, tiers=({"kind": "host", "capacity": "1MiB"},), max_caches=2)
    (host,) = cfg.shared_tiers()
    assert isinstance(host, mc.HostTier) and host.capacity_bytes == 1024**2 // 2
    with pytest.raises(mc.ConfigError, match="capacity"):
        ServerConfig(SOCK, tiers=({"kind": "host", "capacity": "x"},))


# -- the commands -----------------------------------------------------------------------------

#: name: (file text, words the line must hold). Each command starts an interpreter that
#: imports torch: a few, run at once, keep the file within its time on two cores.
BAD_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "deep": (deep_text(5000, "["), ("nest",)),
    "wrong-type": ('chunk_size = "x"\n[[tiers]]\nkind = "host"\ncapacity = 1024\n',
                   ("chunk_size",)),
    "huge-int": (f'[[tiers]]\nkind = "host"\ncapacity = {"9" * 5000}\n', ("TOML",)),
    "bad-socket": ('[[tiers]]\nkind = "host"\ncapacity = 1024\n[server]\nsocket = [1]\n',
                   ("socket",)),
}
#: name: (arguments, words the line must hold); {dir} is the test's folder.
COMMANDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    **{f"serve-{k}": (["serve", "--socket", "{dir}/s.sock", "--config", f"{{dir}}/{k}.toml"],
                      words) for k, (_, words) in BAD_FILES.items()},
    "serve-a-folder": (["serve", "--config", "{dir}"], ()),
    "stats-no-server": (["stats", "--socket", "{dir}/ok.toml", "--once"], ()),
    "bench-bad-count": (["bench", "cache", "--tokens", "x"], ("--tokens",)),
    "unknown-command": (["nope"], ()),
}


@pytest.fixture(scope="module")
def command_runs(tmp_path_factory: pytest.TempPathFactory,
                 ) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command of COMMANDS, run at once (each starts an interpreter that imports torch)."""
    folder = tmp_path_factory.mktemp("cli")
    for name, (text, _) in BAD_FILES.items():
        (folder / f"{name}.toml").write_text(text)
    (folder / "ok.toml").write_text('[[tiers]]\nkind = "host"\ncapacity = 1024\n')
    env = dict(os.environ)
    src = str(Path(mc.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # many interpreters at once: no thread pools to contend
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "musacache", *(a.format(dir=folder) for a in args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=folder)
        for name, (args, _) in COMMANDS.items()}
    runs = {}
    for name, p in procs.items():
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a server that took the bad config and serves
            p.kill()
            out, err = p.communicate()
            err += "\n(still running after 60 s: the command took its bad input)"
        runs[name] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return runs


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_command_with_bad_input_says_one_line(
        command_runs: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    run = command_runs[name]
    assert run.returncode != 0, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    # argparse puts its usage lines before the error of a bad argument.
    if lines and lines[0].startswith("usage:"):
        lines = [line for line in lines if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("musacache"), lines[0]
    for word in COMMANDS[name][1]:
        assert word in lines[0], lines[0]
