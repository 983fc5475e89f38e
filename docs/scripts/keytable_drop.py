"""A directory's key table of 1.25M entries taken apart by popitem (as clear and close do, 64
per loop turn): the median step that empties a shard, the median other step, and the final
drop of the emptied table. docs/benchmarks.md, "Growing puts and clear".

    python docs/scripts/keytable_drop.py
"""

import os
import statistics
import time

from musacache.engine.directory import KeyTable

table = KeyTable()
for i in range(1_250_000):
    table[os.urandom(16)] = i  # type: ignore[assignment]
emptying, others = [], []
while len(table):
    cursor = table._cursor
    t0 = time.perf_counter()
    for _ in range(min(64, len(table))):
        table.popitem()
    step = time.perf_counter() - t0
    # A step emptied a shard if the cursor moved on, or its shard is empty now.
    emptied = table._cursor != cursor or not table._shards[table._cursor]
    (emptying if emptied else others).append(step)
t0 = time.perf_counter()
del table
drop = time.perf_counter() - t0
print(f"steps emptying a shard: {len(emptying)}, median {statistics.median(emptying) * 1e3:.3f} "
      f"ms; other steps: median {statistics.median(others) * 1e3:.3f} ms; "
      f"drop of the emptied table: {drop * 1e3:.3f} ms")
