"""The vLLM connector's scheduler-side arithmetic (SchedulerPlanner), by properties.

These run with stand-ins for vLLM's objects here; tests/integrations/vllm_connector_cases.py
runs the same properties with vLLM's own classes in the vLLM venv (tests/test_vllm.py).
"""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "integrations"))

from vllm_sim import Trace, done, run_request, standin_kinds

from musacache.integrations._vllm_plan import RequestOp, SchedulerPlanner, slots_for


def check_trace(prompt: list[int], cached_prefix: int, block_size: int, chunk_size: int,
                planner: SchedulerPlanner, trace: Trace, preempted: bool) -> None:
    """The properties every walk through the scheduler must have."""
    ops = trace.ops
    n = len(prompt)
    # What is loaded: the cached prefix, less one token on a full hit, less what vLLM
    # holds; exactly that range, once per admission that loads.
    for local, ext, length, hit in trace.admissions:
        assert ext == max(0, min(hit, length - 1) - local)
    assert trace.admissions[0][3] == min(cached_prefix, n)
    loads = [op for op in ops if op.loads]
    expected = [(local, local + ext) for local, ext, _len, _hit in trace.admissions if ext > 0]
    assert [(op.load_start, op.load_end) for op in loads] == expected
    # Saves: in order, never overlapping, each one that ends before the prompt does ends on
    # a chunk boundary; together they cover the prompt past what the cache held.
    saves = [(op.save_start, op.save_end) for op in ops if op.saves]
    covered = min(cached_prefix, n)
    for lo, hi in saves:
        assert lo == covered, (saves, cached_prefix)
        assert hi == n or hi % chunk_size == 0, (saves, n, chunk_size)
        covered = hi
    assert covered == n
    # Tokens and slots: the request's own tokens, slots through its block list.
    for op in ops:
        span = len(op.token_ids)
        assert list(op.token_ids) == (prompt + [7] * span)[:span]
        assert op.slot_mapping.tolist() == slots_for(
            _blocks_at(trace, op, block_size), block_size, span).tolist()
    assert planner.tracked() == 0


def _blocks_at(trace: Trace, op: RequestOp, block_size: int) -> list[int]:
    """The block list the op's slots must come from (the admission it belongs to)."""
    first = int(op.slot_mapping[0]) // block_size
    for blocks in trace.block_ids:
        if blocks and blocks[0] == first:
            return blocks + list(range(blocks[-1] + 8, blocks[-1] + 8 + 64))
    raise AssertionError(f"op {op} does not start in any admitted block list")


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 1200), cached=st.integers(0, 1300), local=st.integers(0, 1200),
       block_size=st.sampled_from([1, 16, 32]), chunk=st.sampled_from([16, 64, 256]),
       budget=st.sampled_from([1 << 30, 64, 100, 512]),
       polls=st.integers(0, 3))
def test_prefill_loads_and_saves(n: int, cached: int, local: int, block_size: int, chunk: int,
                                 budget: int, polls: int) -> None:
    cached = min(cached, n)
    prompt = list(range(1000, 1000 + n))
    planner, trace = run_request(standin_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=local, block_size=block_size, chunk_size=chunk,
                                 budget=budget, preempt_at=None, decode_steps=2,
                                 pending_polls=polls)
    check_trace(prompt, cached, block_size, chunk, planner, trace, preempted=False)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(40, 900), cached=st.integers(0, 900), frac=st.floats(0.05, 1.0),
       block_size=st.sampled_from([16, 32]), chunk=st.sampled_from([32, 256]))
def test_preemption_and_resume(n: int, cached: int, frac: float, block_size: int,
                               chunk: int) -> None:
    cached = min(cached, n)
    prompt = list(range(5, 5 + n))
    planner, trace = run_request(standin_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=0, block_size=block_size, chunk_size=chunk,
                                 budget=48, preempt_at=max(1, int(n * frac)), decode_steps=3)
    check_trace(prompt, cached, block_size, chunk, planner, trace, preempted=True)
    assert len(trace.block_ids) == 2  # admitted, preempted, admitted again


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 900), cached=st.integers(0, 900), budget=st.sampled_from([1 << 30, 48]),
       lag=st.integers(0, 1), preempt=st.booleans())
def test_several_ranks_save_the_same_tokens_held_back_behind_each_load(
        n: int, cached: int, budget: int, lag: int, preempt: bool) -> None:
    """With several ranks, saves wait for each load's step to be known good on all ranks;
    the same tokens are saved, in order, as with one rank."""
    cached = min(cached, n)
    prompt = list(range(9, 9 + n))
    planner, trace = run_request(standin_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=0, block_size=16, chunk_size=32, budget=budget,
                                 preempt_at=max(1, n // 2) if preempt else None,
                                 decode_steps=3, ranks=2, lag=lag)
    check_trace(prompt, cached, 16, 32, planner, trace, preempted=preempt)
    # No save in the step of a load, nor (async scheduling) in the next one.
    loaded = [s for op, s in zip(trace.ops, trace.steps, strict=True) if op.loads]
    for op, s in zip(trace.ops, trace.steps, strict=True):
        assert not (op.saves and any(0 <= s - at <= lag for at in loaded)), (trace.ops, s)


def _loaded_request(ranks: int, n: int = 600, hit: int = 512,
                    ) -> tuple[SchedulerPlanner, object, RequestOp]:
    """A request whose first ``hit`` tokens load, through its first step; the step's op."""
    kinds = standin_kinds()
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: done(hit),
                               ranks=ranks)
    prompt = list(range(n))
    req = kinds.request("r", prompt)
    ext, _ = planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, ext)
    (op,) = planner.build(kinds.output([kinds.new_req("r", prompt, list(range(40)), hit)],
                                       kinds.cached([], set(), [], []), {"r": n - hit}, set()))
    return planner, req, op


def test_one_rank_saves_in_the_step_of_its_load() -> None:
    _planner, _req, op = _loaded_request(ranks=1)
    assert (op.load_start, op.load_end, op.save_start, op.save_end) == (0, 512, 512, 600)


def test_a_load_that_failed_on_another_rank_leaves_no_save_over_it() -> None:
    """Found by reading: with tensor parallelism a load that failed on one rank alone let
    the other ranks save that step's KV, which every rank computed over the failed rank's
    unloaded blocks (their attention outputs are summed), and a store never overwrites a
    cached chunk. Now no rank saves until the step's output, every rank's failed loads in
    it, is in; then vLLM has rewound the request and its recomputed KV is what is saved."""
    kinds = standin_kinds()
    planner, req, op = _loaded_request(ranks=2)
    assert (op.load_start, op.load_end, op.saves) == (0, 512, False)
    assert planner.step == 1
    # Async scheduling: the next step is planned before the first one's output is in.
    req.append_output_token_ids(7)
    assert planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [600]),
                                      {"r": 1}, set())) == []
    assert planner.stats.held_saves == 2
    # Step 1's output: another rank failed the block of tokens 256..271; vLLM rewinds the
    # request there and computes it again, which is saved.
    planner.outputs_seen(1)
    (op,) = planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [256]),
                                       {"r": 345}, set()))
    assert (op.loads, op.save_start, op.save_end) == (False, 256, 600)


def test_a_load_known_good_on_every_rank_saves_what_was_held() -> None:
    kinds = standin_kinds()
    planner, req, _op = _loaded_request(ranks=2)
    planner.outputs_seen(1)
    req.append_output_token_ids(7)
    (op,) = planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [600]),
                                       {"r": 1}, set()))
    assert (op.loads, op.save_start, op.save_end) == (False, 512, 600)
    req.append_output_token_ids(7)
    assert planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [601]),
                                      {"r": 1}, set())) == []


def test_a_request_that_loads_nothing_is_not_held() -> None:
    _planner, _req, op = _loaded_request(ranks=4, hit=0)
    assert (op.loads, op.save_start, op.save_end) == (False, 0, 600)


def test_a_request_rewound_then_preempted_saves_what_the_cache_lacks() -> None:
    """Found by reading (docs/vllm.md left it open): a load failed, and vLLM rewound the
    request and preempted it before the planner saw a step of it. On its return the planner
    kept the tokens of the failed step as saved, although nothing of them was, so the
    request's recomputed KV was never stored."""
    kinds = standin_kinds()
    hits = [512, 0]  # the chunks were evicted: the second lookup finds nothing
    planner = SchedulerPlanner(block_size=16, chunk_size=256,
                               start_lookup=lambda t: done(hits.pop(0)))
    prompt = list(range(600))
    req = kinds.request("r", prompt)
    ext, _ = planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, ext)
    (op,) = planner.build(kinds.output([kinds.new_req("r", prompt, list(range(40)), 512)],
                                       kinds.cached([], set(), [], []), {"r": 88}, set()))
    assert (op.load_end, op.save_start, op.save_end) == (512, 512, 600)  # (saves nothing)
    # Rewound to token 0 and preempted; admitted again, with nothing in the cache.
    ext, _ = planner.num_new_matched_tokens(req, 0)
    assert ext == 0
    planner.after_alloc(req, ext)
    (op,) = planner.build(kinds.output([], kinds.cached(["r"], {"r"}, [(list(range(50, 90)),)],
                                                        [0]), {"r": 600}, set()))
    assert (op.loads, op.save_start, op.save_end) == (False, 0, 600)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(2, 900), cached=st.integers(0, 900), block_size=st.sampled_from([16, 32]),
       budget=st.sampled_from([1 << 30, 48, 100]), preempt=st.booleans(),
       save_decode=st.booleans())
def test_whole_blocks_only_move_whole_blocks(n: int, cached: int, block_size: int,
                                            budget: int, preempt: bool,
                                            save_decode: bool) -> None:
    """vLLM's CPU backend holds each block's keys transposed: every load and save the
    planner sends starts and ends on a block boundary, in order, without overlap, and
    together the saves cover the prompt's whole blocks past what the cache held."""
    cached = min(cached, n)
    prompt = list(range(11, 11 + n))
    planner, trace = run_request(standin_kinds(), prompt=prompt, cached_prefix=cached,
                                 local_prefix=0, block_size=block_size, chunk_size=64,
                                 budget=budget, preempt_at=max(1, n // 2) if preempt else None,
                                 decode_steps=2, save_decode=save_decode, whole_blocks=True)
    for op in trace.ops:
        for edge in (op.load_start, op.load_end, op.save_start, op.save_end):
            assert edge % block_size == 0, (edge, op)
    saves = [(op.save_start, op.save_end) for op in trace.ops if op.saves]
    covered = cached - cached % block_size
    for lo, hi in saves:
        assert lo == covered, saves
        covered = hi
    if not save_decode:
        assert covered == max(cached - cached % block_size, n - n % block_size)
    assert planner.tracked() == 0


def test_whole_blocks_load_a_hit_down_to_its_last_whole_block() -> None:
    kinds = standin_kinds()
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: done(300),
                               whole_blocks=True)
    prompt = list(range(600))
    req = kinds.request("r", prompt)
    ext, _ = planner.num_new_matched_tokens(req, 0)
    assert ext == 288
    planner.after_alloc(req, ext)
    (op,) = planner.build(kinds.output([kinds.new_req("r", prompt, list(range(40)), 288)],
                                       kinds.cached([], set(), [], []), {"r": 312}, set()))
    assert (op.load_start, op.load_end, op.save_start, op.save_end) == (0, 288, 288, 592)


def test_lookup_in_flight_answers_none_and_never_blocks() -> None:
    never: concurrent.futures.Future[int] = concurrent.futures.Future()
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: never)

    class Req:
        request_id = "a"
        prompt_token_ids = list(range(100))
        all_token_ids = prompt_token_ids

    for _ in range(5):
        assert planner.num_new_matched_tokens(Req(), 0) == (None, False)
    never.set_result(100)
    assert planner.num_new_matched_tokens(Req(), 0) == (99, False)   # full hit: one less
    assert planner.num_new_matched_tokens(Req(), 32) == (67, False)  # vLLM holds 32
    assert planner.num_new_matched_tokens(Req(), 99) == (0, False)


@pytest.mark.parametrize("exc", [TimeoutError("slow"), OSError("gone")])
def test_failed_lookup_is_a_miss(exc: Exception) -> None:
    f: concurrent.futures.Future[int] = concurrent.futures.Future()
    f.set_exception(exc)
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: f)

    class Req:
        request_id = "a"
        prompt_token_ids = list(range(50))
        all_token_ids = prompt_token_ids

    assert planner.num_new_matched_tokens(Req(), 0) == (0, False)
    assert planner.stats.lookup_failures == 1


def test_lookup_that_cannot_start_is_a_miss() -> None:
    def boom(tokens: np.ndarray) -> concurrent.futures.Future[int]:
        raise RuntimeError("loop closed")

    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=boom)

    class Req:
        request_id = "a"
        prompt_token_ids = list(range(50))
        all_token_ids = prompt_token_ids

    assert planner.num_new_matched_tokens(Req(), 0) == (0, False)


def test_prompt_embeddings_are_not_looked_up() -> None:
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: done(9))

    class Req:
        request_id = "a"
        prompt_token_ids = None

    assert planner.num_new_matched_tokens(Req(), 0) == (0, False)
    assert planner.tracked() == 0


def test_slots_follow_the_block_list() -> None:
    assert slots_for([7, 2], 4, 6).tolist() == [28, 29, 30, 31, 8, 9]
    with pytest.raises(ValueError, match="need 2 blocks"):
        slots_for([7], 4, 6)


@pytest.mark.parametrize("rewind_to", [0, 16, 256, 400])
def test_a_request_vllm_rewinds_is_saved_again_from_there(rewind_to: int) -> None:
    """Found by a probe: a load failed, vLLM rewound num_computed_tokens to the first
    failed block and recomputed, but the planner had marked the tokens saved and never
    saved the recomputed KV."""
    kinds = standin_kinds()
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: done(512))
    prompt = list(range(600))
    req = kinds.request("r", prompt)
    ext, _ = planner.num_new_matched_tokens(req, 0)
    assert ext == 512
    planner.after_alloc(req, ext)
    blocks = list(range(40))
    (op,) = planner.build(kinds.output([kinds.new_req("r", prompt, blocks, 512)],
                                       kinds.cached([], set(), [], []), {"r": 88}, set()))
    assert (op.load_start, op.load_end, op.save_start, op.save_end) == (0, 512, 512, 600)
    # The load failed: vLLM goes back to the first failed block and computes from there.
    (op,) = planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [rewind_to]),
                                       {"r": 600 - rewind_to}, set()))
    assert (op.loads, op.save_start, op.save_end) == (False, rewind_to, 600)
    # A step that goes on as planned saves nothing twice.
    req.append_output_token_ids(7)
    assert planner.build(kinds.output([], kinds.cached(["r"], set(), [None], [600]),
                                      {"r": 1}, set())) == []


def test_a_vllm_that_hands_no_step_back_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    kinds = standin_kinds()
    planner = SchedulerPlanner(block_size=16, chunk_size=256, start_lookup=lambda t: done(0),
                               ranks=2)
    empty = kinds.output([], kinds.cached([], set(), [], []), {}, set())
    with caplog.at_level("WARNING", logger="musacache.vllm"):
        for _ in range(63):
            planner.build(empty)
        assert not caplog.records
        planner.build(empty)
    assert "handed back no step" in caplog.text
    planner.outputs_seen(64)
    caplog.clear()
    for _ in range(10):
        planner.build(empty)
    assert not caplog.records
