"""The first torch op after the thread slept 2 ms, against the same op right after it (medians
of 30). docs/benchmarks.md, "Paged store, disk reads", eighth round.

    python docs/scripts/cold_ops.py
"""

import time

import numpy as np
import torch

x = torch.empty(1 << 20, dtype=torch.bfloat16)
ops = {"data_ptr": lambda: x.data_ptr(), "shape": lambda: x.shape, "slice": lambda: x[0:50],
       "empty(0)": lambda: torch.empty(0), "np.empty": lambda: np.empty(5),
       "view": lambda: x.view(1024, 1024)}
for name, op in ops.items():
    runs = []
    for _ in range(30):
        time.sleep(0.002)
        t = time.perf_counter()
        op()
        first = time.perf_counter() - t
        t = time.perf_counter()
        op()
        runs.append((first, time.perf_counter() - t))
    r = np.array(runs) * 1e6
    print(f"{name:10s} first {np.median(r[:, 0]):6.1f}  second {np.median(r[:, 1]):5.1f} us")
