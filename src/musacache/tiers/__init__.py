"""Tiers: memory tiers (device, host) and storage tiers (disk, S3, plug-ins).

The public names are re-exported from :mod:`musacache`.

This package owns the registry of tier *kinds*: the ``kind = "disk"`` of a ``[[tiers]]`` table
names a config class here. The built-in storage kinds are recorded by module path and imported
only when a config names them, so this module imports none of the tiers (and nothing imports
upward: ``tiers.disk`` and ``tiers.s3`` need neither this registry nor the config loader). The
memory kinds (``host``, ``device``) are registered by :mod:`musacache._config`, which defines
them; a plug-in registers its own with :func:`register_tier_kind`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError

__all__ = ["register_tier_kind", "tier_kind", "tier_kinds"]

#: Built-in storage kinds: imported on first use (S3 pulls in aiobotocore).
_BUILTIN: dict[str, tuple[str, str]] = {
    "disk": ("musacache.tiers.disk", "DiskTier"),
    "s3": ("musacache.tiers.s3", "S3Tier"),
}
_registered: dict[str, Callable[..., Any]] = {}


def register_tier_kind(kind: str, config_cls: Callable[..., Any]) -> None:
    """Let ``kind = "<kind>"`` in TOML or ``MUSACACHE_TIERS__N__KIND`` build ``config_cls``.

    ``config_cls`` is called with the table's other settings as keyword arguments and must
    return a memory tier config or a :class:`~musacache.tiers.base.TierConfig` (an object
    with ``name`` and ``build()``). Registering a kind again replaces it.
    """
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"a tier kind must be a non-empty string, got {kind!r}")
    if not callable(config_cls):
        raise ConfigError(f"tier kind {kind!r}: {config_cls!r} is not callable")
    _registered[kind] = config_cls


def tier_kinds() -> list[str]:
    """The kind names that a config may use, sorted."""
    return sorted({*_BUILTIN, *_registered})


def tier_kind(kind: str) -> Callable[..., Any]:
    """The config class registered for ``kind``; :class:`ConfigError` for an unknown kind."""
    found = _registered.get(kind)
    if found is not None:
        return found
    where = _BUILTIN.get(kind) if isinstance(kind, str) else None
    if where is None:
        raise ConfigError(f"unknown tier kind {kind!r}; known kinds: {tier_kinds()}")
    module, name = where
    try:
        config_cls: Callable[..., Any] = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"tier kind {kind!r} needs a module that cannot be imported: "
                          f"{e}") from e
    _registered[kind] = config_cls
    return config_cls
