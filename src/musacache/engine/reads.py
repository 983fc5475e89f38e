"""The engine's reads from its tiers: the top tier's view of a chunk, the chunks of one request
fetched concurrently from below it, and their promotion into it (single-flight per key; a get's
own tensor written by the same read, or read into straight from disk and promoted after the get).

A mixin of :class:`~musacache.engine.core.Engine`, kept apart so that each class stays small: it
uses only the engine state declared below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from musacache._errors import CacheClosedError
from musacache.engine.tierstate import MemTier, StoreTier, Tier

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from musacache._config import CacheConfig
    from musacache.engine.directory import Entry, Match
    from musacache.engine.storage import ColdPath
    from musacache.engine.tasks import TaskOwner
    from musacache.engine.tee import Tee
    from musacache.stats import InFlight

__all__ = ["VIEW_RUN", "Flight", "Reads"]

# Chunks a read makes views of, touches or lets go of per turn of the loop.
VIEW_RUN = 256
# Fetches of chunks below the top tier a read starts per turn of the loop.
_FETCH_RUN = 32


class Flight:
    """A promotion in flight; gets and prefetches of the same chunk join it."""

    def __init__(self, entry: Entry) -> None:
        # The entry it reads, not only its key: a chunk deleted and put again has the same key
        # and other bytes, and a get of the new one must never join the old one's read.
        self.entry = entry
        self.done = anyio.Event()
        self.tensor: torch.Tensor | None = None
        self.source = ""
        self.tee: Tee | None = None  # the starting get's tensor for this chunk (_tee)
        # False for the promotion after a read straight into a get's tensor: that read was
        # the hit, this one is not counted again.
        self.counts_hit = True


class Reads:
    """Reading chunks for a request (see the module docstring)."""

    config: CacheConfig
    tiers: list[Tier]
    cold: ColdPath
    tasks: TaskOwner
    flights: dict[bytes, Flight]
    promote_gate: anyio.Semaphore
    inflight: InFlight

    # The engine's, used here.
    def view(self, t: MemTier, e: Entry) -> torch.Tensor:
        raise NotImplementedError

    def pin(self, e: Entry) -> None:
        raise NotImplementedError

    def unpin(self, e: Entry) -> None:
        raise NotImplementedError

    async def relocate(self, items: Sequence[tuple[Entry, torch.Tensor]], dest_from: int,
                       dest_to: int | None = None, *, demoting: bool) -> list[Tier | None]:
        raise NotImplementedError

    def top_view(self, e: Entry) -> tuple[torch.Tensor, str] | None:
        """``e``'s block in the top tier, counted as a hit there; None (a miss there) if it
        lives only lower down."""
        t = self.tiers[0]
        if not isinstance(t, MemTier):
            return None  # a storage tier on top counts its own hits and misses as it reads
        if t.holds(e):
            t.c.hits += 1
            return self.view(t, e), t.name
        t.c.misses += 1
        return None

    async def sources(self, matches: Sequence[Match],
                      tee_for: Callable[[int], Tee | None] | None = None, *,
                      every: bool = False) -> list[tuple[Match, torch.Tensor, str]]:
        """The data of each match (the caller holds pins) up to the first that cannot be read
        (with ``every``: of each match that can, for independent pages); those below the top
        tier fetched concurrently (promoting them, writing the tee ``tee_for(i)`` makes for
        match ``i`` as its fetch starts)."""
        found: list[tuple[torch.Tensor | None, str]] = []
        slow: list[int] = []
        for i, m in enumerate(matches):
            if i and not i % VIEW_RUN:
                # A view costs microseconds: a read of 16,384 chunks made them all in one
                # step (the caller's pins keep every chunk where it is meanwhile).
                await anyio.lowlevel.checkpoint()
            top = self.top_view(m.entry)
            found.append(top if top is not None else (None, ""))
            if top is None:
                slow.append(i)
        if slow:
            # Chunks read straight into their tee are promoted once every read of this
            # request is done: a promotion's second read would otherwise share the CPU with
            # the reads the caller is waiting for.
            promote: list[Entry] = []
            tees = {i: tee_for(i) for i in slow} if tee_for is not None else {}
            # Chunks read straight into their tee from a tier that reads in batches go to it
            # as one batch per tier (one hand-off to its threads for the whole request);
            # the others are fetched one by one, alongside.
            batches: dict[StoreTier, list[tuple[int, Tee]]] = {}
            alone: list[int] = []
            for i in slow:
                tee = tees.get(i)
                tier = self.cold.direct.direct_source(matches[i].entry, tee) \
                    if tee is not None and self.config.promotion == "background" else None
                if tier is not None and tee is not None and tier.store.reads_to_many:
                    batches.setdefault(tier, []).append((i, tee))
                else:
                    alone.append(i)

            async def fetch(i: int, tee: Tee | None, skip: tuple[Tier, ...] = ()) -> None:
                found[i] = await self.fetch(matches[i].entry, tee, promote, skip)

            async def batch(tier: StoreTier, items: list[tuple[int, Tee]],
                            ) -> list[tuple[int, Tee | None, tuple[Tier, ...]]]:
                # The chunks read: their data found. Returns what fetch is to read instead.
                served = await self.cold.direct.read_to_tees(
                    tier, [(matches[i].entry, tee) for i, tee in items])
                again: list[tuple[int, Tee | None, tuple[Tier, ...]]] = []
                for (i, tee), ok in zip(items, served, strict=True):
                    if ok:
                        promote.append(matches[i].entry)
                        found[i] = (tee.dst, tier.name)
                    elif ok is None:  # the batch never started it: read on its own
                        again.append((i, tee, ()))
                    else:  # missed (as fetch handles a direct read that missed)
                        tee.close()
                        again.append((i, None, (tier,)))
                return again

            async def batch_then_fetch(tier: StoreTier, items: list[tuple[int, Tee]],
                                       tg: TaskGroup) -> None:
                for i, tee, skip in await batch(tier, items):
                    tg.start_soon(fetch, i, tee, skip)

            try:
                if len(batches) == 1 and not alone:
                    # The usual get that reaches the disk: its one batch, awaited here (a
                    # task group and a task for it cost the get a loop turn before its
                    # first read), and a task group only for the chunks it did not serve.
                    [(tier, items)] = batches.items()
                    again = await batch(tier, items)
                    if again:
                        async with anyio.create_task_group() as tg:
                            for i, tee, skip in again:
                                tg.start_soon(fetch, i, tee, skip)
                else:
                    async with anyio.create_task_group() as tg:
                        for tier, items in batches.items():
                            tg.start_soon(batch_then_fetch, tier, items, tg)
                        for n, i in enumerate(alone):
                            if n and not n % _FETCH_RUN:
                                # The fetches started so far take their first step before
                                # more are started: a few dozen per turn of the loop.
                                await anyio.lowlevel.checkpoint()
                            tg.start_soon(fetch, i, tees.get(i))
            except BaseExceptionGroup as group:
                # The cache closed under the get (a fetch could start no promotion): the
                # caller gets the one error of the tree it asked for, not a group of them.
                if group.subgroup(lambda e: not isinstance(
                        e, (CacheClosedError, BaseExceptionGroup))) is None:
                    raise CacheClosedError("the cache was closed while the get was "
                                           "reading") from group
                raise
            finally:
                self._promote_read(promote)
        out: list[tuple[Match, torch.Tensor, str]] = []
        for i, (m, (src, name)) in enumerate(zip(matches, found, strict=True)):
            if src is None:
                if every:
                    continue
                break
            if i and not i % VIEW_RUN:
                await anyio.lowlevel.checkpoint()
            out.append((m, src, name))
        return out

    async def fetch(self, e: Entry, tee: Tee | None = None,
                    promote_later: list[Entry] | None = None,
                    skip: tuple[Tier, ...] = ()) -> tuple[torch.Tensor | None, str]:
        """Data of ``e`` from below the top tier, promoting it on the way (single-flight),
        from none of the tiers in ``skip``.

        With ``tee``, ``promote_later`` and ``promotion="background"``, a chunk on disk is
        read straight into the tee (:meth:`DirectReads.read_to_tee`) and appended to
        ``promote_later``, for the caller to promote by a second read once its reads are
        done."""
        if tee is not None and promote_later is not None \
                and self.config.promotion == "background":
            served, tried = await self.cold.direct.read_to_tee(e, tee)
            if served and tried is not None:
                promote_later.append(e)
                return tee.dst, tried.name
            if tried is not None:
                # A missed (or timed-out, still running) read: its tee is closed so that
                # nothing more is written into it and it never counts as complete; the move
                # copies the chunk from wherever the promotion below finds it.
                tee.close()
                tee, skip = None, (tried,)
        flight = self.promotion(e, tee, skip)
        await flight.done.wait()
        return flight.tensor, flight.source

    def _promote_read(self, entries: Sequence[Entry]) -> None:
        """Start the promotion of chunks a get read straight into its tensor (their read was
        the hit: not counted again). Skipped for a chunk deleted meanwhile, and once the
        cache is closing (a promotion only saves a later read)."""
        # One background task starts them all, at the loop's next turn: a task each,
        # spawned here, would cost the get about 25 µs per chunk before it returns, and
        # the one task 25 µs more.
        if any(not e.dead for e in entries):
            try:
                self.tasks.spawn_soon(self._promote_all, list(entries))
            except CacheClosedError:
                return

    async def _promote_all(self, entries: list[Entry]) -> None:
        for e in entries:
            if not e.dead:
                try:
                    self.promotion(e, counts_hit=False)
                except CacheClosedError:
                    return

    def promotion(self, e: Entry, tee: Tee | None = None, skip: tuple[Tier, ...] = (), *,
                  counts_hit: bool = True) -> Flight:
        """Join or start the promotion of ``e`` into the top tier (a started one also writes
        ``tee``, does not read from the tiers in ``skip``, and counts its read as a hit of
        the tier it came from unless ``counts_hit`` is False)."""
        top = self.tiers[0]
        if isinstance(top, MemTier) and top.holds(e):
            f = Flight(e)
            f.tensor, f.source = self.view(top, e), top.name
            f.done.set()
            return f
        joined = self.flights.get(e.key)
        if joined is not None and joined.entry is e:
            return joined
        # (A flight of a deleted entry under the same key runs on for its own readers; this
        # one takes the key's place.)
        f = Flight(e)
        f.tee = tee
        f.counts_hit = counts_hit
        self.flights[e.key] = f
        self.tasks.spawn(self._promote, e, f, skip)
        return f

    async def _promote(self, e: Entry, f: Flight, skip: tuple[Tier, ...] = ()) -> None:
        self.pin(e)
        self.inflight.promotions += 1
        try:
            # A few at a time: a get or prefetch that starts a promotion per chunk of a long
            # prompt had every one of them reserve its slot (and evict for it) in one turn of
            # the loop before any waited for a read (a loop gap of 130 ms
            # for 1,000 chunks, 380 ms for a prefetch). Waiting here costs a parked step each.
            async with self.promote_gate:
                await self._promote_now(e, f, skip)
        except Exception as exc:  # a fault below the top tier is a miss, never a crash
            self.cold.errlog.warn("engine", "promotion", repr(exc))
            f.tensor = None
        finally:
            self.inflight.promotions -= 1
            if self.flights.get(e.key) is f:  # not a newer entry's flight under the key
                del self.flights[e.key]
            f.done.set()
            self.unpin(e)

    async def _promote_now(self, e: Entry, f: Flight, skip: tuple[Tier, ...]) -> None:
        got, source, tried = await self.cold.promote_decoding(e, f.tee, skip,
                                                              counts_hit=f.counts_hit)
        if got is not None:
            f.tensor, f.source = got, source
            return
        data, src = await self.read_lower(e, skip=(*skip, tried) if tried else skip)
        f.tensor = data
        top = self.tiers[0]
        if data is not None and isinstance(top, MemTier) and not e.dead and not top.holds(e):
            where = await self.relocate([(e, data)], 0, 1, demoting=False)
            if where[0] is top:
                f.tensor = self.view(top, e)
        if src is not None:
            if f.counts_hit:
                src.c.hits += 1
            f.source = src.name

    async def read_lower(self, e: Entry, skip: tuple[Tier, ...] = (),
                         ) -> tuple[torch.Tensor | None, Tier | None]:
        """The data of ``e`` from the hottest tier that can produce it (other than those in
        ``skip``)."""
        for t in self.tiers:
            if t in skip:
                continue
            if isinstance(t, MemTier):
                if t.holds(e):
                    return self.view(t, e), t
            elif t.holds(e):
                data = await self.cold.read(t, e)
                if data is not None:
                    return data, t
        return None, None

    async def read_entry(self, e: Entry) -> torch.Tensor | None:
        top = self.top_view(e)
        return top[0] if top is not None else (await self.fetch(e))[0]
