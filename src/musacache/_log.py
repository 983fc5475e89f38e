"""One rate-limited logger for faults that can repeat thousands of times a second.

A cold tier that is down fails every read, write and listing. Each failure is counted in
``stats()``; the log gets at most one line per (tier, kind) per ``interval`` seconds, and the next
line that is let through says how many were held back in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """At most one WARNING per ``(tier, kind)`` every ``interval`` seconds; the rest are counted
    and reported on the next line let through as ``(N similar suppressed)``.

    ``clock`` is injectable so the rate limit can be tested without sleeping.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval = interval
        self._clock = clock
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def warn(self, tier: str, kind: str, msg: str) -> bool:
        """Log ``tier <tier>: <kind>: <msg>`` unless one was logged for the same tier and kind
        less than ``interval`` seconds ago. Returns whether the line was written."""
        now = self._clock()
        key = (tier, kind)
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._suppressed.pop(key, 0)
        extra = f" ({held} similar suppressed)" if held else ""
        self.logger.warning("tier %s: %s: %s%s", tier, kind, msg, extra)
        return True

    def suppressed(self, tier: str, kind: str) -> int:
        """Lines held back for ``(tier, kind)`` since the last one written."""
        return self._suppressed.get((tier, kind), 0)
