"""Benchmarks behind ``musacache bench {transfer,codec,tiers,ipc}``.

Each benchmark compares ratios taken in the same run (musacache against memcpy/``copy_`` or
torch ``index_select``), because absolute times on shared machines are noise.
"""

import json
from collections.abc import Callable
from typing import Any


def emit(results: Any, as_json: bool, printer: Callable[[Any], None]) -> int:
    """Print ``results`` as JSON or through ``printer``; 0, since a missed goal is reported
    in the output, not as a failure."""
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        printer(results)
    return 0
