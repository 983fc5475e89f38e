"""The scheduler side of the vLLM connector, as plain arithmetic (no vLLM import).

vLLM asks the scheduler-side connector three things per request, on its scheduler thread:

1. ``get_num_new_matched_tokens``: how many tokens past what vLLM already has can be loaded?
   The answer comes from a ``lookup`` on the node server, which must never stall the
   scheduler: the first call starts the lookup and answers ``None`` ("ask again next step");
   a later call, once the lookup is done, answers from its result.
2. ``update_state_after_alloc``: vLLM allocated blocks and settled on ``num_external``
   tokens to load.
3. ``build_connector_meta``: once per step, what the workers must load and save.

With tensor or pipeline parallelism, one more: ``update_connector_output`` hands back, once
every rank's output of a step is in, which step that was (:meth:`SchedulerPlanner.
outputs_seen`). A load can fail on one rank alone, and every rank's forward then computes
over that rank's unloaded blocks (their attention outputs are summed across the ranks), so
what the step computes for that request is wrong on *every* rank, while only the failed rank
knows it. vLLM gathers the failed blocks of all ranks into the step's output and rewinds the
request; the planner holds back a request's saves from the step of its load until that
step's output is in, so that no rank stores the KV computed over a failed load.

:class:`SchedulerPlanner` holds that state per request and turns each step into
:class:`RequestOp` records (tokens, slot mapping, a load range, a save range) that travel to
the workers. It takes the engine's objects duck-typed, so it is tested both with vLLM's own
classes (in the vLLM environment) and with stand-ins.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger("musacache.vllm")

__all__ = ["RequestOp", "SchedulerPlanner", "slots_for", "uncacheable"]

#: Steps built with none of their outputs handed back after which the planner warns: vLLM
#: hands each step's back one or two steps later.
_LAG_WARN_STEPS = 64

#: Starts a lookup of a token prefix; the future's result is the cached prefix length.
StartLookup = Callable[[np.ndarray], "concurrent.futures.Future[int]"]


@dataclass
class RequestOp:
    """One request's work for the workers in one step. Picklable (it crosses processes).

    ``token_ids``/``slot_mapping`` cover the request's tokens ``[0, len)``. The workers
    retrieve ``[load_start, load_end)`` into the pages (the first ``load_start`` tokens are
    vLLM's own: ``skip_prefix``) and store ``[save_start, save_end)`` (the first
    ``save_start`` are in the cache already).
    """

    req_id: str
    token_ids: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    load_start: int = 0
    load_end: int = 0
    save_start: int = 0
    save_end: int = 0

    @property
    def loads(self) -> bool:
        return self.load_end > self.load_start

    @property
    def saves(self) -> bool:
        return self.save_end > self.save_start

    def blocks_of(self, start: int, end: int) -> set[int]:
        """The vLLM block ids that hold tokens ``[start, end)``."""
        slots = self.slot_mapping[start:end]
        return {int(b) for b in np.unique(slots[slots >= 0] // self.block_size)}


def slots_for(block_ids: Sequence[int], block_size: int, num_tokens: int) -> np.ndarray:
    """Slot of each token position ``0..num_tokens-1``: ``block * block_size + offset``."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    need = -(-num_tokens // block_size) if num_tokens else 0
    if len(blocks) < need:
        raise ValueError(f"{num_tokens} tokens need {need} blocks of {block_size}, "
                         f"the request has {len(blocks)}")
    pos = np.arange(num_tokens, dtype=np.int64)
    return blocks[pos // block_size] * block_size + pos % block_size


@dataclass
class _Lookup:
    future: concurrent.futures.Future[int]
    num_tokens: int
    num_computed: int = 0

    def hit(self) -> int:
        """The cached prefix length; a lookup that failed or was cancelled is a miss."""
        if not self.future.done() or self.future.cancelled():
            return 0
        if self.future.exception() is not None:
            return 0
        return int(self.future.result())


@dataclass
class _Tracker:
    """What the scheduler side remembers about a running request."""

    req_id: str
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    #: Tokens ``[0, saved)`` are known to be in the cache (looked up, loaded or stored).
    saved: int = 0
    #: Where the last step left the request's computed tokens, as planned.
    planned: int = 0
    #: With several ranks: the step of the request's last load, whose output (every rank's
    #: failed loads) must be in before the request saves again; 0: none pending.
    held_until: int = 0


@dataclass
class PlannerStats:
    lookups: int = 0
    lookup_failures: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    #: Requests never looked up nor saved: vLLM keys their KV by more than token ids.
    refused: int = 0
    load_tokens: int = 0
    save_tokens: int = 0
    #: Steps in which a request's save waited for the output of the step of its load.
    held_saves: int = 0


class SchedulerPlanner:
    """Per-request trackers and the per-step plan. See the module docstring.

    ``chunk_size`` is the cache's chunk: while a prompt is still being prefilled in several
    steps, only whole chunks are saved (a part chunk would be stored again, longer, next
    step); on the step that finishes the prompt its partial last chunk is saved too, because
    musacache matches partial tails (multi-turn reuse). ``save_decode`` also saves generated
    tokens as they are computed.

    ``ranks`` above 1 (tensor or pipeline parallelism) holds back a request's saves from the
    step of its load until :meth:`outputs_seen` says that step's output is in (see the
    module docstring); :attr:`step` numbers the steps built, from 1.

    ``whole_blocks`` loads and saves whole vLLM blocks only (vLLM's CPU backend: its K
    cache holds each block's keys transposed, so a part of a block read or written as
    token rows is other tokens' bytes; a whole block moves all of them, and comes back
    where it was); ``chunk_size`` must then be a multiple of ``block_size``.
    """

    def __init__(self, *, block_size: int, chunk_size: int, start_lookup: StartLookup,
                 save_decode: bool = False, ranks: int = 1,
                 whole_blocks: bool = False) -> None:
        if block_size <= 0 or chunk_size <= 0:
            raise ValueError(f"block_size and chunk_size must be positive, got {block_size}, "
                             f"{chunk_size}")
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.save_decode = save_decode
        self.ranks = ranks
        self.whole_blocks = whole_blocks
        #: The last step built (its number travels to the workers) and the last step whose
        #: output vLLM has handed back from every rank.
        self.step = 0
        self.seen = 0
        self._start_lookup = start_lookup
        self._lookups: dict[str, _Lookup] = {}
        self._known_cached: dict[str, int] = {}
        self._pending_load: dict[str, tuple[int, int]] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._requests: dict[str, Any] = {}
        self._refused: set[str] = set()
        self.stats = PlannerStats()

    # -- get_num_new_matched_tokens -------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                               ) -> tuple[int | None, bool]:
        """``(tokens to load past num_computed_tokens, False)``, or ``(None, False)`` while
        the lookup is in flight. Loads are synchronous (done in the step's forward), so the
        second element is always False."""
        req_id = request.request_id
        if req_id in self._refused:
            return 0, False
        why = uncacheable(request)
        if why is not None:
            log.debug("musacache: request %s is not cached: it has %s", req_id, why)
            self._refused.add(req_id)
            self.stats.refused += 1
            return 0, False
        tokens = _all_tokens(request)
        if tokens is None:  # prompt embeddings: no token ids to key the cache with
            return 0, False
        self._requests[req_id] = request
        n = len(tokens)
        lk = self._lookups.get(req_id)
        if lk is None or lk.num_tokens != n:
            self.stats.lookups += 1
            self.stats.lookup_tokens += n
            try:
                fut = self._start_lookup(np.asarray(tokens, dtype=np.int32))
            except Exception as e:  # the cache being down never fails a request
                log.debug("musacache lookup for %s not started: %s", req_id, e)
                self.stats.lookup_failures += 1
                fut = concurrent.futures.Future()
                fut.set_result(0)
            lk = self._lookups[req_id] = _Lookup(fut, n)
        lk.num_computed = num_computed_tokens
        if not lk.future.done():
            return None, False
        if not lk.future.cancelled() and lk.future.exception() is not None:
            self.stats.lookup_failures += 1
        return self.loadable(lk.hit(), n, num_computed_tokens), False

    def loadable(self, hit: int, num_tokens: int, num_computed_tokens: int) -> int:
        """Tokens to load: the cached prefix, less one token on a full-prompt hit (vLLM must
        compute at least one token to sample from), less what vLLM already holds; whole
        blocks only with ``whole_blocks``."""
        usable = self._blocks(min(hit, num_tokens - 1))
        return max(0, usable - num_computed_tokens)

    def _blocks(self, tokens: int) -> int:
        """``tokens``, down to a whole number of blocks with ``whole_blocks``."""
        return tokens - tokens % self.block_size if self.whole_blocks else tokens

    # -- update_state_after_alloc -----------------------------------------------------------

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        lk = self._lookups.pop(req_id, None)
        hit = lk.hit() if lk is not None else 0
        self._known_cached[req_id] = hit
        if num_external_tokens > 0 and lk is not None:
            start = lk.num_computed
            self._pending_load[req_id] = (start, start + num_external_tokens)
            self.stats.hit_tokens += num_external_tokens
        else:
            self._pending_load.pop(req_id, None)

    # -- build_connector_meta ---------------------------------------------------------------

    def outputs_seen(self, step: int) -> None:
        """vLLM handed back the output of step ``step`` from every rank: the loads that
        failed in it, on any rank, are known (and the requests over them rewound)."""
        self.seen = max(self.seen, step)

    def build(self, scheduler_output: Any) -> list[RequestOp]:
        """The workers' work for this step: one op per request that loads or saves."""
        self.step += 1
        if self.ranks > 1 and self.step - self.seen == _LAG_WARN_STEPS:
            log.warning("musacache: vLLM has handed back no step of the workers' for %d "
                        "steps: requests that load save nothing until it does",
                        _LAG_WARN_STEPS)
        ops: list[RequestOp] = []
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req_id = new.req_id
            prompt = new.prompt_token_ids
            if prompt is None or req_id in self._refused or uncacheable(new) is not None:
                continue
            tr = _Tracker(req_id, len(prompt), list(new.block_ids[0]),
                          saved=self._blocks(self._known_cached.pop(req_id, 0)))
            self._trackers[req_id] = tr
            tokens = self._tokens_of(req_id, prompt) or prompt
            op = self._op(tr, tokens, new.num_computed_tokens, scheduled.get(req_id, 0),
                          self._pending_load.pop(req_id, None))
            if op is not None:
                ops.append(op)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: Iterable[str] = getattr(cached, "resumed_req_ids", ()) or ()
        for i, req_id in enumerate(cached.req_ids):
            held = self._trackers.get(req_id)
            if held is None:
                continue
            tr = held
            new_blocks = cached.new_block_ids[i]
            num_computed = cached.num_computed_tokens[i]
            if num_computed < tr.planned and req_id not in resumed:
                # vLLM went back: a load failed (it recomputes from the first failed block,
                # and the worker dropped the saves of the step that failed) or drafts were
                # rejected. What follows num_computed is computed again: save it again.
                tr.saved = min(tr.saved, self._blocks(num_computed))
            if req_id in resumed:
                # Preempted and scheduled again: vLLM gives the request's whole block list,
                # and it looked the prefix up again (its blocks were freed). That lookup is
                # what the cache holds: what the planner marked saved may never have been
                # (a step whose load failed saves nothing, and vLLM may have rewound the
                # request and preempted it before a step told the planner so).
                tr.block_ids = list(new_blocks[0]) if new_blocks is not None else []
                tr.saved = self._blocks(self._known_cached.pop(req_id, 0))
            elif new_blocks is not None:
                tr.block_ids.extend(new_blocks[0])
            tokens = self._tokens_of(req_id, None)
            if tokens is None:
                continue
            op = self._op(tr, tokens, num_computed, scheduled.get(req_id, 0),
                          self._pending_load.pop(req_id, None))
            if op is not None:
                ops.append(op)
        for req_id in scheduler_output.finished_req_ids:
            self.forget(req_id)
        return ops

    def _tokens_of(self, req_id: str, fallback: Sequence[int] | None) -> Sequence[int] | None:
        req = self._requests.get(req_id)
        if req is not None:
            toks = _all_tokens(req)
            if toks is not None:
                return toks
        return fallback

    def _op(self, tr: _Tracker, tokens: Sequence[int], num_computed: int, num_scheduled: int,
            load: tuple[int, int] | None) -> RequestOp | None:
        end = num_computed + num_scheduled
        tr.planned = end
        load_start = load_end = 0
        if load is not None:
            load_start, load_end = load[0], min(load[1], num_computed, len(tokens))
            self.stats.load_tokens += max(0, load_end - load_start)
            tr.saved = max(tr.saved, load_end)
            if self.ranks > 1 and load_end > load_start:
                tr.held_until = self.step
        save_start = save_end = 0
        limit = min(end, len(tokens)) if self.save_decode else min(end, tr.prompt_len)
        if limit < tr.prompt_len:
            # The prompt goes on next step: save whole chunks only.
            limit -= limit % self.chunk_size
        limit = self._blocks(limit)
        if tr.held_until > self.seen:
            # What this step computes stands on the load, which another rank may have
            # failed: saved once the load's step is known good (or computed again).
            if limit > tr.saved:
                self.stats.held_saves += 1
            limit = tr.saved
        else:
            tr.held_until = 0
        if limit > tr.saved:
            save_start, save_end = tr.saved, limit
            tr.saved = limit
            self.stats.save_tokens += save_end - save_start
        span = max(load_end, save_end)
        if span == 0 or (load_end <= load_start and save_end <= save_start):
            return None
        try:
            slots = slots_for(tr.block_ids, self.block_size, span)
        except ValueError as e:
            log.warning("musacache: request %s: %s; skipping its load/save", tr.req_id, e)
            return None
        return RequestOp(tr.req_id, np.asarray(tokens[:span], dtype=np.int32), slots,
                         self.block_size, load_start, load_end, save_start, save_end)

    # -- request lifecycle --------------------------------------------------------------------

    def forget(self, req_id: str) -> None:
        """Drop everything held for a finished (or aborted) request."""
        lk = self._lookups.pop(req_id, None)
        if lk is not None:
            lk.future.cancel()
        self._known_cached.pop(req_id, None)
        self._pending_load.pop(req_id, None)
        self._trackers.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._refused.discard(req_id)

    def tracked(self) -> int:
        """Requests with any state held (for leak checks)."""
        return len(set(self._lookups) | set(self._known_cached) | set(self._pending_load)
                   | set(self._trackers) | set(self._requests) | self._refused)


def uncacheable(request: Any) -> str | None:
    """What keys ``request``'s KV besides its token ids, or None.

    vLLM's own block hashes (``generate_block_hash_extra_keys``) fold in the LoRA adapter,
    multimodal inputs, ``cache_salt`` and prompt embeddings: the same token ids then have
    other KV (an adapter on k/v_proj, another image behind the same placeholder ids) or must
    not be shared (a salt isolates tenants). musacache keys chunks by token ids under one
    namespace per rank, so such requests are neither looked up nor saved. Takes a vLLM
    ``Request`` or ``NewRequestData`` (which has no ``cache_salt``: the planner remembers the
    requests it refused at lookup)."""
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "cache_salt", None):
        return "a cache_salt"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


def _all_tokens(request: Any) -> Sequence[int] | None:
    if getattr(request, "prompt_token_ids", None) is None:
        return None
    toks = getattr(request, "all_token_ids", None)
    return toks if toks is not None else request.prompt_token_ids
