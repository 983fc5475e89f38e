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
