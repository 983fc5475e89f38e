"""Key-addressed pages: the part of the core an engine that hashes its own pages uses.

SGLang's HiCache (and engines like it) name each page of KV by a hash it computed itself over
the page's tokens and every page before it, and never hand the tokens over. A page is then
stored under ``blake2b(seed || len || engine key)``: the seed is the cache's fingerprint seed
(namespace, KV spec, chunk size, format version, tenant), so pages of another model, shape or
rank never collide, exactly as token chunks do. A page is one chunk of ``chunk_size`` tokens,
so pages live in the same slots, tiers, eviction order, codec and storage objects as token
chunks. Each page's parent is the page before it in the call (or ``after``), so the
leaves-first eviction drops a sequence's tail before its head. The first page hangs from a
page root no token chain reaches, so a token prompt never matches a page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import anyio.lowlevel
import torch

from musacache._errors import DTypeError, InvalidInputError, ShapeError
from musacache._keys import KEY_BYTES
from musacache._spec import KVSpec, check_has_data, check_plain_values, check_writable, dtype_name

__all__ = ["PAGE_RUN", "PageSource", "check_pages", "check_pages_paced", "first_missing_page",
           "page_keys", "page_keys_paced", "paced"]

#: Pages checked or hashed per turn of the loop (about 1 ms of it): a call that names tens
#: of thousands of pages leaves the loop to others between runs.
PAGE_RUN: Final = 512


async def paced(steps: Iterator[object]) -> None:
    """Drive ``steps`` to its end, with a turn of the loop between them."""
    for _ in steps:
        await anyio.lowlevel.checkpoint()


def _page_key(seed: bytes, key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else bytes(key)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"musacache-page")
    h.update(seed)
    h.update(len(raw).to_bytes(4, "little"))
    h.update(raw)
    return h.digest()


def page_root(seed: bytes) -> bytes:
    return hashlib.blake2b(seed, digest_size=KEY_BYTES, person=b"musacache-pgrt").digest()


def page_keys(seed: bytes, keys: Sequence[str | bytes], chunk_size: int,
              after: str | bytes | None = None) -> list[tuple[int, int, bytes, bytes]]:
    """``(start, end, parent, key)`` per page, as the token key chain gives per chunk."""
    out: list[tuple[int, int, bytes, bytes]] = []
    for _ in _page_key_steps(seed, keys, chunk_size, after, out):
        pass
    return out


async def page_keys_paced(seed: bytes, keys: Sequence[str | bytes], chunk_size: int,
                          after: str | bytes | None = None,
                          ) -> list[tuple[int, int, bytes, bytes]]:
    """:func:`page_keys`, :data:`PAGE_RUN` keys per turn of the loop."""
    out: list[tuple[int, int, bytes, bytes]] = []
    await paced(_page_key_steps(seed, keys, chunk_size, after, out))
    return out


async def first_missing_page(seed: bytes, keys: Sequence[str | bytes],
                             has: Callable[[bytes], bool]) -> int:
    """The index of the first of ``keys`` whose page ``has`` denies (``len(keys)`` if none):
    a key is hashed only once the pages before it were found, :data:`PAGE_RUN` per turn of
    the loop, and no list of the keys is kept."""
    await paced(_check_key_steps(keys))
    for i, k in enumerate(keys):
        if i and not i % PAGE_RUN:
            await anyio.lowlevel.checkpoint()
        if not has(_page_key(seed, k)):
            return i
    return len(keys)


def _check_key_steps(keys: Sequence[str | bytes]) -> Iterator[None]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidInputError(f"keys must be a sequence of str or bytes, got "
                                f"{type(keys).__name__}")
    for i, k in enumerate(keys):
        if i and not i % (PAGE_RUN * 16):
            yield None
        if not isinstance(k, (str, bytes)) or not k:
            raise InvalidInputError(f"keys[{i}] must be a non-empty str or bytes, got {k!r}")


def _page_key_steps(seed: bytes, keys: Sequence[str | bytes], chunk_size: int,
                    after: str | bytes | None,
                    out: list[tuple[int, int, bytes, bytes]]) -> Iterator[None]:
    yield from _check_key_steps(keys)
    parent = page_root(seed) if after is None else _page_key(seed, after)
    for i, k in enumerate(keys):
        if i and not i % PAGE_RUN:
            yield None
        key = _page_key(seed, k)
        out.append((i * chunk_size, (i + 1) * chunk_size, parent, key))
        parent = key


def check_pages(pages: Any, count: int, spec: KVSpec, chunk_size: int, what: str, *,
                writes: bool = False) -> None:
    """Every page a dense CPU-or-device tensor of ``spec.dtype`` with the elements of one
    chunk, its memory there and holding its values as they are; with ``writes`` (``outs``),
    also one the cache can write into in place (:func:`~musacache._spec.check_writable`)."""
    for _ in _check_steps(pages, count, spec, chunk_size, what, writes):
        pass


async def check_pages_paced(pages: Any, count: int, spec: KVSpec, chunk_size: int, what: str,
                            *, writes: bool = False) -> None:
    """:func:`check_pages`, :data:`PAGE_RUN` pages per turn of the loop."""
    await paced(_check_steps(pages, count, spec, chunk_size, what, writes))


def _check_steps(pages: Any, count: int, spec: KVSpec, chunk_size: int, what: str,
                 writes: bool) -> Iterator[None]:
    if isinstance(pages, torch.Tensor) or not isinstance(pages, Sequence):
        raise InvalidInputError(f"{what} must be a sequence of tensors, got "
                                f"{type(pages).__name__}")
    if len(pages) != count:
        raise InvalidInputError(f"{count} keys but {len(pages)} {what}")
    numel = spec.nbytes(chunk_size) // spec.dtype.itemsize
    for i, p in enumerate(pages):
        if i and not i % PAGE_RUN:
            yield None
        if not isinstance(p, torch.Tensor):
            raise InvalidInputError(f"{what}[{i}] is a {type(p).__name__}, not a tensor")
        if p.dtype != spec.dtype:
            raise DTypeError(f"{what}[{i}] has dtype {dtype_name(p.dtype)}, the cache holds "
                             f"{dtype_name(spec.dtype)}")
        if p.numel() != numel:
            raise ShapeError(f"{what}[{i}] has {p.numel()} elements (shape "
                             f"{tuple(p.shape)}); a page of this cache has {numel} "
                             f"({chunk_size} tokens of {spec.describe()})")
        name = f"{what}[{i}]"
        check_has_data(p, name)
        check_plain_values(p, name)
        if writes:
            check_writable(p, name)
        KVSpec.check_memory(p, what=name)


def as_page(dst: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``dst`` (a whole chunk slot, contiguous) seen with ``like``'s shape."""
    return dst.view(like.shape)


class PageSource:
    """The pages of a ``put_pages``, in the order of their keys (a ``ChunkSource``)."""

    def __init__(self, pages: Sequence[torch.Tensor], chunk_size: int) -> None:
        # Detached: pages that require grad are cached by their values (a copy into a slot,
        # which autograd would refuse to record).
        self.pages = [p.detach() if p.requires_grad else p for p in pages]
        self.chunk_size = chunk_size

    async def move(self, mover: Any, parts: Sequence[tuple[int, int, torch.Tensor]]) -> None:
        await mover.copy([(as_page(dst, self.pages[s // self.chunk_size]),
                           self.pages[s // self.chunk_size]) for s, _n, dst in parts])
