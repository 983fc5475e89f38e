"""Benchmarks behind ``musacache bench {transfer,codec,tiers,ipc}``.

Each benchmark compares ratios taken in the same run (musacache against memcpy/``copy_`` or
torch ``index_select``), because absolute times on shared machines are noise.
"""
