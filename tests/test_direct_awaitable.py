"""``Cache.get`` and ``Cache.lookup`` answered by the direct path return an already-completed
awaitable (``_completed.Completed``) instead of a coroutine (issue 12, "small ops": a gather of
1000 gets paid asyncio's Task per coroutine). It must stand in for a coroutine everywhere a
user puts one, give the same answers as the general path, raise at ``await`` and never at the
call, and make ``asyncio.gather`` create no Task.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import prefix_kv
from musacache.engine import fastpath as _fastpath
from musacache.engine.completed import Completed, failed

SPEC = mc.KVSpec(1, 1, 8, torch.float16)
CH = 4


def _config(chunks: int = 64) -> mc.CacheConfig:
    return mc.CacheConfig(SPEC, "direct", chunk_size=CH,
                          tiers=(mc.HostTier(SPEC.nbytes(CH) * chunks),))


async def _filled(c: mc.Cache, prompts: list[list[int]]) -> None:
    for p in prompts:
        assert await c.put(p, prefix_kv(SPEC, p)) == len(p)


# Every way a user consumes a coroutine: each takes ``cache.get``/``cache.lookup`` and its
# arguments and returns the answer.
async def _awaited(fn: Callable[..., Awaitable[Any]], *a: Any) -> Any:
    return await fn(*a)


async def _gathered(fn: Callable[..., Awaitable[Any]], *a: Any) -> Any:
    return (await asyncio.gather(fn(*a), fn(*a)))[1]


async def _task(fn: Callable[..., Any], *a: Any) -> Any:
    return await asyncio.create_task(fn(*a))


async def _ensure_future(fn: Callable[..., Any], *a: Any) -> Any:
    return await asyncio.ensure_future(fn(*a))


async def _wait_for(fn: Callable[..., Any], *a: Any) -> Any:
    return await asyncio.wait_for(fn(*a), timeout=10)


async def _shield(fn: Callable[..., Any], *a: Any) -> Any:
    return await asyncio.shield(fn(*a))


async def _task_group(fn: Callable[..., Any], *a: Any) -> Any:
    async with asyncio.TaskGroup() as tg:
        t = tg.create_task(fn(*a))
    return t.result()


async def _wait(fn: Callable[..., Any], *a: Any) -> Any:
    # (asyncio.wait refuses coroutines, and so the answer too: it takes Tasks)
    done, _pending = await asyncio.wait([asyncio.create_task(fn(*a))])
    return done.pop().result()


async def _as_completed(fn: Callable[..., Any], *a: Any) -> Any:
    return [await f for f in asyncio.as_completed([fn(*a)])][0]



async def _anyio_start_soon(fn: Callable[..., Any], *a: Any) -> Any:
    got: list[Any] = []

    async def keep(*args: Any) -> None:
        got.append(await fn(*args))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fn, *a)  # anyio insists on a Coroutine: the bare call must pass
        tg.start_soon(keep, *a)
    return got[0]


CONSUMERS = {f.__name__.strip("_"): f for f in (
    _awaited, _gathered, _task, _ensure_future, _wait_for, _shield, _task_group, _wait,
    _as_completed, _anyio_start_soon)}


def _same_hit(ha: mc.Hit, hb: mc.Hit) -> None:
    assert type(ha) is type(hb) is mc.Hit
    assert (ha.num_tokens, ha.tiers) == (hb.num_tokens, hb.tiers)
    assert ha.kv.shape == hb.kv.shape and ha.kv.dtype == hb.kv.dtype
    assert torch.equal(ha.kv, hb.kv)


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
async def test_every_consumer_of_a_coroutine_takes_the_direct_answer(consumer: str) -> None:
    use = CONSUMERS[consumer]
    prompts = [[7, 1, 2, 3, 4, 5], [7, 1, 2, 9]]
    async with mc.Cache(_config()) as a, mc.Cache(_config()) as b:
        b._fast = None  # the reference: the general path, a coroutine
        await _filled(a, prompts)
        await _filled(b, prompts)
        assert isinstance(a.get(prompts[0]), Completed)  # the direct path answers here
        coro = b.get(prompts[0])
        assert asyncio.iscoroutine(coro) and not asyncio.isfuture(coro)
        coro.close()
        for toks in ([7, 1, 2, 3, 4, 5], [7, 1, 2, 3, 4, 5, 6], [7, 1, 2, 9, 9], [5, 5], []):
            _same_hit(await use(a.get, toks), await use(b.get, toks))
            out_a = torch.full(SPEC.shape(len(toks)), -1.0, dtype=SPEC.dtype)
            out_b = out_a.clone()
            ha, hb = await use(a.get, toks, out_a), await use(b.get, toks, out_b)
            _same_hit(ha, hb)
            assert torch.equal(out_a, out_b)
            assert await use(a.lookup, toks) == await use(b.lookup, toks)


async def test_a_gather_of_direct_gets_and_lookups_creates_no_task() -> None:
    """asyncio.gather wraps every coroutine in a Task (7 µs each on Python 3.11): the direct
    path's answers are futures it takes as they are."""
    prompts = [[i, 1, 2, 3, 4] for i in range(50)]
    made: list[Any] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kw)

    async with mc.Cache(_config(200)) as c:
        await _filled(c, prompts)
        loop = asyncio.get_running_loop()
        loop.set_task_factory(counting)
        try:
            hits = await asyncio.gather(*(c.get(p) for p in prompts))
            outs = [torch.empty(SPEC.shape(5), dtype=SPEC.dtype) for _ in prompts]
            with_out = await asyncio.gather(*(c.get(p, o) for p, o in zip(prompts, outs)))
            found = await asyncio.gather(*(c.lookup(p) for p in prompts))
        finally:
            loop.set_task_factory(None)
        assert made == []
        assert [h.num_tokens for h in hits] == [5] * 50 and found == [5] * 50
        for p, h, h2, o in zip(prompts, hits, with_out, outs):
            assert torch.equal(h.kv, prefix_kv(SPEC, p)) and torch.equal(o, prefix_kv(SPEC, p))
            assert h2.kv.data_ptr() == o.data_ptr()
        assert (await c.stats())["ops"]["gets"] == 100


async def test_a_gather_of_direct_answers_schedules_one_call_for_all_their_callbacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A done future schedules a call of its own per callback added to it, and gather adds
    one to each argument: most of what a gather of 1,000 gets cost beyond the gets (1.2
    against 0.7 µs per future, batched). The callbacks added to direct answers in one turn
    run in one call, each in the context it was added in; one that raises goes to the
    loop's exception handler and the others still run."""
    import contextvars

    prompts = [[i, 1, 2, 3, 4] for i in range(50)]
    loop = asyncio.get_running_loop()
    async with mc.Cache(_config(200)) as c:
        await _filled(c, prompts)
        scheduled = 0
        real = loop.call_soon

        def counting(*a: Any, **kw: Any) -> asyncio.Handle:
            nonlocal scheduled
            scheduled += 1
            return real(*a, **kw)

        monkeypatch.setattr(loop, "call_soon", counting)
        hits = await asyncio.gather(*(c.get(p) for p in prompts))
        found = await asyncio.gather(*(c.lookup(p) for p in prompts))
        monkeypatch.undo()
        assert [h.num_tokens for h in hits] == [5] * 50 and found == [5] * 50
        assert scheduled <= 6, scheduled  # (before: one per answer, and the gather's own)

        var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
        seen: list[tuple[str, int]] = []
        handled: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: handled.append(ctx))
        try:
            answers = [c.lookup(p) for p in prompts[:3]]
            for i, f in enumerate(answers):
                assert isinstance(f, Completed)
                var.set(f"added {i}")
                if i == 1:
                    f.add_done_callback(lambda _f: 1 / 0)
                f.add_done_callback(lambda f, i=i: seen.append((var.get(), f.result() + i)))
            var.set("later")
            await asyncio.sleep(0)
        finally:
            loop.set_exception_handler(None)
        assert seen == [("added 0", 5), ("added 1", 6), ("added 2", 7)]
        assert len(handled) == 1 and isinstance(handled[0]["exception"], ZeroDivisionError)


async def test_errors_are_raised_at_await_never_at_the_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad argument or a failure on the direct path comes out of ``await``: a list of calls
    built for ``gather`` is always built whole."""
    prompts = [[i, 1, 2, 3, 4] for i in range(3)]
    async with mc.Cache(_config()) as c:
        await _filled(c, prompts)
        bad_tokens = c.get([[1, 2], [3, 4]])  # 2-D: refused
        bad_lookup = c.lookup("not tokens")
        with pytest.raises(mc.TokensError):
            await bad_tokens
        with pytest.raises(mc.TokensError):
            await bad_lookup
        calls = [c.get(prompts[0]), c.get([[1]]), c.get(prompts[1])]  # the list is built
        with pytest.raises(mc.TokensError):
            await asyncio.gather(*calls)
        got = await asyncio.gather(*[c.get(p) for p in prompts], c.lookup(3.5),
                                   return_exceptions=True)
        assert [h.num_tokens for h in got[:3]] == [5, 5, 5]
        assert isinstance(got[3], mc.TokensError)

        # A failure inside the direct path itself (here the native copy) is held as well.
        monkeypatch.setattr(_fastpath, "_copy_bytes", lambda d, s, n: 1)
        failing = c.get(prompts[2])
        assert isinstance(failing, Completed)
        with pytest.raises(mc.NativeError):
            await failing


async def test_a_task_cancelled_before_it_ran_is_cancelled() -> None:
    async with mc.Cache(_config()) as c:
        await _filled(c, [[1, 2, 3, 4, 5]])
        t = asyncio.create_task(c.get([1, 2, 3, 4, 5]))
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert t.cancelled()
        # Cancelled after its one step: the answer stands.
        t = asyncio.create_task(c.lookup([1, 2, 3, 4, 5]))
        await asyncio.sleep(0)
        assert t.done() and not t.cancel() and t.result() == 5
        # wait_for with a deadline already passed still returns what is already there.
        assert await asyncio.wait_for(c.lookup([1, 2, 3, 4, 5]), timeout=0) == 5
        st = await c.stats()
        assert st["pins"] == 0 and sum(st["in_flight"].values()) == 0


async def test_unawaited_answers_warn_like_futures_not_spuriously() -> None:
    """An answer never awaited does not warn (its work is done); an error nobody retrieved
    is reported to the loop's exception handler, unless it was closed or thrown into (a
    Task cancelled before its first step), where a coroutine would never have run."""
    loop = asyncio.get_running_loop()
    reported: list[str] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx["message"]))
    try:
        async with mc.Cache(_config()) as c:
            await _filled(c, [[1, 2, 3, 4, 5]])
            with _no_warnings():
                c.get([1, 2, 3, 4, 5])
                c.lookup([1, 2])
                gc.collect()
            assert reported == []
            c.get([[1]])  # never retrieved
            gc.collect()
            assert len(reported) == 1 and "never retrieved" in reported[0]
            c.get([[1]]).close()
            t = asyncio.create_task(c.get([[1]]))
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            del t
            gc.collect()
            assert len(reported) == 1
    finally:
        loop.set_exception_handler(None)


class _no_warnings:
    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)


def test_the_completed_awaitable_is_a_coroutine_and_a_future() -> None:
    """What asyncio and anyio ask of a coroutine: ``send(None)`` finishes with the result,
    ``throw`` raises what it is given; outside a running loop a get is the general path's
    coroutine (``asyncio.run(cache.get(...))`` in a script)."""
    runner = asyncio.Runner()
    try:
        loop = runner.get_loop()
        done: Completed[int] = Completed(loop=loop)
        done.set_result(5)
        assert isinstance(done, Coroutine) and asyncio.iscoroutine(done)
        assert asyncio.isfuture(done)
        with pytest.raises(StopIteration) as stop:
            done.send(None)
        assert stop.value.value == 5
        with pytest.raises(KeyError):
            done.throw(KeyError("x"))
        with pytest.raises(KeyError):
            done.throw(KeyError)
        assert runner.run(done) == 5  # asyncio.run's check: a coroutine
        bad = failed(loop, mc.TokensError("bad"))
        with pytest.raises(mc.TokensError):
            runner.run(bad)

        c = mc.Cache(_config())
        runner.run(c.open())
        try:
            runner.run(_filled(c, [[1, 2, 3, 4]]))
            outside = c.get([1, 2, 3, 4])  # no running loop here: a plain coroutine
            assert not isinstance(outside, Completed) and asyncio.iscoroutine(outside)
            assert runner.run(outside).num_tokens == 4
            assert runner.run(c.lookup([1, 2, 3, 4])) == 4
        finally:
            runner.run(c.aclose())
    finally:
        runner.close()


_prompt = st.lists(st.integers(0, 2), min_size=0, max_size=3 * CH + 2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_prompt, min_size=1, max_size=6), st.lists(
    st.tuples(_prompt, st.sampled_from(sorted(CONSUMERS)), st.booleans()), min_size=1,
    max_size=12), st.randoms(use_true_random=False))
def test_direct_answers_agree_with_the_general_path(
        stored: list[list[int]], asks: list[tuple[list[int], str, bool]],
        rng: random.Random) -> None:
    """Random prompts, each asked through a random consumer, with and without ``out``: the
    direct path's answers equal the general path's."""
    async def main() -> None:
        async with mc.Cache(_config()) as a, mc.Cache(_config()) as b:
            b._fast = None
            for p in stored:
                for c in (a, b):
                    await c.put(p, prefix_kv(SPEC, p))
            for toks, consumer, with_out in asks:
                use = CONSUMERS[consumer]
                form = np.asarray(toks, dtype=np.int32) if rng.random() < 0.5 else toks
                if with_out:
                    out_a = torch.zeros(SPEC.shape(len(toks)), dtype=SPEC.dtype)
                    out_b = out_a.clone()
                    _same_hit(await use(a.get, form, out_a), await use(b.get, form, out_b))
                    assert torch.equal(out_a, out_b)
                else:
                    _same_hit(await use(a.get, form), await use(b.get, form))
                assert await use(a.lookup, form) == await use(b.lookup, form)
            sa, sb = await a.stats(), await b.stats()
            assert sa["tokens"] == sb["tokens"] and sa["ops"] == sb["ops"]
            assert sa["tiers"]["host"]["hits"] == sb["tiers"]["host"]["hits"]

    asyncio.run(main())


def test_frameworks_see_get_and_lookup_as_coroutine_functions_where_python_can_say_so() -> None:
    """A framework deciding between ``await f()`` and running ``f`` in a thread asks
    ``inspect.iscoroutinefunction``; on Python 3.12+ the two plain methods carry the mark."""
    marked = hasattr(inspect, "markcoroutinefunction")
    for name in ("get", "lookup"):
        assert inspect.iscoroutinefunction(getattr(mc.Cache, name)) is marked
    assert inspect.iscoroutinefunction(mc.Cache.put)
