"""Tiers: memory tiers (device, host) and storage tiers (disk, S3, plug-ins).

The public names are re-exported from :mod:`musacache`.
"""
