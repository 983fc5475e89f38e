"""The one async API of the embedded :class:`~musacache.Cache` and the node-server
:class:`~musacache.server.client.Client`: code typed against :class:`KVCache` runs on either.

mypy checks both classes against the protocol (the functions at the bottom of
``musacache/__init__.py``, which sits above both), so a method that drifts on one side (a
missing ``await``-able, another signature) fails the type check, not a user's quickstart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from musacache.cache import Hit

__all__ = ["KVCache", "TokensLike"]

#: Token ids: a 1-D int tensor, a 1-D numpy int array, or a sequence of ints.
TokensLike: TypeAlias = "torch.Tensor | np.ndarray[Any, Any] | Sequence[int]"


@runtime_checkable
class KVCache(Protocol):
    """What :class:`~musacache.Cache` and :func:`musacache.connect`'s client both offer.

    Every method is awaited, ``stats()`` included (``Cache.get`` and ``lookup`` return a
    coroutine or one already completed, see :meth:`musacache.Cache.get`). Paged
    ``store``/``retrieve`` take ``kv_caches`` and ``slot_mapping`` positionally (a client
    also accepts just the slots for caches it registered).
    """

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def aclose(self) -> None: ...

    async def put(self, tokens: TokensLike, kv: torch.Tensor) -> int: ...

    async def get(self, tokens: TokensLike, out: torch.Tensor | None = None) -> Hit: ...

    async def lookup(self, tokens: TokensLike) -> int: ...

    async def prefetch(self, tokens: TokensLike, timeout: float | None = None) -> int: ...

    async def delete(self, tokens: TokensLike) -> int: ...

    async def clear(self) -> None: ...

    async def flush(self) -> None: ...

    async def stats(self) -> dict[str, Any]: ...

    async def store(self, tokens: TokensLike, kv_caches: Any, slot_mapping: Any, /, *,
                    layout: str = "vllm", skip_prefix: int = 0, ready: Any = None,
                    ready_timeout: float | None = None) -> int: ...

    async def retrieve(self, tokens: TokensLike, kv_caches: Any, slot_mapping: Any, /, *,
                       layout: str = "vllm", skip_prefix: int = 0, ready: Any = None,
                       ready_timeout: float | None = None) -> int: ...

    async def put_pages(self, keys: Sequence[str | bytes], pages: Sequence[torch.Tensor], *,
                        after: str | bytes | None = None) -> int: ...

    async def get_pages(self, keys: Sequence[str | bytes], outs: Sequence[torch.Tensor],
                        ) -> list[bool]: ...

    async def exists_pages(self, keys: Sequence[str | bytes]) -> int: ...
