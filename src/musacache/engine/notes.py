"""Delete notes: the deletes a close cut short, kept by the storage tiers that persist them
and finished at the next open, before the cache serves its first read.

A close never finishes a delete or a clear on the loop: past ``close_timeout`` their rest is
abandoned (:func:`musacache.engine.tasks.run_steps`). Memory goes with the cache anyway;
what a storage tier still holds would come back at the next start, so each tier that keeps
notes (:attr:`StorageTier.keeps_delete_notes`, the disk tier) is given, durably, the
prompts whose delete was cut and the keys of the objects whose delete never ran.
``Cache.open`` replays them (:func:`replay`) once the tiers are learned, and the note is
dropped when the deletes it caused have run. A tier that cannot keep a note (S3) has its
share counted in ``CloseReport.deletes_abandoned``.

Format: ``MAGIC``, the prompt and key counts, each prompt's token count, the tokens (int32,
little-endian), the keys, and a digest of all of it (a note that fails it is not replayed).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import numpy as np

from musacache._keys import KEY_BYTES
from musacache.engine.removal import delete, dismantle

if TYPE_CHECKING:
    from musacache.engine.core import Engine
    from musacache.engine.directory import Directory
    from musacache.engine.tierstate import StoreTier
    from musacache.stats import CloseReport

__all__ = ["DeleteNote", "decode", "encode", "note_cut", "replay"]

log = logging.getLogger("musacache")

MAGIC = b"musacache delete notes 1\n"
_COUNTS = struct.Struct("<QQ")
_DIGEST = 16


@dataclass
class DeleteNote:
    """What a note holds: prompts to delete again, and object keys to delete."""

    prompts: list[np.ndarray] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts) + len(self.keys)


class NoteError(ValueError):
    """A note that cannot be read (torn, or not a note)."""


def encode(note: DeleteNote) -> bytes:
    """The bytes of ``note`` (in a worker thread: a long prompt's tokens are copied)."""
    lens = np.array([len(p) for p in note.prompts], dtype="<u8")
    toks = (np.concatenate(note.prompts).astype("<i4", copy=False) if note.prompts
            else np.zeros(0, dtype="<i4"))
    body = b"".join((MAGIC, _COUNTS.pack(len(note.prompts), len(note.keys)), lens.tobytes(),
                     toks.tobytes(), b"".join(note.keys)))
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def decode(blob: bytes) -> DeleteNote:
    """The note in ``blob``; :class:`NoteError` if it is not a whole note."""
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _COUNTS.size + _DIGEST \
            or hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise NoteError("not a whole delete note")
    at = len(MAGIC)
    n_prompts, n_keys = _COUNTS.unpack_from(body, at)
    at += _COUNTS.size
    lens = np.frombuffer(body, dtype="<u8", count=n_prompts, offset=at)
    at += 8 * n_prompts
    total = int(lens.sum())
    if len(body) != at + 4 * total + KEY_BYTES * n_keys:
        raise NoteError("a delete note of the wrong length")
    toks = np.frombuffer(body, dtype="<i4", count=total, offset=at).astype(np.int32)
    at += 4 * total
    bounds = np.cumsum(lens)
    prompts = [toks[int(b - n) : int(b)] for n, b in zip(lens, bounds, strict=True)]
    keys = [body[at + i * KEY_BYTES : at + (i + 1) * KEY_BYTES] for i in range(n_keys)]
    return DeleteNote(prompts, keys)


def _stored_keys(dirs: Sequence[Directory], st: StoreTier, now: Directory) -> list[bytes]:
    """The keys ``st`` holds among ``dirs``' entries, less those a newer entry of ``now``
    (the directory in use) holds there (in a worker thread: a Python loop, so the loop's
    thread gets the interpreter back between its steps)."""
    return [k for d in dirs for k, e in d.entries.items()
            if e.stored_size(st.idx) is not None and not _held(st, now, k)]


def _held(st: StoreTier, now: Directory, key: bytes) -> bool:
    e = now.get(key)
    return e is not None and not e.dead and st.holds(e)


async def note_cut(eng: Engine, report: CloseReport, batch: int) -> None:
    """At a close, once the cache's tasks have ended: note on each storage tier that keeps
    notes the deletes cut short (prompts, clears' stored keys, object deletes that never
    ran), count them in ``report``, and let go of the abandoned work off the loop (old
    directories ``batch`` entries per loop turn)."""
    cut = eng.cut
    prompts = list(cut.prompts.values())
    cleared = list(cut.cleared.values())
    report.deletes_cut += len(prompts) + len(cleared)
    for st in eng.stores:
        keys, st.cut_deletes = st.cut_deletes, []
        report.object_deletes_cut += len(keys)
        # Deletes the store refused (the objects may still be there), unless written since.
        keys += [k for k in st.undeleted if not _held(st, eng.dir, k)]
        if cleared:
            keys += await eng.mover.in_thread(partial(_stored_keys, cleared, st, eng.dir))
        note = DeleteNote(prompts, keys)
        if not note and not st.notes_held:
            continue
        if not st.store.keeps_delete_notes:
            report.deletes_abandoned += len(note)
            continue
        try:
            blob = await eng.mover.in_thread(partial(encode, note)) if note else None
            with anyio.fail_after(st.store.timeout):
                await st.store.write_delete_notes(blob)
            st.notes_held = bool(note)
            report.deletes_noted += len(note)
        except Exception as e:  # a tier that cannot write its note loses those deletes
            report.deletes_abandoned += len(note)
            eng.cold.errlog.warn(st.name, "delete note", repr(e))
    cut.prompts.clear()
    steps, cut.steps = cut.steps, []
    # A delete's steps hold its prompt's keys (sets of 100,000s): freed in a worker thread,
    # one delete per hop, so that the loop runs between them.
    while steps:
        close = getattr(steps.pop(), "close", None)
        if close is not None:
            await eng.mover.in_thread(close)
        del close
    while cut.cleared:
        await dismantle(cut.cleared.popitem()[1], batch)


async def replay(eng: Engine, batch: int) -> None:
    """At open, once every storage tier is learned: do what the tiers' notes say (each
    prompt deleted once, each noted key's entry removed), ``batch`` at a time; each note is
    dropped in the background once the deletes it caused have run."""
    done: set[bytes] = set()
    held: list[StoreTier] = []
    for st in eng.stores:
        if not st.store.keeps_delete_notes:
            continue
        try:
            blob = await st.store.read_delete_notes()
            if blob is None:
                continue
            note = await eng.mover.in_thread(partial(decode, blob))
        except Exception as exc:  # a note unread is deletes lost, never a failed open
            eng.cold.errlog.warn(st.name, "delete note", repr(exc))
            note = DeleteNote()
        held.append(st)
        st.notes_held = True
        for toks in note.prompts:
            digest = hashlib.blake2b(toks.tobytes(), digest_size=16).digest()
            if digest not in done:
                done.add(digest)
                await delete(eng, toks, batch)
        for i in range(0, len(note.keys), batch):
            eng.remove([e for k in note.keys[i : i + batch] if (e := eng.dir.get(k))])
            await anyio.lowlevel.checkpoint()
        st.c.notes_replayed += len(note)
    for st in held:
        eng.tasks.spawn(_drop_when_done, st, list(st.deleting), batch)


async def _drop_when_done(st: StoreTier, keys: list[bytes], batch: int) -> None:
    """Drop ``st``'s note once every delete of ``keys`` has run (a close before then writes
    the note again, with what is left)."""
    for i, key in enumerate(keys):
        if i and not i % batch:
            await anyio.lowlevel.checkpoint()
        last = st.last_link(key)
        if last is not None:
            await last.wait()
    await st.store.write_delete_notes(None)
    st.notes_held = False
