"""The package version. The native module is built with the same string and checked at import."""

__version__ = "0.1.0"
