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

An exception the direct path raised is held and raised at ``await`` (or ``result()``), as a
coroutine's would be: a ``gather`` argument list is never left half-built by a call that
raised. Like any done future, one never awaited does not warn (its work is already done);
one holding an exception that nobody retrieved is logged when collected ("exception was never
retrieved"), unless it was closed or thrown into (a Task cancelled before it ran), where a
coroutine would never have run at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, NoReturn, TypeVar

__all__ = ["Completed", "failed"]

T = TypeVar("T")


class Completed(asyncio.Future[T], Coroutine[Any, Any, T]):
    """A done future that is also a coroutine (see the module docstring). Made done by its
    maker (``set_result``/``set_exception`` right after construction), never pending."""

    __slots__ = ()

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


def failed(loop: asyncio.AbstractEventLoop, exc: BaseException) -> Completed[Any]:
    """A ``Completed`` holding ``exc`` (raised at ``await``)."""
    done: Completed[Any] = Completed(loop=loop)
    done.set_exception(exc)
    return done
