"""How much this machine's thread CPU clock counts beyond the work: a fixed unit of pure-Python
work (dict reads, about 2 ms) repeated for 30 s, each unit timed by the thread's CPU clock
(`time.thread_time`, what `bench scale` calls the loop thread's CPU in a gap). On an idle
machine the units should all cost the same. docs/benchmarks.md, "The event loop during
directory work" (tenth round).

    python docs/scripts/cpu_clock_noise.py [SECONDS]
"""

import sys
import time

import numpy as np

table = {i: i for i in range(200_000)}


def unit() -> int:
    s = 0
    for i in range(0, 200_000, 7):
        s += table[i]
    return s


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    unit()
    cpu = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        c0 = time.thread_time()
        unit()
        cpu.append(time.thread_time() - c0)
    ms = np.array(cpu) * 1e3
    med = float(np.median(ms))
    print(f"{len(ms)} units: CPU median {med:.2f} ms, p99.9 {np.percentile(ms, 99.9):.2f} ms,"
          f" max {ms.max():.2f} ms; over 3x the median: {(ms > 3 * med).sum()}, over 5x:"
          f" {(ms > 5 * med).sum()}")


main()
