"""A small model of vLLM's scheduler driving the connector's SchedulerPlanner.

It makes the objects vLLM hands a connector, either vLLM's own classes (``vllm_kinds()``, in
the vLLM venv) or stand-ins with the same fields (``standin_kinds()``), and walks one request
through prefill (chunked by a token budget), optional preemption and resumption, and decode,
the way vLLM's scheduler calls the three scheduler-side hooks. Every op the planner emits is
recorded for the properties the tests check.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from musacache.integrations._vllm_plan import RequestOp, SchedulerPlanner


@dataclass
class Kinds:
    """Constructors of the objects vLLM hands the connector."""

    request: Any         # (req_id, prompt) -> a request with all_token_ids, append_output
    new_req: Any         # (req_id, prompt, block_ids, num_computed) -> NewRequestData
    cached: Any          # (req_ids, resumed, new_block_ids, num_computed) -> CachedRequestData
    output: Any          # (new, cached, num_scheduled, finished) -> SchedulerOutput


class StandinRequest:
    def __init__(self, req_id: str, prompt: list[int]) -> None:
        self.request_id = req_id
        self.prompt_token_ids = list(prompt)
        self._all = list(prompt)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    def append_output_token_ids(self, tok: int) -> None:
        self._all.append(tok)


@dataclass
class StandinNew:
    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class StandinCached:
    req_ids: list[str]
    resumed_req_ids: set[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]


@dataclass
class StandinOutput:
    scheduled_new_reqs: list[Any]
    scheduled_cached_reqs: Any
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: set[str] = field(default_factory=set)


def standin_kinds() -> Kinds:
    return Kinds(
        request=StandinRequest,
        new_req=lambda rid, prompt, blocks, nc: StandinNew(rid, list(prompt), (blocks,), nc),
        cached=lambda ids, resumed, nb, nc: StandinCached(ids, resumed, nb, nc),
        output=lambda new, cached, sched, fin: StandinOutput(new, cached, sched, fin),
    )


def vllm_kinds() -> Kinds:
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

    def request(rid: str, prompt: list[int]) -> Any:
        return Request(rid, list(prompt), SamplingParams(max_tokens=64), None)

    def new_req(rid: str, prompt: list[int], blocks: list[int], nc: int) -> Any:
        return NewRequestData(req_id=rid, prompt_token_ids=list(prompt), mm_features=[],
                              sampling_params=None, pooling_params=None, block_ids=(blocks,),
                              num_computed_tokens=nc, lora_request=None)

    def cached(ids: list[str], resumed: set[str], nb: list[Any], nc: list[int]) -> Any:
        return CachedRequestData(req_ids=ids, resumed_req_ids=resumed,
                                 new_token_ids=[[] for _ in ids], all_token_ids={},
                                 new_block_ids=nb, num_computed_tokens=nc,
                                 num_output_tokens=[0 for _ in ids])

    def output(new: list[Any], cached_data: Any, sched: dict[str, int], fin: set[str]) -> Any:
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached_data,
                               num_scheduled_tokens=sched,
                               total_num_scheduled_tokens=sum(sched.values()),
                               scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                               finished_req_ids=fin, free_encoder_mm_hashes=[])

    return Kinds(request, new_req, cached, output)


def done(value: int) -> concurrent.futures.Future[int]:
    f: concurrent.futures.Future[int] = concurrent.futures.Future()
    f.set_result(value)
    return f


@dataclass
class Trace:
    ops: list[RequestOp] = field(default_factory=list)
    #: (vLLM's own computed tokens, tokens to load, request length, the cache's hit) per
    #: admission
    admissions: list[tuple[int, int, int, int]] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # per admission
    steps: list[int] = field(default_factory=list)  # per op: the step it was built in


def run_request(kinds: Kinds, *, prompt: list[int], cached_prefix: int, local_prefix: int,
                block_size: int, chunk_size: int, budget: int, preempt_at: int | None,
                decode_steps: int, save_decode: bool = False, pending_polls: int = 1,
                ranks: int = 1, lag: int = 0, whole_blocks: bool = False,
                ) -> tuple[SchedulerPlanner, Trace]:
    """Drive one request through the planner. ``cached_prefix``: what musacache holds of
    the prompt; ``local_prefix``: vLLM's own prefix-cache hit (block aligned here, as vLLM
    presents it). ``preempt_at``: preempt after the step in which this many tokens are
    computed (then resume). ``pending_polls``: times the scheduler asks while the lookup is
    still in flight. ``whole_blocks``: the planner moves whole blocks only (vLLM's CPU
    backend). ``ranks``: the engine's ranks; every rank's output of a step is handed
    back ``lag`` builds after the step's own (0: before the next build, as vLLM schedules
    by default; 1: async scheduling, which plans a step before the last one's output)."""
    lookups: list[concurrent.futures.Future[int]] = []
    # The cache holds the prompt's first cached_prefix tokens, and what the request's saves
    # add to them (a save is stored by the end of its step).
    stored = [cached_prefix]

    def start_lookup(tokens: np.ndarray) -> concurrent.futures.Future[int]:
        f: concurrent.futures.Future[int] = concurrent.futures.Future()
        lookups.append(f)
        f.hit = min(stored[0], len(tokens))  # type: ignore[attr-defined]
        return f

    planner = SchedulerPlanner(block_size=block_size, chunk_size=chunk_size,
                               start_lookup=start_lookup, save_decode=save_decode,
                               ranks=ranks, whole_blocks=whole_blocks)
    req = kinds.request("r1", prompt)
    trace = Trace()
    next_block = [100]

    def alloc(n: int) -> list[int]:
        out = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n + 7  # not contiguous: slot arithmetic must follow the list
        return out

    def admit(first: bool) -> tuple[int, list[int], int]:
        n = len(req.all_token_ids)
        local = min(local_prefix, n - 1) // block_size * block_size if first else 0
        for _ in range(1 + pending_polls):  # the first call starts the lookup
            got = planner.num_new_matched_tokens(req, local)
            assert got == (None, False), got
        lookups[-1].set_result(lookups[-1].hit)  # type: ignore[attr-defined]
        ext, is_async = planner.num_new_matched_tokens(req, local)
        assert ext is not None and is_async is False
        planner.after_alloc(req, ext)
        computed = local + ext
        blocks = alloc(-(-n // block_size))
        trace.admissions.append((local, ext, n, lookups[-1].hit))  # type: ignore[attr-defined]
        trace.block_ids.append(blocks)
        return computed, blocks, ext

    computed, blocks, _ = admit(first=True)
    first_step = True
    resumed_now = False
    decoded = 0
    fresh: list[int] = []  # blocks allocated since the last step, told in new_block_ids
    prompt_len = len(prompt)
    while True:
        n = len(req.all_token_ids)
        todo = n - computed
        sched = min(budget, todo) if computed < prompt_len else 1
        if first_step:
            out = kinds.output([kinds.new_req("r1", prompt, blocks, computed)],
                               kinds.cached([], set(), [], []), {"r1": sched}, set())
        else:
            nb = [(blocks,)] if resumed_now else [(fresh,)] if fresh else [None]
            out = kinds.output([], kinds.cached(["r1"], {"r1"} if resumed_now else set(), nb,
                                                [computed]), {"r1": sched}, set())
        built = planner.build(out)
        for o in built:
            if o.saves and o.save_start <= stored[0]:
                stored[0] = max(stored[0], o.save_end)
        trace.ops.extend(built)
        trace.steps.extend(planner.step for _ in built)
        planner.outputs_seen(planner.step - lag)
        first_step = resumed_now = False
        fresh = []
        computed += sched
        if computed >= n:  # the step sampled a token
            if decoded >= decode_steps:
                break
            req.append_output_token_ids(7)
            decoded += 1
            blocks_needed = -(-len(req.all_token_ids) // block_size)
            if blocks_needed > len(blocks):
                fresh = alloc(1)
                blocks = blocks + fresh
        if preempt_at is not None and computed >= preempt_at:
            preempt_at = None
            computed, blocks, _ = admit(first=False)
            resumed_now = True
    planner.build(kinds.output([], kinds.cached([], set(), [], []), {}, {"r1"}))
    return planner, trace
