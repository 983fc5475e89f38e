"""The public surface is exactly ``musacache.__all__``; everything else is private."""

import types

import musacache


def test_all_is_a_sorted_tuple_of_importable_names():
    assert isinstance(musacache.__all__, tuple)
    assert len(set(musacache.__all__)) == len(musacache.__all__)
    for name in musacache.__all__:
        assert hasattr(musacache, name), name


def test_no_public_name_outside_all():
    public = {n for n in dir(musacache) if not n.startswith("_")}
    # Subpackages become attributes once imported; only the ones we export may be public.
    extra = {n for n in public - set(musacache.__all__)
             if not isinstance(getattr(musacache, n), types.ModuleType)}
    assert extra == set(), f"public names missing from __all__: {sorted(extra)}"


def test_every_error_is_a_musacache_error():
    for name in musacache.__all__:
        obj = getattr(musacache, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, musacache.MusaCacheError), name


def test_core_api_names_exist():
    for name in ("Cache", "CacheConfig", "KVSpec", "HostTier", "DeviceTier", "Hit",
                 "StorageTier", "devices"):
        assert name in musacache.__all__


def test_ipc_exports_memory_and_event_ipc_but_not_the_wire():
    from musacache import ipc

    public = {n for n in dir(ipc) if not n.startswith("_")
              and not isinstance(getattr(ipc, n), types.ModuleType)}
    assert public == set(ipc.__all__)
    assert {"empty_shared", "to_shared", "share", "open_tensor", "MappingTable",
            "IpcEvent", "event_ipc_capability"} <= public
    # Frames, fd passing and the socket plumbing are the server's and client's business.
    for name in ("Connection", "FrameDecoder", "Request", "Reply", "send_with_fds",
                 "recv_with_fds", "peer_credentials", "encode_frame", "MAGIC"):
        assert name not in public, name
