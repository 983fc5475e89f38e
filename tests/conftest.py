"""Shared fixtures. Tests that need a service (moto, Swift, the node server) start it
themselves; with CI=true a missing service is a failure, never a skip."""

from __future__ import annotations

import pytest

import musacache as mc
from helpers import small_spec

# moto and Swift fixtures (they start the servers themselves; see tests/s3_servers.py).
pytest_plugins = ["s3_servers"]


@pytest.fixture
def spec() -> mc.KVSpec:
    return small_spec()
