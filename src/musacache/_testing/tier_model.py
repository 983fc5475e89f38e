"""A seeded model check of a storage tier: nothing lost, nothing resurrected.

It drives one tier with random writes, deletes and re-writes of a few keys, issued so that
many overlap (the backend is slowed down at random by the caller's ``slow_down`` hook), then
restarts it (a new store over the same folder or bucket) and compares what the restarted store
lists and reads with a model. The model is what the tier contract promises: a key's
operations take effect in the order they were called, and a write stores its bytes whatever
the key held before. So after a round, a key whose last call was a write holds exactly that
write's bytes, and a key whose last call was a delete is gone.

* **lost**: the model holds the key, the restarted store does not list it (or reads other bytes);
* **resurrected**: the model deleted the key, the restarted store still lists it;
* **wrong reads**: a read during the run returned bytes that no write of that key ever stored.

Used by the disk and S3 tier tests; the engine has its own model check over whole caches.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import torch

from .._keys import Fingerprint
from .._spec import KVSpec
from ..codec import encode_chunk
from ..tiers.base import ChunkMeta, StorageTier, TierContext

__all__ = ["ModelReport", "check_tier_model"]

SPEC = KVSpec(2, 2, 16, torch.bfloat16)
FINGERPRINT = Fingerprint("tier-model", SPEC, 16)


@dataclass
class ModelReport:
    rounds: int = 0
    writes: int = 0
    deletes: int = 0
    reads: int = 0
    #: The most operations of one key that were in flight at once (the check means little
    #: unless they overlap).
    max_overlap: int = 0
    lost: list[str] = field(default_factory=list)
    resurrected: list[str] = field(default_factory=list)
    wrong_reads: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.resurrected or self.wrong_reads)


def _variants(num_keys: int, per_key: int) -> tuple[list[ChunkMeta], list[list[bytes]]]:
    """``num_keys`` chunk metas and, for each, ``per_key`` objects of equal size and different
    bytes (raw codec): a stale object cannot pass for the newer one by its size."""
    metas: list[ChunkMeta] = []
    objects: list[list[bytes]] = []
    parent = hashlib.blake2b(b"tier-model-root", digest_size=32).digest()
    for k in range(num_keys):
        key = hashlib.blake2b(f"tier-model-{k}".encode(), digest_size=32).digest()
        meta = ChunkMeta(key, parent, 16, SPEC.nbytes(16))
        metas.append(meta)
        objects.append([encode_chunk(FINGERPRINT, meta,
                                     torch.full(SPEC.shape(16), float(v + 1) * (k + 1),
                                                dtype=SPEC.dtype), "raw")
                        for v in range(per_key)])
    return metas, objects


async def check_tier_model(make_store: Callable[[], Awaitable[StorageTier]],
                           slow_down: Callable[[StorageTier, random.Random], None], *,
                           seed: int, rounds: int = 3, ops_per_round: int = 60,
                           num_keys: int = 5, tenant: str | None = None) -> ModelReport:
    """Run the check. ``make_store()`` returns a built, not started, store over the same
    folder or bucket each time; ``slow_down(store, rng)`` makes its backend operations slow at
    random (a hook per backend: worker-thread sleeps for disk, delayed requests for S3)."""
    rng = random.Random(seed)
    ctx = TierContext(FINGERPRINT, tenant=tenant)
    metas, objects = _variants(num_keys, 3)
    model: dict[int, int | None] = dict.fromkeys(range(num_keys))  # key -> variant or None
    report = ModelReport()
    in_flight = [0] * num_keys

    store = await make_store()
    await store.start(ctx)
    try:
        for _ in range(rounds):
            slow_down(store, rng)

            async def run(k: int, op: Callable[[], Awaitable[object]]) -> None:
                in_flight[k] += 1
                report.max_overlap = max(report.max_overlap, in_flight[k])
                try:
                    await op()
                finally:
                    in_flight[k] -= 1

            async def read(k: int, st: StorageTier = store) -> None:
                got = await st.read(metas[k])
                if got is not None and got not in objects[k]:
                    report.wrong_reads.append(f"key {k}: {len(got)} bytes of no write")

            async with anyio.create_task_group() as tg:
                for _ in range(ops_per_round):
                    k = rng.randrange(num_keys)
                    roll = rng.random()
                    if roll < 0.5:
                        v = rng.randrange(len(objects[k]))
                        model[k] = v
                        report.writes += 1
                        tg.start_soon(run, k, lambda k=k, v=v, st=store: st.write(
                            metas[k], objects[k][v]))
                    elif roll < 0.85:
                        model[k] = None
                        report.deletes += 1
                        tg.start_soon(run, k, lambda k=k, st=store: st.delete(metas[k].key))
                    else:
                        report.reads += 1
                        tg.start_soon(read, k)
                    if rng.random() < 0.5:  # let some operations get under way first
                        await anyio.sleep(rng.uniform(0, 0.004))
            await store.aclose()

            store = await make_store()
            listed = {m.key: m for m in await store.start(ctx)}
            for k, last in model.items():
                name = f"key {k} (round {report.rounds})"
                if last is None:
                    if metas[k].key in listed:
                        report.resurrected.append(name)
                    continue
                if metas[k].key not in listed:
                    report.lost.append(f"{name}: not listed")
                    continue
                got = await store.read(listed[metas[k].key])
                if got != objects[k][last]:
                    which = "absent" if got is None else (
                        f"variant {objects[k].index(got)}" if got in objects[k] else "garbage")
                    report.lost.append(f"{name}: holds {which}, the last write was {last}")
            report.rounds += 1
    finally:
        await store.aclose()
    return report
