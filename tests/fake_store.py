"""An in-memory StorageTier with fault injection, for engine tests of the storage path.

It is also the smallest example of a plug-in tier: four methods over a dict.
"""

from __future__ import annotations

import anyio

import musacache as mc
from musacache.codec import read_header


class MemStore(mc.StorageTier):
    def __init__(self, objects: dict[bytes, bytes] | None = None, *, name: str = "mem",
                 capacity_bytes: int | None = None, write_through: bool = False,
                 timeout: float = 2.0, codec: str = "lz4", shared: bool = False) -> None:
        self.objects = {} if objects is None else objects
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.write_through = write_through
        self.timeout = timeout
        self.codec = codec
        self.shared = shared
        self.fail_reads = False
        self.fail_writes = False
        self.read_delay = 0.0
        self.write_delay = 0.0
        self.reads = self.writes = self.deletes = 0
        self.started = self.closed = False

    async def start(self, ctx: mc.TierContext) -> list[mc.ChunkMeta]:
        self.started = True
        return self._metas(None)

    def _metas(self, parent: bytes | None) -> list[mc.ChunkMeta]:
        out = []
        for obj in self.objects.values():
            try:
                h = read_header(obj)
            except mc.MusaCacheError:
                continue
            m = h.meta(stored_bytes=len(obj))
            if parent is None or m.parent == parent:
                out.append(m)
        return out

    async def refresh(self, parent: bytes | None = None) -> list[mc.ChunkMeta]:
        return self._metas(parent)

    async def aclose(self) -> None:
        self.closed = True

    async def write(self, meta: mc.ChunkMeta, obj: bytes) -> None:
        if self.write_delay:
            await anyio.sleep(self.write_delay)
        if self.fail_writes:
            raise mc.TierError("injected write fault")
        self.writes += 1
        self.objects[meta.key] = bytes(obj)

    async def read(self, meta: mc.ChunkMeta) -> bytes | None:
        if self.read_delay:
            await anyio.sleep(self.read_delay)
        if self.fail_reads:
            raise mc.TierError("injected read fault")
        self.reads += 1
        return self.objects.get(meta.key)

    async def delete(self, key: bytes) -> None:
        self.deletes += 1
        self.objects.pop(key, None)
