"""Test and benchmark helpers (not part of the public API)."""
