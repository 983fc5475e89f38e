"""Build hook for the native module: cffi's setuptools integration needs ``cffi_modules``,
which has no pyproject.toml spelling. Everything else is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["src/native/build.py:ffibuilder"])
