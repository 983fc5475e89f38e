"""The key chain: every chunk's key commits to the whole prefix before it.

``h_0 = seed``, ``h_i = blake2b(h_{i-1} || tokens of chunk i as int32 little-endian)``. The seed
is a fingerprint of the namespace (model), the KVSpec, the chunk size, the format version, and an
optional tenant salt, so prompts of another model, layout or tenant can never hit. A partial tail
chunk is keyed the same way over its shorter token run, which is what lets a later, longer
prompt find it by its parent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._errors import TokensError
from ._spec import KVSpec

__all__ = ["FORMAT_VERSION", "KEY_BYTES", "Fingerprint", "KeyChain", "as_tokens",
           "check_token_memory", "tenant_tag"]

FORMAT_VERSION = 1
KEY_BYTES = 32

_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Fingerprint:
    """What a chunk was written for. Stored in every chunk header; part of the key seed."""

    namespace: str
    spec: KVSpec
    chunk_size: int
    format_version: int = FORMAT_VERSION

    def describe(self) -> str:
        return (f"namespace={self.namespace!r} spec=({self.spec.describe()}) "
                f"chunk_size={self.chunk_size} format=v{self.format_version}")

    def digest(self) -> bytes:
        """16 stable bytes naming this fingerprint (object names, headers)."""
        return hashlib.blake2b(self.describe().encode(), digest_size=16).digest()


def tenant_tag(tenant: str | None) -> str | None:
    """How stats and metrics show a tenant: a short digest, since the string itself is a
    capability (docs/security.md)."""
    if tenant is None:
        return None
    return "#" + hashlib.blake2b(tenant.encode(), digest_size=4).hexdigest()


class KeyChain:
    """Computes chunk keys for token sequences under one fingerprint and tenant salt."""

    def __init__(self, fingerprint: Fingerprint, salt: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self.chunk_size = fingerprint.chunk_size
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"musacache-seed")
        h.update(fingerprint.describe().encode())
        # The salt is length-prefixed so that no salt can be confused with another suffix.
        salt = salt or b""
        h.update(len(salt).to_bytes(4, "little"))
        h.update(salt)
        self.seed: bytes = h.digest()

    @staticmethod
    def child(parent: bytes, token_bytes: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(token_bytes)
        return h.digest()

    def iter_keys(self, tokens: np.ndarray) -> Iterator[tuple[int, int, bytes, bytes]]:
        """Yield ``(start, end, parent, key)`` for each chunk of ``tokens`` (int32), the last one
        possibly partial. Lazy, so a lookup that misses early hashes only what it needs."""
        view = memoryview(tokens).cast("B")  # type: ignore[arg-type]
        parent = self.seed
        n = len(tokens)
        step = self.chunk_size
        for start in range(0, n, step):
            end = min(start + step, n)
            key = self.child(parent, view[start * 4 : end * 4])
            yield start, end, parent, key
            parent = key

    def keys(self, tokens: np.ndarray) -> list[tuple[int, int, bytes, bytes]]:
        return list(self.iter_keys(tokens))


def check_token_memory(tokens: torch.Tensor) -> None:
    """A token tensor with values to read: dense, not on the meta device (TokensError)."""
    if tokens.layout != torch.strided:
        raise TokensError(f"tokens must be a dense tensor, got a {tokens.layout} tensor")
    if tokens.is_meta:  # an attribute: tokens.device builds a device object
        raise TokensError("tokens are on the meta device: they have a shape but no values")


def as_tokens(tokens: Any) -> np.ndarray:
    """Canonicalise ``tokens`` (1-D int tensor, list of ints, or numpy array) to a C-contiguous
    little-endian int32 numpy array. Raises TokensError for anything else."""
    if isinstance(tokens, torch.Tensor):
        check_token_memory(tokens)
        if tokens.dim() != 1:
            raise TokensError(f"tokens must be 1-D, got a tensor of shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TokensError(f"tokens must be integers, got dtype {tokens.dtype}")
        # No detach() (a view, microseconds): integer tensors never require grad.
        arr = (tokens if tokens.is_cpu else tokens.to("cpu")).numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, list) and set(map(type, tokens)) <= {int} and (
            not tokens or (min(tokens) >= _INT32_MIN and max(tokens) <= _INT32_MAX)):
        # Plain ints that fit (the common list): no per-token isinstance walk, no numpy
        # reductions. Anything else takes the checks below, which name what is wrong.
        return np.array(tokens, dtype="<i4")
    elif isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes, bytearray)):
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in tokens):
            bad = next(t for t in tokens
                       if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
            raise TokensError(f"tokens must be integers, found {bad!r} ({type(bad).__name__})")
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except OverflowError:
            raise TokensError("a token does not fit in int32") from None
    else:
        raise TokensError(
            f"tokens must be a 1-D int tensor, a list of ints or a numpy array, "
            f"got {type(tokens).__name__}")
    if arr.ndim != 1:
        raise TokensError(f"tokens must be 1-D, got an array of shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TokensError(f"tokens must be integers, got dtype {arr.dtype}")
    out = np.ascontiguousarray(arr, dtype="<i4")
    # A token outside int32 wraps in the cast: one comparison finds it (min and max are two
    # passes, a few microseconds on a short prompt).
    if arr.dtype != np.int32 and arr.size and (out != arr).any():
        lo, hi = int(arr.min()), int(arr.max())
        raise TokensError(f"token ids must fit in int32, found {lo if lo < _INT32_MIN else hi}")
    return out


def token_bytes(tokens: Any) -> bytes:
    """``as_tokens(tokens)`` as int32 little-endian bytes, as the wire protocol carries them.
    A 1-D int32 numpy array (the common case) skips the general conversion."""
    if type(tokens) is np.ndarray and tokens.dtype == np.dtype("<i4") and tokens.ndim == 1:
        return tokens.tobytes()  # C order whatever the strides
    return as_tokens(tokens).tobytes()
