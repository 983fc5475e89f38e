"""``Completed``: an awaitable that already holds its answer, returned by ``Cache.get`` and
``Cache.lookup`` when the direct read path (``_fastpath``) answered at the call.

Why not a coroutine: ``asyncio.gather`` (and ``ensure_future``, ``wait_for``, ``shield``)
wraps every coroutine in a Task, and on Python 3.11 (no eager task factory) a Task costs about
7 µs to create, schedule and step here, as much as the get itself. A future it takes as it
is. So ``Completed`` is an ``asyncio.Future``, created done (0.35 µs with its result, 0.45
with the ``await``, against 0.1 µs for a coroutine awaited at once), and also a
``collections.abc.Coroutine``, so that everything that takes a coroutine takes it too:
``asyncio.create_task``, a ``TaskGroup``, anyio's ``start_soon`` (which checks
``isinstance(x, Coroutine)``), ``asyncio.run``. As a coroutine it is one that returns at its
first step:

* ``send(None)`` raises ``StopIteration(result)``, or the exception it holds;
* ``throw(exc)`` raises ``exc``: a Task cancelled before its first step is cancelled, as with
  a coroutine that never started;
* ``close()`` does nothing more than mark the answer as seen.

A callback added to one (``asyncio.gather`` adds one to each of its arguments) runs soon, as
on any done future, but the callbacks added to every ``Completed`` of a loop in one turn run
in one scheduled call, each in the context it was added in: a done future schedules a
callback of its own per call (a handle made, queued and run by the loop), which was most of
what a ``gather`` of 1,000 gets cost beyond the gets themselves (1.2 µs per future against
0.7 batched, on Python 3.11). An exception a callback raises goes to the loop's exception
handler, as from a handle of its own, and the others still run.

An exception the direct path raised is held and raised at ``await`` (or ``result()``), as a
coroutine's would be: a ``gather`` argument list is never left half-built by a call that
raised. Like any done future, one never awaited does not warn (its work is already done);
one holding an exception that nobody retrieved is logged when collected ("exception was never
retrieved"), unless it was closed or thrown into (a Task cancelled before it ran), where a
coroutine would never have run at all.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, NoReturn, TypeVar

__all__ = ["Completed", "failed"]

T = TypeVar("T")


class Completed(asyncio.Future[T], Coroutine[Any, Any, T]):
    """A done future that is also a coroutine (see the module docstring). Made done by its
    maker (``set_result``/``set_exception`` right after construction), never pending."""

    __slots__ = ()

    def add_done_callback(self, fn: Callable[[Any], object], *,
                          context: contextvars.Context | None = None) -> None:
        if not self.done():  # (never, made done at once: as any future, then)
            super().add_done_callback(fn, context=context)
            return
        loop = self.get_loop()
        due = _due.get(loop)
        if due is None:
            loop.call_soon(_run_due, loop)  # (raises first on a closed loop)
            due = _due[loop] = []
        due.append((fn, self, context if context is not None
                    else contextvars.copy_context()))

    def send(self, value: Any) -> NoReturn:
        raise StopIteration(self.result())

    def throw(self, typ: Any, val: Any = None, tb: TracebackType | None = None) -> NoReturn:
        self._seen()
        if val is None:
            val = typ() if isinstance(typ, type) else typ
        if tb is not None:
            val = val.with_traceback(tb)
        raise val

    def close(self) -> None:
        self._seen()

    def _seen(self) -> None:
        # Retrieving a held exception is what keeps a done future from logging it when
        # collected; a closed coroutine's error would never have happened.
        if self.done() and not self.cancelled():
            self.exception()


# Per loop, the callbacks added to ``Completed`` futures since its last turn, with the
# future and the context each runs in; the loop runs them in one scheduled call.
_due: dict[asyncio.AbstractEventLoop,
           list[tuple[Callable[[Any], object], Completed[Any], contextvars.Context]]] = {}


def _run_due(loop: asyncio.AbstractEventLoop) -> None:
    for fn, fut, context in _due.pop(loop, ()):
        try:
            context.run(fn, fut)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:  # as a handle of its own would report it
            loop.call_exception_handler({
                "message": f"Exception in callback {fn!r} of a completed musacache call",
                "exception": exc, "future": fut})


def failed(loop: asyncio.AbstractEventLoop, exc: BaseException) -> Completed[Any]:
    """A ``Completed`` holding ``exc`` (raised at ``await``)."""
    done: Completed[Any] = Completed(loop=loop)
    done.set_exception(exc)
    return done
