"""What the caches of ``bench scale``'s stall part leave behind once closed: the objects
still frozen (``gc.freeze``, ``_gcfreeze``), how many of them were cyclic garbage (freed only
once unfrozen and collected), and the process's RSS before and after that. A closed cache must
leave nothing: frozen, a cycle is never collected. docs/benchmarks.md, "Closed caches
(twelfth round)".

    python docs/scripts/closed_caches_left.py [ENTRIES]
"""

import asyncio
import gc
import os
import sys

from musacache.bench import scale


def rss_mib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20


def main() -> None:
    entries = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    asyncio.run(scale.stalls(entries, 2000, entries))
    gc.collect()
    frozen, rss = gc.get_freeze_count(), rss_mib()
    gc.unfreeze()
    garbage = gc.collect()
    print(f"after the stall part ({entries} entries): {frozen} objects frozen, RSS {rss} MiB; "
          f"of them cyclic garbage: {garbage}; RSS once collected {rss_mib()} MiB")


main()
