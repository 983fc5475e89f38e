"""What the caches of ``bench scale``'s stall part leave behind once closed: how many objects
a full collection then finds to be cyclic garbage (a closed cache must leave none: it is freed
by reference counts alone), and the process's RSS before and after that collection.
docs/benchmarks.md, "Closed caches are freed".

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
    rss = rss_mib()
    garbage = gc.collect()
    print(f"after the stall part ({entries} entries): RSS {rss} MiB; cyclic garbage: "
          f"{garbage}; RSS once collected {rss_mib()} MiB")


main()
