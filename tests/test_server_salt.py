"""The server salts each peer's cache with a structured encoding of (uid, tenant): a tenant
string of the server's own uid cannot spell the identity of another uid's tenant, on the
keys or on the storage folder they share."""

from __future__ import annotations

import os

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import musacache as mc
from helpers import small_spec
from musacache.server import Server, ServerConfig, peer_salt

CH = 16
OWN = os.getuid()
OTHER = 65534 if OWN != 65534 else 65533


async def test_a_tenant_named_like_another_uid_reads_none_of_its_chunks(tmp_path):
    spec = small_spec()
    cfg = ServerConfig(str(tmp_path / "s" / "s.sock"), chunk_size=CH,
                       tiers=(mc.HostTier(spec.nbytes(CH) * 64),
                              mc.DiskTier(str(tmp_path / "disk"), 1 << 24,
                                          write_through=True)))
    toks = np.arange(CH * 3, dtype=np.int32)
    kv = torch.randn(spec.shape(len(toks))).to(spec.dtype)
    async with Server(cfg) as srv:
        caches = srv._caches
        victim = await caches.acquire(("n", spec, CH, "alice", OTHER))
        assert await victim.put(toks, kv) == len(toks)
        await victim.flush()
        await caches.close_all()  # the victim's chunks are on disk only now
        forger = await caches.acquire(("n", spec, CH, f"uid:{OTHER}:alice", OWN))
        assert await forger.lookup(toks) == 0
        again = await caches.acquire(("n", spec, CH, "alice", OTHER))
        assert await again.lookup(toks) == len(toks)  # the victim's own chunks are still there


def test_the_default_cache_of_the_servers_uid_stays_unsalted():
    assert peer_salt(OWN, None, OWN) is None
    assert peer_salt(OTHER, None, OWN) is not None
    assert peer_salt(OWN, "alice", OWN) != peer_salt(OTHER, "alice", OWN)


identities = st.tuples(st.integers(0, 2**32 - 1), st.none() | st.text(min_size=1))


@given(identities, identities)
def test_two_identities_never_share_a_salt(a, b):
    if a != b:
        assert peer_salt(*a, OWN) != peer_salt(*b, OWN)
