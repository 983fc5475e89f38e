"""The S3 storage tier: chunk objects in any S3-compatible store (AWS, MinIO, Ceph, Swift).

Object names let any node rebuild the directory from a listing alone::

    <prefix>/<storage name>/<parent key hex>/<key hex>.<tokens>.kvc

The storage name is the fingerprint digest, followed by ``.<tenant digest>`` for a cache with a
tenant (:attr:`TierContext.storage_name`): tenants sharing a bucket list, read and delete only
their own objects, so one tenant's ``clear()`` never reaches another's chunks. Chunks are
grouped by their *parent*, so "what extends this prefix?" is one prefix listing,
``refresh(parent)``. Partial tail chunks sit next to full ones under the same parent.

**What this node knows of the bucket.** ``_known`` maps the keys it listed or wrote to their
object names (a delete needs the name). It never decides whether to upload: every write is sent,
because a key re-put after a delete may carry new bytes. Writes and deletes of one key take
effect in the order they were called (:class:`~musacache.tiers._ordering.KeyOrder`), so a delete
always sees the name of the write before it. Listings reused by ``refresh_interval`` are kept
for that long and for at most ``_MAX_LISTINGS`` prefixes: a miss per distinct prompt must not
grow memory without bound.

Behaviour on faults (the engine turns every raised fault into a counted miss):

* ``read`` returns the bytes, ``None`` for a missing object (404/NoSuchKey), and raises
  :class:`TierError` for anything else (connection refused, 5xx, SlowDown/503 throttling, a
  timeout). It makes one attempt and never waits longer than ``timeout`` seconds.
* ``write`` retries with exponential backoff and full jitter, up to ``retries`` retries, each
  attempt bounded by ``write_timeout``; then raises :class:`TierError`. A 4xx other than
  throttling (access denied, no such bucket) is not retried.
* ``start`` raises for configuration faults (no such bucket, bad credentials), but a store that
  is merely unreachable (refused, timeout, 5xx) starts empty: the fault is counted and logged,
  and later ``refresh`` calls find the chunks once it is back.

botocore's own retries are off: they would stack under our ``timeout`` and hide faults from the
counters. Request bodies are sent as ``UNSIGNED-PAYLOAD`` by default, because SigV4 over plain
http otherwise sha256-hashes every body on the event loop (20 ms per 32 MiB here); every chunk
carries its own checksums, which the engine verifies on read.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from .._errors import ConfigError, TierError
from .._executor import Executor
from .._keys import KEY_BYTES
from .._log import RateLimitedLog
from .._validate import (
    boolean,
    non_negative_float,
    non_negative_int,
    parse_size,
    positive_float,
    positive_int,
    shown,
)
from ..codec import CODECS
from ..stats import S3Stats, as_dict
from ._ordering import KeyOrder
from .base import (
    ChunkListing,
    ChunkMeta,
    ListingBuilder,
    StorageTier,
    TierContext,
    own_executor,
)

__all__ = ["S3Store", "S3Tier"]

logger = logging.getLogger("musacache.s3")

_NAME_RE = re.compile(r"^([0-9a-f]{64})/([0-9a-f]{64})\.([1-9][0-9]{0,9})\.kvc$")
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException",
                             "RequestLimitExceeded", "TooManyRequestsException",
                             "ServiceUnavailable"})
# 4xx codes worth retrying: the request itself was fine.
_TRANSIENT_CODES = frozenset({"RequestTimeout", "RequestTimeoutException", "InternalError",
                              "OperationAborted"})
_CONFIG_CODES = frozenset({"NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                           "SignatureDoesNotMatch", "AllBucketsDisabled", "InvalidBucketName",
                           "AuthorizationHeaderMalformed", "PermanentRedirect"})
_MIN_PART = 5 * 1024**2  # S3's smallest multipart part (except the last)
# Reused listings kept at most (each holds one prefix's ChunkMetas): the prefixes a node asks
# about are one per distinct miss, so without a bound they grow with the traffic.
_MAX_LISTINGS = 256


@dataclass(frozen=True)
class S3Tier:
    """An S3-compatible bucket, shared by every node that names the same bucket and prefix.

    Credentials: ``access_key_id``/``secret_access_key``/``session_token`` if given, else the
    standard AWS chain (environment, shared config files, instance metadata). Requests use
    path-style addressing so MinIO, Ceph and Swift work without DNS tricks. Every field is a
    plain value so TOML and ``MUSACACHE_TIERS__N__*`` variables can build it.
    """

    bucket: str
    prefix: str = "musacache"
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    #: Requests in flight at once (also the HTTP connection pool size).
    max_concurrency: int = 16
    #: A read never waits longer than this (seconds); then it is a counted miss.
    timeout: float = 10.0
    connect_timeout: float = 5.0
    #: Socket read timeout of one HTTP response (seconds).
    read_timeout: float = 10.0
    #: Retries of a failed write (so ``retries + 1`` attempts), with backoff and jitter.
    retries: int = 3
    #: First backoff delay in seconds; it doubles per retry (capped at 5 s), fully jittered.
    retry_backoff: float = 0.1
    #: Bound of one write attempt (seconds).
    write_timeout: float = 60.0
    codec: str = "lz4"
    write_through: bool = False
    create_bucket: bool = False
    #: Seconds a listing is reused by ``refresh`` for the same prefix; 0 lists every time (the
    #: engine already spaces refreshes by ``CacheConfig.refresh_interval``).
    refresh_interval: float = 0.0
    #: Objects at least this big are uploaded in parts and read with ranged GETs in parallel;
    #: 0 turns both off. Off by default: not faster against the servers we test.
    multipart_threshold: int | str = 0
    part_size: int | str = 8 * 1024**2
    #: SHA256-sign request bodies (hashes each body on the event loop; see module docstring).
    sign_payload: bool = False
    #: Bytes the engine may store here; ``None`` means unbounded.
    capacity_bytes: int | str | None = None
    #: At most one log line per fault kind per this many seconds.
    log_interval: float = 30.0
    name: str = "s3"
    kind: Literal["s3"] = field(default="s3", init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.name
        for opt in ("bucket", "prefix", "access_key_id", "secret_access_key", "session_token"):
            value = getattr(self, opt)
            # The env loader reads "12345" as an int; these settings are names, not numbers.
            if isinstance(value, int) and not isinstance(value, bool) \
                    and value.bit_length() < 10_000:  # str() refuses ints past 4300 digits
                object.__setattr__(self, opt, str(value))
        if self.prefix is None:  # an empty env value reads as None
            object.__setattr__(self, "prefix", "")
        if not isinstance(self.bucket, str) or not self.bucket:
            raise ConfigError(f"{n}.bucket must be a non-empty string, got {shown(self.bucket)}")
        if not isinstance(self.prefix, str):
            raise ConfigError(f"{n}.prefix must be a string, got {shown(self.prefix)}")
        object.__setattr__(self, "prefix", self.prefix.strip("/"))
        for opt in ("endpoint_url", "region", "access_key_id", "secret_access_key",
                    "session_token"):
            value = getattr(self, opt)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{n}.{opt} must be a string or unset, "
                                  f"got {type(value).__name__}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(f"{n}: set both access_key_id and secret_access_key, or neither")
        if self.codec not in CODECS:
            raise ConfigError(f"{n}.codec must be one of {CODECS}, got {shown(self.codec)}")
        for flag in ("write_through", "create_bucket", "sign_payload"):
            boolean(getattr(self, flag), f"{n}.{flag}")
        object.__setattr__(self, "max_concurrency", positive_int(
            self.max_concurrency, f"{n}.max_concurrency"))
        object.__setattr__(self, "retries", non_negative_int(self.retries, f"{n}.retries"))
        for opt in ("timeout", "connect_timeout", "read_timeout", "write_timeout"):
            object.__setattr__(self, opt, positive_float(getattr(self, opt), f"{n}.{opt}"))
        for opt in ("retry_backoff", "refresh_interval", "log_interval"):
            object.__setattr__(self, opt, non_negative_float(getattr(self, opt), f"{n}.{opt}"))
        object.__setattr__(self, "multipart_threshold",
                           parse_size(self.multipart_threshold, what=f"{n}.multipart_threshold"))
        part = parse_size(self.part_size, what=f"{n}.part_size")
        if part < _MIN_PART:
            raise ConfigError(f"{n}.part_size must be at least 5 MiB (S3's smallest part), "
                              f"got {part}")
        object.__setattr__(self, "part_size", part)
        if self.capacity_bytes is not None:
            object.__setattr__(self, "capacity_bytes",
                               parse_size(self.capacity_bytes, what=f"{n}.capacity_bytes"))

    def build(self) -> S3Store:
        return S3Store(self)


def _error_code(e: BaseException) -> tuple[str, int]:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _classify(e: BaseException) -> tuple[str, bool]:
    """``(fault kind, worth retrying)`` for an exception from the S3 client."""
    if isinstance(e, TimeoutError):
        return "timeout", True
    code, status = _error_code(e)
    if code or status:
        if code in _THROTTLE_CODES or status in (429, 503):
            return "throttled", True
        if status >= 500 or code in _TRANSIENT_CODES:
            return "server error", True
        return f"rejected ({code or status})", False
    # Connection refused/reset, DNS, socket timeouts, truncated bodies: botocore and aiohttp
    # errors that carry no S3 response.
    return "unreachable", True


def _is_missing(e: BaseException) -> bool:
    code, status = _error_code(e)
    return code in _MISSING_CODES or status == 404


class S3Store(StorageTier):
    """The running S3 tier built by :meth:`S3Tier.build`: one aiobotocore client, opened in
    ``start`` and closed in ``aclose``."""

    shared = True
    kind = "s3"

    def __init__(self, config: S3Tier) -> None:
        self.config = config
        self.name = config.name
        self.capacity_bytes = None if config.capacity_bytes is None else int(config.capacity_bytes)
        self.write_through = config.write_through
        self.codec = config.codec
        self.timeout = config.timeout
        self.max_concurrency = config.max_concurrency
        self._client: Any = None
        self._executor: Executor | None = None  # the cache's, or the tier's own
        self._owns_executor = False
        self._stack: contextlib.AsyncExitStack | None = None
        self._base = ""
        self._ctx: TierContext | None = None
        # key -> (object name, size) of every chunk we listed or wrote: delete(key) needs the
        # name. Never a reason to skip a write (see the module docstring).
        self._known: dict[bytes, tuple[str, int]] = {}
        # Other names listed for a known key (the same key in another parent's folder: a
        # stray or forged object). The directory serves the first; a delete removes them all
        # (it removed only the last listed, and the served one came back).
        self._more_names: dict[bytes, set[str]] = {}
        self._order = KeyOrder()
        # prefix -> (when listed, what was there), least recently used first.
        self._listings: OrderedDict[str, tuple[float, list[ChunkMeta]]] = OrderedDict()
        self._log = RateLimitedLog(logger, config.log_interval)
        self._c = S3Stats()

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, ctx: TierContext) -> ChunkListing:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        cfg = self.config
        self._ctx = ctx
        self._executor, self._owns_executor = own_executor(ctx, self._executor,
                                                           self._owns_executor, self.name)
        name = ctx.storage_name
        self._base = f"{cfg.prefix}/{name}" if cfg.prefix else name
        s3_options: dict[str, Any] = {"addressing_style": "path"}
        if not cfg.sign_payload:
            s3_options["payload_signing_enabled"] = False
        client_config = AioConfig(
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=cfg.max_concurrency,
            s3=s3_options,
            # botocore >= 1.36 adds CRC trailers to uploads by default, which many
            # S3-compatible servers reject; our objects carry their own checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Loading botocore's service models is blocking file I/O: do it in a thread.
            warm_up_loader_caches=True,
        )
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(get_session().create_client(
                "s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                aws_access_key_id=cfg.access_key_id, aws_secret_access_key=cfg.secret_access_key,
                aws_session_token=cfg.session_token, config=client_config))
        except Exception as e:
            await stack.aclose()
            raise TierError(f"s3 tier {self.name!r}: cannot create the S3 client: {e}") from e
        self._stack = stack
        try:
            if cfg.create_bucket:
                await self._create_bucket()
            return await self._list_all()
        except BaseException:
            await self.aclose()
            raise

    async def _create_bucket(self) -> None:
        cfg = self.config
        kwargs: dict[str, Any] = {"Bucket": cfg.bucket}
        region = self.client.meta.region_name  # the configured one, or the AWS chain's
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            with anyio.fail_after(self.timeout):
                await self.client.create_bucket(**kwargs)
        except Exception as e:
            code, _ = _error_code(e)
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return
            kind, retryable = _classify(e)
            if retryable:
                # Unreachable: start() then starts empty, like a failed listing does.
                self._fault("create bucket", kind, f"creating bucket {cfg.bucket!r} failed: "
                                                   f"{e!r}")
                return
            raise TierError(f"s3 tier {self.name!r}: cannot create bucket {cfg.bucket!r}: "
                            f"{e}") from e

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
        if self._owns_executor and self._executor is not None:
            self._executor.close()

    @property
    def client(self) -> Any:
        if self._client is None:
            raise TierError(f"s3 tier {self.name!r} is not started")
        return self._client

    # -- names and listings -------------------------------------------------------------------

    def object_name(self, key: bytes, parent: bytes, num_tokens: int) -> str:
        if len(key) != KEY_BYTES or len(parent) != KEY_BYTES:
            raise TierError(f"chunk keys are {KEY_BYTES} bytes, got {len(key)} and "
                            f"{len(parent)}")
        return f"{self._base}/{parent.hex()}/{key.hex()}.{num_tokens}.kvc"

    async def refresh(self, parent: bytes | None = None) -> list[ChunkMeta]:
        """List what is stored now: one parent's children, or (``parent=None``) everything
        under this fingerprint.

        A per-parent refresh is a single prefix listing, however big the bucket is, which is
        what a miss needs to know ("did another node store the next chunk?"); the engine walks
        down a chain one parent at a time. The whole-prefix form pages through everything
        (1000 names per request) and is what ``start`` uses. Raises :class:`TierError`.
        """
        return await self._list(parent)

    async def _list(self, parent: bytes | None) -> list[ChunkMeta]:
        prefix = f"{self._base}/" if parent is None else f"{self._base}/{parent.hex()}/"
        interval = self.config.refresh_interval
        cached = self._listings.get(prefix)
        if cached is not None:
            if time.monotonic() - cached[0] < interval:
                self._listings.move_to_end(prefix)
                return list(cached[1])
            del self._listings[prefix]  # expired: never reused again
        metas: list[ChunkMeta] = []
        try:
            async for page in self._pages(prefix):
                for obj in page.get("Contents", ()):
                    meta = self._parse(obj)
                    if meta is not None:
                        metas.append(meta)
        except Exception as e:
            raise self._list_error(e, prefix) from e
        self._c.lists += 1
        for m in metas:
            self._note(m.key, m.parent, m.num_tokens, m.stored_bytes)
        if interval > 0:  # with 0 a listing is never reused: keeping it would only cost memory
            self._listings[prefix] = (time.monotonic(), metas)
            while len(self._listings) > _MAX_LISTINGS:
                self._listings.popitem(last=False)
        return list(metas)

    def _note(self, key: bytes, parent: bytes, num_tokens: int, size: int) -> None:
        """A listed object's name for ``key``: the first one known, others kept aside."""
        name = self.object_name(key, parent, num_tokens)
        have = self._known.get(key)
        if have is None or have[0] == name:
            self._known[key] = (name, size)
        else:
            self._more_names.setdefault(key, set()).add(name)

    async def _list_all(self) -> ChunkListing:
        """Everything under this fingerprint (``start``), in compact form: each page's
        objects go into flat buffers as it arrives, so no step of the loop holds more than a
        page of them, however big the bucket. Not kept for reuse."""
        prefix = f"{self._base}/"
        found = ListingBuilder()
        try:
            async for page in self._pages(prefix):
                for obj in page.get("Contents", ()):
                    m = self._parse(obj)
                    if m is not None:
                        found.add(m.key, m.parent, m.num_tokens, m.raw_bytes, m.stored_bytes,
                                  m.last_used)
                        self._note(m.key, m.parent, m.num_tokens, m.stored_bytes)
        except Exception as e:
            err = self._list_error(e, prefix)
            _, retryable = _classify(e)
            if retryable and _error_code(e)[0] not in _CONFIG_CODES:
                return ChunkListing.empty()  # unreachable for now: start empty, refresh later
            raise err from e
        self._c.lists += 1
        assert self._executor is not None, "the tier is started"
        listing = await self._executor.run(found.build)
        return listing.give()  # not kept here

    def _list_error(self, e: Exception, prefix: str) -> TierError:
        """Count a failed listing; the error that says so."""
        self._c.list_faults += 1
        kind, _ = _classify(e)
        self._fault("list", kind, f"listing {prefix} failed: {e!r}")
        return TierError(f"s3 tier {self.name!r}: listing s3://{self.config.bucket}/"
                         f"{prefix} failed ({kind}): {e}")

    async def _pages(self, prefix: str) -> AsyncIterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.config.bucket, Prefix=prefix).__aiter__()
        while True:
            with anyio.fail_after(self.timeout):  # per page: a big bucket may take many
                try:
                    page = await pages.__anext__()
                except StopAsyncIteration:
                    return
            yield page

    def _parse(self, obj: dict[str, Any]) -> ChunkMeta | None:
        ctx = self._ctx
        name = str(obj.get("Key", ""))
        m = _NAME_RE.match(name[len(self._base) + 1 :]) if name.startswith(self._base) else None
        if ctx is None or m is None:
            return None  # not one of ours (a stray upload, or another layout)
        tokens = int(m[3])
        if tokens > ctx.chunk_size:
            return None
        modified = obj.get("LastModified")
        return ChunkMeta(key=bytes.fromhex(m[2]), parent=bytes.fromhex(m[1]), num_tokens=tokens,
                         raw_bytes=ctx.spec.nbytes(tokens), stored_bytes=int(obj.get("Size", 0)),
                         last_used=modified.timestamp() if modified is not None else 0.0)

    # -- reads --------------------------------------------------------------------------------

    async def read(self, meta: ChunkMeta) -> bytes | None:
        name = self.object_name(meta.key, meta.parent, meta.num_tokens)
        threshold = int(self.config.multipart_threshold)
        try:
            with anyio.fail_after(self.timeout):
                if threshold and meta.stored_bytes >= threshold:
                    obj = await self._get_ranged(name)
                else:
                    obj = await self._get(name)
        except Exception as e:
            if _is_missing(e):
                self._c.read_misses += 1
                self._known.pop(meta.key, None)
                return None
            self._c.read_faults += 1
            kind, _ = _classify(e)
            self._fault("read", kind, f"read of {name} failed: {e!r}")
            raise TierError(f"s3 tier {self.name!r}: read of {name} failed ({kind}): "
                            f"{e}") from e
        self._c.reads += 1
        self._c.bytes_out += len(obj)
        return obj

    async def _get(self, name: str, byte_range: str | None = None) -> bytes:
        kwargs: dict[str, Any] = {"Bucket": self.config.bucket, "Key": name}
        if byte_range is not None:
            kwargs["Range"] = byte_range
        response = await self.client.get_object(**kwargs)
        async with response["Body"] as body:
            data: bytes = await body.read()
        return data

    async def _get_ranged(self, name: str) -> bytes:
        """Fetch ``name`` in ``part_size`` ranges, in parallel after the first one (whose
        Content-Range tells the total size, so a stale ``stored_bytes`` is harmless)."""
        part = int(self.config.part_size)
        response = await self.client.get_object(Bucket=self.config.bucket, Key=name,
                                                Range=f"bytes=0-{part - 1}")
        async with response["Body"] as body:
            first: bytes = await body.read()
        total_text = str(response.get("ContentRange", "")).rpartition("/")[2]
        total = int(total_text) if total_text.isdigit() else len(first)
        if total <= len(first):
            return first
        self._c.ranged_reads += 1
        starts = list(range(len(first), total, part))
        parts: list[bytes] = [b""] * len(starts)

        async def fetch(i: int, start: int) -> None:
            end = min(start + part, total) - 1
            parts[i] = await self._get(name, f"bytes={start}-{end}")
            if len(parts[i]) != end - start + 1:
                raise TierError(f"ranged read of {name} returned {len(parts[i])} bytes for "
                                f"{start}-{end}")

        async with anyio.create_task_group() as tg:
            for i, start in enumerate(starts):
                tg.start_soon(fetch, i, start)
        return b"".join([first, *parts])

    # -- writes -------------------------------------------------------------------------------

    async def write(self, meta: ChunkMeta, obj: bytes) -> None:
        name = self.object_name(meta.key, meta.parent, meta.num_tokens)
        async with self._order.hold(meta.key):
            await self._write(meta, name, obj)

    async def _write(self, meta: ChunkMeta, name: str, obj: bytes) -> None:
        cfg = self.config
        threshold = int(cfg.multipart_threshold)
        attempt = 0
        while True:
            try:
                with anyio.fail_after(cfg.write_timeout):
                    if threshold and len(obj) >= threshold:
                        await self._put_multipart(name, obj)
                    else:
                        await self.client.put_object(Bucket=cfg.bucket, Key=name, Body=obj)
                break
            except Exception as e:
                kind, retryable = _classify(e)
                if not retryable or attempt >= cfg.retries:
                    self._c.write_failures += 1
                    self._fault("write", kind, f"write of {name} failed after {attempt + 1} "
                                               f"attempt(s): {e!r}")
                    raise TierError(f"s3 tier {self.name!r}: write of {name} failed ({kind}) "
                                    f"after {attempt + 1} attempt(s): {e}") from e
                self._c.write_retries += 1
                self._c.last_error = f"write ({kind}): {e!r}"
                # Full jitter: spreads the retries of many writers that failed together.
                delay = min(5.0, cfg.retry_backoff * 2**attempt)
                await anyio.sleep(random.uniform(0, delay))
                attempt += 1
        self._c.writes += 1
        self._c.bytes_in += len(obj)
        self._known[meta.key] = (name, len(obj))
        self._forget_listings(meta.parent)

    def _forget_listings(self, parent: bytes) -> None:
        """Our own change makes the reused listings that would show it stale."""
        self._listings.pop(f"{self._base}/", None)
        self._listings.pop(f"{self._base}/{parent.hex()}/", None)

    async def _put_multipart(self, name: str, obj: bytes) -> None:
        cfg = self.config
        part = int(cfg.part_size)
        upload = await self.client.create_multipart_upload(Bucket=cfg.bucket, Key=name)
        upload_id = upload["UploadId"]
        view = memoryview(obj)
        starts = list(range(0, len(obj), part))
        etags: list[str] = [""] * len(starts)

        async def send(i: int, start: int) -> None:
            response = await self.client.upload_part(
                Bucket=cfg.bucket, Key=name, UploadId=upload_id, PartNumber=i + 1,
                Body=bytes(view[start : start + part]))
            etags[i] = response["ETag"]

        try:
            async with anyio.create_task_group() as tg:
                for i, start in enumerate(starts):
                    tg.start_soon(send, i, start)
            await self.client.complete_multipart_upload(
                Bucket=cfg.bucket, Key=name, UploadId=upload_id,
                MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": i + 1}
                                           for i, etag in enumerate(etags)]})
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout), \
                    contextlib.suppress(Exception):
                await self.client.abort_multipart_upload(Bucket=cfg.bucket, Key=name,
                                                         UploadId=upload_id)
            raise
        self._c.multipart_writes += 1

    async def delete(self, key: bytes) -> None:
        async with self._order.hold(key):
            await self._delete(key)

    async def _delete(self, key: bytes) -> None:
        known = self._known.get(key)
        if known is None:
            return  # never listed or written here: there is no name to delete
        for name in (known[0], *sorted(self._more_names.get(key, ()))):
            parent_hex = name.rsplit("/", 2)[-2]
            self._forget_listings(bytes.fromhex(parent_hex))
            try:
                with anyio.fail_after(self.timeout):
                    # One key per request: Swift's DeleteObjects insists on Content-MD5.
                    await self.client.delete_object(Bucket=self.config.bucket, Key=name)
                self._c.deletes += 1
            except Exception as e:
                if not _is_missing(e):  # (gone already: nothing to count, nothing to retry)
                    # The names stay known: the delete is tried again (the caller's retry).
                    kind, _ = _classify(e)
                    self._fault("delete", kind, f"delete of {name} failed: {e!r}")
                    raise TierError(f"s3 tier {self.name!r}: delete of {name} failed "
                                    f"({kind}): {e}") from e
            if name == known[0]:
                self._known.pop(key, None)
            else:
                self._more_names[key].discard(name)
        self._more_names.pop(key, None)

    # -- reporting ----------------------------------------------------------------------------

    def _fault(self, op: str, kind: str, message: str) -> None:
        self._c.last_error = f"{op} ({kind}): {message}"
        self._log.warn(self.name, f"{op} ({kind})", message)

    def stats(self) -> dict[str, Any]:
        return {**as_dict(self._c), "kind": self.kind, "known_objects": len(self._known),
                "listings_kept": len(self._listings)}

    def __repr__(self) -> str:
        cfg = self.config
        return (f"S3Store(name={self.name!r}, bucket={cfg.bucket!r}, prefix={cfg.prefix!r}, "
                f"endpoint_url={cfg.endpoint_url!r})")

