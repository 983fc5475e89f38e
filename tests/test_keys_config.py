"""Key chain seeding, token canonicalisation, and the config loaders."""

import numpy as np
import pytest
import torch

import musacache as mc
from helpers import host_config, prefix_kv, small_spec
from musacache._config import parse_size
from musacache._keys import Fingerprint, KeyChain, as_tokens


def chain(namespace="m", spec=None, chunk=16, salt=None):
    return KeyChain(Fingerprint(namespace, spec or small_spec(), chunk), salt)


def test_keys_chain_the_whole_prefix():
    a = as_tokens(list(range(40)))
    b = a.copy()
    b[3] = 999  # differs in chunk 0 only
    ka = [k for *_, k in chain().keys(a)]
    kb = [k for *_, k in chain().keys(b)]
    assert all(x != y for x, y in zip(ka, kb)), "a change in chunk 0 must change every later key"
    assert [k for *_, k in chain().keys(a)] == ka  # deterministic, not builtin hash()


@pytest.mark.parametrize("other", [
    dict(namespace="other"), dict(spec=small_spec(dtype=torch.float16)), dict(chunk=32),
    dict(salt=b"tenant-b")])
def test_seed_separates_namespace_spec_chunk_and_salt(other):
    assert chain().seed != chain(**other).seed


@pytest.mark.parametrize("bad", [[1.5, 2], torch.zeros(3), torch.zeros(2, 2, dtype=torch.long),
                                 np.zeros((2, 2), dtype=np.int64), "abc", [True, False],
                                 [2**40], np.array([2**33])])
def test_bad_tokens_raise_tokens_error(bad):
    with pytest.raises(mc.TokensError):
        as_tokens(bad)


def test_tokens_forms_agree():
    ref = as_tokens([1, 2, 3])
    for form in (torch.tensor([1, 2, 3]), np.array([1, 2, 3], dtype=np.int16), [1, 2, 3]):
        assert np.array_equal(as_tokens(form), ref)


async def test_other_namespace_spec_or_salt_never_hit(spec):
    toks = torch.arange(50)
    kv = prefix_kv(spec, toks)
    async with mc.Cache(host_config(spec)) as base:
        await base.put(toks, kv)
        assert await base.lookup(toks) == 50
    for cfg in (host_config(spec, namespace="other"), host_config(spec, tenant="t2")):
        async with mc.Cache(cfg) as c:
            # Same process, fresh cache: the test is that the *keys* differ.
            assert c._chain.seed != mc.Cache(host_config(spec))._chain.seed


def test_parse_size():
    assert parse_size("8GiB") == 8 * 1024**3
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(512) == 512
    for bad in ("-1", -1, "lots", True):
        with pytest.raises(mc.ConfigError):
            parse_size(bad)


def test_negative_capacity_is_config_error():
    with pytest.raises(mc.ConfigError, match="negative"):
        mc.HostTier(capacity_bytes=-1)
    with pytest.raises(mc.ConfigError, match="negative"):
        mc.DeviceTier(capacity_bytes="-5GiB")


TOML = """
namespace = "llama-tiny"
chunk_size = 128
tenant = "acme"
copy_threads = 3
[spec]
num_layers = 4
num_kv_heads = 2
head_dim = 64
dtype = "bf16"
[[tiers]]
kind = "host"
capacity = "2GiB"
pinned = false
"""


def test_toml_and_env_read_the_same_settings(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    from_toml = mc.CacheConfig.from_toml(path)
    env = {
        "MUSACACHE_NAMESPACE": "llama-tiny", "MUSACACHE_CHUNK_SIZE": "128",
        "MUSACACHE_TENANT": "acme", "MUSACACHE_COPY_THREADS": "3",
        "MUSACACHE_SPEC__NUM_LAYERS": "4", "MUSACACHE_SPEC__NUM_KV_HEADS": "2",
        "MUSACACHE_SPEC__HEAD_DIM": "64", "MUSACACHE_SPEC__DTYPE": "bf16",
        "MUSACACHE_TIERS__0__KIND": "host", "MUSACACHE_TIERS__0__CAPACITY": "2GiB",
        "MUSACACHE_TIERS__0__PINNED": "false",
    }
    from_env = mc.CacheConfig.from_env(env)
    assert from_env == from_toml
    assert from_toml.spec == mc.KVSpec(4, 2, 64, torch.bfloat16)
    assert from_toml.tiers[0].capacity_bytes == 2 * 1024**3
    # The file named by MUSACACHE_CONFIG is the base; variables override it.
    over = mc.CacheConfig.from_env({"MUSACACHE_CONFIG": str(path), "MUSACACHE_CHUNK_SIZE": "64"})
    assert over.chunk_size == 64 and over.namespace == "llama-tiny"


def test_from_env_passes_over_the_tooling_variables():
    """The suite's own ``MUSACACHE_VLLM_PYTHON`` and the native module's thread count are
    not settings: a shell that exports them still builds a config from its environment, and
    a misspelt setting is still refused."""
    from musacache._config import ENV_RESERVED

    env = {"MUSACACHE_NAMESPACE": "m", "MUSACACHE_SPEC__NUM_LAYERS": "1",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "1", "MUSACACHE_SPEC__HEAD_DIM": "8",
           "MUSACACHE_TIERS__0__KIND": "host", "MUSACACHE_TIERS__0__CAPACITY": "1MiB"}
    tooling = {f"MUSACACHE_{n}": "/x/bin/python" for n in ENV_RESERVED}
    assert {"MUSACACHE_VLLM_PYTHON", "MUSACACHE_NATIVE_THREADS"} <= set(tooling)
    assert mc.CacheConfig.from_env({**env, **tooling}) == mc.CacheConfig.from_env(env)
    with pytest.raises(mc.ConfigError, match="unknown setting"):
        mc.CacheConfig.from_env({**env, **tooling, "MUSACACHE_VLLM_PYTHN": "x"})


@pytest.mark.parametrize("patch,match", [
    ({"MUSACACHE_TIERS__0__CAPACITY": "-1"}, "negative"),
    ({"MUSACACHE_TIERS__0__KIND": "floppy"}, "kind"),
    ({"MUSACACHE_BOGUS": "1"}, "unknown setting"),
    ({"MUSACACHE_TIERS__0__COLOUR": "red"}, "unknown setting"),
    ({"MUSACACHE_CHUNK_SIZE": "0"}, "chunk_size"),
])
def test_bad_config_values(patch, match):
    env = {"MUSACACHE_NAMESPACE": "m", "MUSACACHE_SPEC__NUM_LAYERS": "1",
           "MUSACACHE_SPEC__NUM_KV_HEADS": "1", "MUSACACHE_SPEC__HEAD_DIM": "8",
           "MUSACACHE_TIERS__0__KIND": "host", "MUSACACHE_TIERS__0__CAPACITY": "1MiB", **patch}
    with pytest.raises(mc.ConfigError, match=match):
        mc.CacheConfig.from_env(env)


def test_kvspec_shapes_and_validation():
    s = mc.KVSpec(3, 4, 8)
    assert s.shape(5) == (3, 2, 5, 4, 8) and s.dtype == torch.bfloat16
    assert mc.KVSpec(3, 1, 16, mla=True).shape(5) == (3, 5, 16)
    with pytest.raises(mc.ConfigError):
        mc.KVSpec(0, 1, 8)
    with pytest.raises(mc.ConfigError):
        mc.KVSpec(2, 4, 8, mla=True)
