"""Open the key-addressed page store an integration uses: an embedded :class:`Cache`, or a
node server through :class:`Client` (started from a tiers file when none listens)."""

from __future__ import annotations

from typing import Any

import anyio

from musacache.server.spawn import is_listening, spawn

from .._config import CacheConfig, read_toml
from .._errors import ConfigError
from .._spec import KVSpec

__all__ = ["open_page_store"]

# The integration names the cache (model, page shape, rank); a tiers file cannot.
_NAMED_BY_ENGINE = ("namespace", "spec", "chunk_size", "server", "tenant")


def embedded_config(path: str, *, spec: KVSpec, chunk_size: int, namespace: str,
                    ) -> CacheConfig:
    data = read_toml(path, f"musacache config {path}")
    named = sorted(k for k in _NAMED_BY_ENGINE if k in data and k != "server")
    if named:
        raise ConfigError(f"{path}: {named} are chosen by the engine integration (model, page "
                          "shape, rank); the file gives only [[tiers]] and cache options")
    data.pop("server", None)
    return CacheConfig.from_dict({**data, "namespace": namespace, "spec": spec.to_dict(),
                                  "chunk_size": chunk_size})


async def open_page_store(*, spec: KVSpec, chunk_size: int, namespace: str,
                          socket: str | None, config: str | None, timeout: float) -> Any:
    """An open object with ``put_pages``, ``get_pages``, ``exists_pages``, ``clear`` and
    ``aclose``."""
    if socket is not None:
        from musacache.server.client import Client

        if config is not None and not is_listening(socket):
            await anyio.to_thread.run_sync(lambda: spawn(config, socket, detach=True))
        client = Client(socket, spec=spec, namespace=namespace, chunk_size=chunk_size,
                        timeout=timeout)
        await client.open()
        return client
    if config is None:
        raise ConfigError("a page store needs a socket or a config file")
    from musacache.cache import Cache

    cache = Cache(embedded_config(config, spec=spec, chunk_size=chunk_size,
                                  namespace=namespace))
    await cache.open()
    return cache
