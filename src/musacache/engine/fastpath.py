"""The direct read path of ``Cache.get`` and ``Cache.lookup`` for small requests (issue 12,
"small ops").

The general read path (``Engine.match``, pins, ``Engine.sources``, ``Mover.copy``) makes a
torch view of every chunk it reads and of every part of ``out`` it writes, and a torch view
costs 3 to 5 µs on this build of torch: a one-chunk get of a tiny spec cost 60 µs there.
The common case needs none of it. When every matched chunk is resident in a host top tier,
the request's bytes are below ``inline_copy_bytes`` (the general path would copy them on the
loop too) and ``out`` (if given) is a plain host tensor of the exact shape, this path does:

* the key chain over the prompt's token bytes, one dict probe per chunk;
* checks of ``out`` on plain attributes (type, layout, device, dtype, shape, grad);
* ``memmove`` (``mc_copy_bytes``, one native call) between addresses: the slot's address is
  its segment's base address (kept as an int by the pool) plus its offset, and every write
  stays inside ``out``, whose shape, dtype and contiguity were checked first. An ``out`` with
  other strides (proven not to overlap itself) gets one torch copy per chunk;
* the same LRU touches and counters as the general path.

A match that ends inside a prefix of a child chunk is found by the matcher's own helper
(``Directory._best_prefix_child``). Anything else (a chunk below the top tier, one learned
from a listing whose tokens are unknown, a shared tier that may know more on a miss, a device
tier or ``out``, a large request, any ``out`` the general checks would refuse) returns None
and the caller takes the general path, which also raises the typed error. Nothing is
written and nothing is counted before this path has decided to serve the request, so falling
back is always clean.

No pin is taken: nothing here awaits, so from the dict probe to the last byte copied no other
task runs, and no eviction, delete or demotion can touch the chunk in between.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
from typing import Any

import numpy as np
import torch

from musacache import _native
from musacache._keys import KEY_BYTES, as_tokens
from musacache._spec import may_overlap, storage_short
from musacache.engine import move as _move
from musacache.engine.core import Engine
from musacache.engine.directory import _TIER_BITS, _TIER_MASK, Entry
from musacache.engine.tierstate import MemTier

__all__ = ["FastPath"]

# The most chunks one request may span here: beyond that the key chain and the per-chunk work
# dominate anyway, and the general path is no slower per chunk.
_MAX_CHUNKS = 32
# The most memmove calls one request may make (a chunk that is not the whole of ``out`` is
# one call per layer and K/V row); beyond that one torch copy per chunk is cheaper.
_MAX_MEMMOVES = 64
# Token counts whose output template is kept (each a tensor object of a few hundred bytes).
_MAX_TEMPLATES = 64
_I4 = np.dtype("<i4")
_LITTLE = sys.byteorder == "little"

# The key chain's hash, parameters set once: copying a hasher costs less than making one
# (the first chunk's copy already holds the seed, its parent).
_EMPTY_HASH = hashlib.blake2b(digest_size=KEY_BYTES)


def _ctypes_copy(dst: int, src: int, n: int) -> int:
    ctypes.memmove(dst, src, n)
    return 0


# A cffi call with three ints is about 0.15 µs, ctypes.memmove about 0.6. A native module
# built before mc_copy_bytes existed still works (through ctypes) until it is rebuilt.
_copy_bytes = getattr(_native.lib, "mc_copy_bytes", None) or _ctypes_copy
# Autograd's record that a tensor was written in place (``copy_`` bumps it too): a graph that
# saved ``out`` for its backward pass then refuses to run on the new values.
_bump_version = torch._C._increment_version
_inference_mode = torch.is_inference_mode_enabled
_Tensor = torch.Tensor
_strided = torch.strided
_empty_strided = torch.empty_strided
# Named at every allocation: a default device the caller set (torch.set_default_device,
# ``with torch.device(...)``) must not move the host buffer a memmove writes into.
_CPU = torch.device("cpu")
_ndarray = np.ndarray


def token_bytes(tokens: Any) -> bytes:
    """``as_tokens(tokens)`` as int32 little-endian bytes; a 1-D int32 numpy array (the
    common case) without the general conversion. Raises what ``as_tokens`` raises."""
    if type(tokens) is np.ndarray and tokens.dtype is _I4 and tokens.ndim == 1:
        return tokens.tobytes()  # C order whatever the strides
    return as_tokens(tokens).tobytes()


class FastPath:
    """The direct path of one open cache (built by ``Cache.open``, dropped by ``aclose``)."""

    def __init__(self, eng: Engine, ops: dict[str, int], device: torch.device) -> None:
        spec = eng.spec
        self.eng = eng
        self.ops = ops
        self.seed = eng.chain.seed
        self.seed_hash = _EMPTY_HASH.copy()
        self.seed_hash.update(self.seed)
        self.cs = eng.chain.chunk_size
        self.dtype = spec.dtype
        self.td = spec.token_dim
        self.bpt = spec.bytes_per_token
        self.isz = spec.itemsize
        # Dense KV is (rows, T, row) with rows = L*2 (L for MLA): one token's row of one layer
        # and one of K/V is row_bytes; a slot holds (rows, n, row) contiguously.
        self.rows = spec.num_layers * (1 if spec.mla else 2)
        self.row_bytes = spec.row_elems * spec.itemsize
        # The general path copies a request below inline_copy_bytes on the loop as well.
        self.max_bytes = min(eng.mover.inline_bytes, _MAX_CHUNKS * self.cs * self.bpt + 1)
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.templates: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # may_overlap of each strided (not contiguous) ``out`` geometry seen: (shape, strides)
        self.overlaps: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
        top = eng.tiers[0]
        # get is served here only from a host top tier into host memory, asked once the way
        # the data path asks whether a move touches a device; lookup is served for any tiers.
        host = isinstance(top, MemTier) and _move.accelerator_of(
            [torch.empty(0, device=top.device), torch.empty(0, device=device)]) is None
        self.top: MemTier | None = top if host and isinstance(top, MemTier) and _LITTLE \
            else None
        # The tiers below the top: a get touches its chunks in each that holds them.
        self.lower = eng.tiers[1:]

    def _shape(self, n: int) -> tuple[int, ...]:
        shape = self.shapes.get(n)
        if shape is None:
            shape = self.shapes[n] = self.eng.spec.shape(n)
        return shape

    def _walk(self, buf: bytes, n: int, top: int, key0: bytes | None = None,
              ) -> list[tuple[int, int, Entry, int]] | None:
        """What ``Directory.match`` finds for ``buf`` (``n`` tokens), as ``(start, tokens,
        entry, slot)``, or None when the general path must decide. With ``top`` >= 0 every
        match must be resident in memory tier ``top`` (``slot``: its slot there; else -1).
        ``key0``: the first chunk's key, when ``_whole`` has already hashed it."""
        d = self.eng.dir  # asked each time: clear() swaps in a new directory
        shards = d.entries._shards  # KeyTable's shards, indexed here to save a call per chunk
        cs = self.cs
        parent = self.seed
        found: list[tuple[int, int, Entry, int]] = []
        for start in range(0, n, cs):
            end = start + cs if start + cs < n else n
            if start:
                h = _EMPTY_HASH.copy()
                h.update(parent)
                h.update(buf[start * 4 : end * 4])
                key = h.digest()
            elif key0 is None:
                h = self.seed_hash.copy()
                h.update(buf[: end * 4])
                key = h.digest()
            else:
                key = key0
            e = shards[key[0]].get(key)
            last = False
            if e is None:
                if self.eng.shared:
                    return None  # a shared tier may know more: the general path asks it
                if d._kids(parent) is None:
                    return found
                # A child of the same parent that starts with these tokens (the matcher's own
                # rule, through the index of the children) ends the match.
                m = d._best_prefix_child(parent, np.frombuffer(buf, dtype=_I4), start, end)
                if m is None:
                    return found
                e, end, last = m.entry, start + m.num_tokens, True
            elif e._gen < 0 or e.tokens is None:
                return None  # deleted under a reader, or its tokens are still to be learned
            slot = -1
            if top >= 0:
                code = e._mem  # the packed residency (see _directory): one int, most often
                if type(code) is int and code & _TIER_MASK == top:
                    slot = code >> _TIER_BITS
                else:
                    got = e.slot_index(top)
                    if got is None:
                        return None  # below the top tier: a promotion, the general path's
                    slot = got
            found.append((start, end - start, e, slot))
            if last:
                break
            parent = key
        return found

    def _whole(self, buf: bytes, n: int) -> tuple[bytes, Entry | None]:
        """The key of the one chunk ``buf`` (``n`` tokens, at most a chunk), and its entry
        when the matcher would serve it as it is: cached, live, its tokens known (else None,
        and ``_walk`` decides, from that key). One hash and one probe: the small op of
        issue 12, without the general loop's lists, tuples and calls."""
        h = self.seed_hash.copy()
        h.update(buf)
        key = h.digest()
        e = self.eng.dir.entries._shards[key[0]].get(key)
        if e is None or e.num_tokens != n or e._gen < 0 or e.tokens is None:
            return key, None
        return key, e

    def lookup(self, tokens: Any) -> int | None:
        # (token_bytes, inlined: a call is a tenth of a microsecond of a small lookup)
        if type(tokens) is _ndarray and tokens.dtype is _I4 and tokens.ndim == 1:
            buf = tokens.tobytes()
        else:
            buf = as_tokens(tokens).tobytes()
        n = len(buf) >> 2
        key0 = None
        if 0 < n <= self.cs:
            key0, e = self._whole(buf, n)
            if e is not None:
                self.ops["lookups"] += 1
                return n
        elif n > _MAX_CHUNKS * self.cs:
            return None
        found = self._walk(buf, n, -1, key0)
        if found is None:
            return None
        self.ops["lookups"] += 1
        return found[-1][0] + found[-1][1] if found else 0

    def get(self, tokens: Any, out: torch.Tensor | None,
            ) -> tuple[int, torch.Tensor, dict[str, int]] | None:
        """``(num_tokens, kv, tiers)`` of the hit, or None: take the general path."""
        top = self.top
        if top is None:
            return None
        # (token_bytes, inlined: a call is a tenth of a microsecond of a small get)
        if type(tokens) is _ndarray and tokens.dtype is _I4 and tokens.ndim == 1:
            buf = tokens.tobytes()
        else:
            buf = as_tokens(tokens).tobytes()
        if out is not None:
            served = self.serve(buf, out)
            if served is None:
                return None
            if served == len(buf) >> 2:
                return served, out, {top.name: served}
            return served, out.narrow(self.td, 0, served), ({top.name: served} if served
                                                            else {})
        n = len(buf) >> 2
        if n == 0 or n * self.bpt >= self.max_bytes:
            return None
        key0 = None
        if n <= self.cs:
            key0, e = self._whole(buf, n)
            if e is not None:
                code = e._mem
                if type(code) is int and code & _TIER_MASK == top.idx:
                    # empty_strided with the contiguous strides worked out once per width:
                    # 0.5 µs cheaper than empty_like of a template, 0.7 than torch.empty.
                    shape, stride = self.templates.get(n) or self._template(n)
                    dst = _empty_strided(shape, stride, dtype=self.dtype, device=_CPU)
                    self._one(e, n, code >> _TIER_BITS, dst.data_ptr(), False, dst, top)
                    return n, dst, {top.name: n}
        found = self._walk(buf, n, top.idx, key0)
        if found is None:
            return None
        served = found[-1][0] + found[-1][1] if found else 0
        shape, stride = self.templates.get(served) or self._template(served)
        dst = _empty_strided(shape, stride, dtype=self.dtype, device=_CPU)
        if found:
            self._copy(found, dst, served, True, False)
        self._account(found, n, served, top)
        return served, dst, ({top.name: served} if served else {})

    def serve(self, buf: bytes, out: torch.Tensor) -> int | None:
        """``get`` of the prompt ``buf`` (its tokens as int32 little-endian bytes, as
        ``token_bytes`` makes them) into ``out``: the number of tokens written (0: a miss),
        or None: take the general path (nothing written, nothing counted). What the node
        server calls for a buffer it keeps, with the request's bytes as they came: it needs
        the count, not a view of ``out`` nor a tiers dict."""
        top = self.top
        if top is None:
            return None
        n = len(buf) >> 2
        if n == 0 or n * self.bpt >= self.max_bytes:
            return None
        # What check_dense/check_out/_check_kv ask, on plain attributes; any doubt, and the
        # general path decides (and raises the typed error). Each is read at every call: a
        # tensor object can be re-pointed (set_, .data =), resized or made to require grad
        # between two gets, and these reads cost less than remembering them would.
        # A lazily negated view holds the negation of its values (a memmove would not
        # negate); a storage shrunk under the tensor would be written past its end.
        if type(out) is not _Tensor or out.layout is not _strided or not out.is_cpu \
                or out.dtype is not self.dtype or out.requires_grad or out.is_neg() \
                or out.shape != (self.shapes.get(n) or self._shape(n)):
            return None
        bump = True  # autograd's record of the write (see _bump_version)
        if out.is_inference():
            # No version counter to bump; and outside inference_mode torch refuses the
            # write (the general path says so).
            if not _inference_mode():
                return None
            bump = False
        key0 = None
        if out.is_contiguous():
            if out.storage_offset() * self.isz + n * self.bpt > out.untyped_storage().nbytes():
                return None
            dense = True
            if n <= self.cs:
                key0, e = self._whole(buf, n)
                if e is not None:
                    code = e._mem
                    if type(code) is int and code & _TIER_MASK == top.idx:
                        return self._one(e, n, code >> _TIER_BITS, out.data_ptr(), bump, out,
                                         top)
        else:
            # Whether the strides may overlap depends on the shape and strides alone: known
            # once per geometry (the check walks the dims in Python, 2 µs).
            geometry = (out.shape, out.stride())
            overlap = self.overlaps.get(geometry)
            if overlap is None:
                overlap = may_overlap(out)
                if len(self.overlaps) < _MAX_TEMPLATES:
                    self.overlaps[geometry] = overlap
            if overlap or storage_short(out) is not None:
                return None
            dense = False
        found = self._walk(buf, n, top.idx, key0)
        if found is None:
            return None
        served = found[-1][0] + found[-1][1] if found else 0
        if found:
            self._copy(found, out, n, dense, bump)
        self._account(found, n, served, top)
        return served

    def _account(self, found: list[tuple[int, int, Entry, int]], n: int, served: int,
                 top: MemTier) -> None:
        """The general path's counters for a get of ``n`` tokens that served ``found``,
        exactly: the request's tokens, the top tier's hits and bytes out, one move, and the
        LRU touches (children first, parents last, in every tier that holds them)."""
        eng = self.eng
        self.ops["gets"] += 1
        tok = eng.tok
        tok["hit_tokens"] += served
        tok["miss_tokens"] += n - served
        if not found:
            return
        c = top.c
        c["hits"] += len(found)
        c["bytes_out"] += served * self.bpt
        eng.mover.moves += 1
        touch = top.lru.touch
        for _s, _n, _e, slot in reversed(found):
            touch(slot)
        for t in self.lower:
            for _s, _n, e, _slot in reversed(found):
                t.touch(e)

    def _one(self, e: Entry, n: int, slot: int, dptr: int, bump: bool, dst: torch.Tensor,
             top: MemTier) -> int:
        """The get of a prompt of one chunk, ``e`` (from ``_whole``, in ``slot`` of the top
        tier), into C-contiguous ``dst`` (at ``dptr``): one ``memmove``, and what
        ``_account`` counts and touches for it (whose lists, tuples and loops cost more than
        this work). Returns the tokens written, ``n``."""
        pool = top.pool
        seg_no, off = divmod(slot, pool.slots_per_segment)
        nbytes = n * self.bpt
        # The slot holds the chunk as (rows, n, row) and dst is (rows, n, row), contiguous.
        status = _copy_bytes(dptr, pool.seg_addr[seg_no] + off * pool.slot_bytes, nbytes)
        if status:
            _native._check_status(status, "copy_bytes")
        if bump:
            _bump_version((dst,))
        eng = self.eng
        self.ops["gets"] += 1
        eng.tok["hit_tokens"] += n
        c = top.c
        c["hits"] += 1
        c["bytes_out"] += nbytes
        eng.mover.moves += 1
        top.lru.touch(slot)
        for t in self.lower:
            t.touch(e)
        return n

    def _template(self, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``spec.shape(n)`` and its contiguous strides. Kept for the first widths asked (a
        bounded set)."""
        shape = tuple(self._shape(n))
        stride = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            stride[d] = stride[d + 1] * shape[d + 1]
        t = (shape, tuple(stride))
        if len(self.templates) < _MAX_TEMPLATES:
            self.templates[n] = t
        return t

    def _copy(self, found: list[tuple[int, int, Entry, int]], dst: torch.Tensor, width: int,
              dense: bool, bump: bool) -> None:
        """Copy the first ``n`` tokens of each found chunk into tokens ``[start, start+n)`` of
        ``dst`` (``width`` tokens wide, on the host; ``dense``: C-contiguous; ``bump``: record
        the write in ``dst``'s autograd version counter)."""
        top = self.top
        if top is None:
            return
        pool = top.pool
        rows = self.rows
        # A slot holds its chunk as (rows, num_tokens, row) from its address (its segment's
        # base plus its offset; a slot never spans segments), and a dense dst is (rows, width,
        # row): each range below lies inside one slot and inside dst. A chunk that is all of
        # dst is one block; any other, one range per layer and K/V row.
        if dense and len(found) * rows <= _MAX_MEMMOVES:
            sps = pool.slots_per_segment
            slot_bytes = pool.slot_bytes
            addr = pool.seg_addr
            dptr = dst.data_ptr()
            rb = self.row_bytes
            status = 0
            for start, n, e, slot in found:
                seg_no, off = divmod(slot, sps)
                src = addr[seg_no] + off * slot_bytes
                if n == width == e.num_tokens:
                    status |= _copy_bytes(dptr, src, n * self.bpt)
                    continue
                step = e.num_tokens * rb
                for r in range(rows):
                    status |= _copy_bytes(dptr + (r * width + start) * rb, src + r * step,
                                          n * rb)
            if status:
                _native._check_status(status, "copy_bytes")
            if bump:
                _bump_version((dst,))
            return
        td = self.td
        for start, n, e, slot in found:
            src_t = pool.view(slot, self.dtype, self._shape(e.num_tokens))
            if n < e.num_tokens:
                src_t = src_t.narrow(td, 0, n)
            (dst if n == width else dst.narrow(td, start, n)).copy_(src_t)
