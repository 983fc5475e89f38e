"""The node server's small-request path does little Python per request (issue 12, "get ops/s
at least 0.4x of the echo"): counted, never timed. Speed itself is shown by ``musacache bench
scale --only server``.

Counted here: the Python-level calls the server makes for a batch of gets into a buffer the
connection keeps, outside the cache's own direct read path; the msgpack Packers made per
frame; the client's mapping lookups per get of a buffer the server keeps. And that what the
lean path skips is still right: frames byte for byte as msgpack writes them, a re-pointed
``out`` bound afresh.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import musacache as mc
from helpers import prefix_kv, small_spec
from musacache import ipc
from musacache.ipc import _wire as proto
from musacache.server import Server, ServerConfig
from musacache.server import client as client_mod

CH = 16
HEADER = struct.Struct(">2sBBI")
BATCH = 32


def _config(tmp_path: Path, spec: mc.KVSpec) -> ServerConfig:
    return ServerConfig(str(tmp_path / "r" / "s.sock"), chunk_size=CH,
                        tiers=(mc.HostTier(spec.nbytes(CH) * 64),))


# -- frames: the lean encoders write what msgpack writes -------------------------------------

_IDS = st.one_of(st.integers(0, 300), st.integers(0, 70_000), st.integers(0, (1 << 64) - 1),
                 st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32,
                                  (1 << 64) - 1]))
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.binary(max_size=300), st.text(max_size=40),
                    st.lists(st.integers(0, 1000), max_size=5))


@settings(max_examples=300, deadline=None)
@given(rid=_IDS, op=st.sampled_from(["get", "lookup", "put", "stats", "x" * 128]),
       args=st.one_of(st.none(), st.dictionaries(st.text(min_size=1, max_size=8), _VALUES,
                                                  max_size=4)),
       nfds=st.integers(0, proto.MAX_FDS_PER_FRAME), result=_VALUES)
def test_frames_are_byte_for_byte_what_msgpack_writes(rid: int, op: str, args: Any, nfds: int,
                                                      result: Any) -> None:
    """Requests and replies are packed from cached prefixes, one reused Packer and the id in
    its shortest msgpack form: the bytes must be exactly the header plus ``msgpack.packb`` of
    the body, whatever the id's size."""
    body = {"id": rid, "op": op, "args": {} if args is None else args}
    frame = proto.encode_request(rid, op, args, nfds=nfds)
    packed = msgpack.packb(body, use_bin_type=True)
    assert frame == HEADER.pack(b"MK", proto.PROTOCOL_VERSION, nfds, len(packed)) + packed
    reply = msgpack.packb({"id": rid, "result": result}, use_bin_type=True)
    expected = HEADER.pack(b"MK", proto.PROTOCOL_VERSION, 0, len(reply)) + reply
    assert proto.encode_reply(rid, result) == expected
    decoder = proto.FrameDecoder()
    if nfds == 0:  # (a frame that declares fds needs them to decode)
        decoder.feed(frame)
        assert decoder.next_frame() == proto.Request(rid, op, {} if args is None else args)
    decoder.feed(expected)
    assert decoder.next_frame() == proto.Reply(rid, result)


def test_bad_ids_ops_and_sizes_are_still_refused() -> None:
    for rid in (-1, 1 << 64, 1.0, True, "1", None):
        with pytest.raises(mc.ProtocolError, match="request id"):
            proto.encode_request(rid, "get", {})  # type: ignore[arg-type]
        with pytest.raises(mc.ProtocolError, match="request id"):
            proto.encode_reply(rid, 1)  # type: ignore[arg-type]
    for op in ("", "x" * 129, 3, None, ["get"]):
        with pytest.raises(mc.ProtocolError, match="op"):
            proto.encode_request(1, op, {})  # type: ignore[arg-type]
    with pytest.raises(mc.ProtocolError, match="fds"):
        proto.encode_request(1, "get", {}, nfds=proto.MAX_FDS_PER_FRAME + 1)
    with pytest.raises(mc.ProtocolError, match="cannot encode"):
        proto.encode_request(1, "get", {"x": object()})
    with pytest.raises(mc.ProtocolError, match="exceeds the limit"):
        proto.encode_request(1, "get", {"x": b"a" * 200}, max_frame_size=100)
    with pytest.raises(mc.ProtocolError, match="exceeds the limit"):
        proto.encode_reply(1, b"a" * 200, max_frame_size=100)
    # a failed pack leaves the thread's Packer clean for the next frame
    body = msgpack.packb({"id": 5, "result": 6})
    assert proto.encode_reply(5, 6) == HEADER.pack(b"MK", 1, 0, len(body)) + body


def test_frames_made_on_several_threads_at_once_are_whole() -> None:
    """Each thread packs with a Packer of its own."""
    failures: list[str] = []

    def work(seed: int) -> None:
        for i in range(2000):
            args = {"tokens": bytes([seed]) * (i % 97), "buf": i}
            body = msgpack.packb({"id": i, "op": "get", "args": args})
            if proto.encode_request(i, "get", args)[8:] != body:
                failures.append(f"thread {seed} frame {i}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


# -- the client: a buffer the server keeps is found by the tensor object ---------------------


async def test_a_kept_out_costs_the_client_no_mapping_lookup(tmp_path, monkeypatch):
    """A get into an ``out`` the server keeps finds the buffer's id from the tensor object
    (checked against the address, shape and dtype it was bound with): before, every get
    asked which shared mapping holds ``out`` and built the view's key (most of a small
    get's client side)."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(2 * CH))
            kv = prefix_kv(spec, toks)
            assert await c.put(toks, ipc.to_shared(kv)) == 2 * CH
            out = ipc.empty_shared(spec.shape(2 * CH), spec.dtype)
            assert (await c.get(toks, out=out)).num_tokens == 2 * CH  # binds the buffer
            asked: list[object] = []
            real = client_mod.shared_segment

            def counting(t: torch.Tensor) -> object | None:
                asked.append(t)
                return real(t)

            monkeypatch.setattr(client_mod, "shared_segment", counting)
            for _ in range(5):
                out.zero_()
                hit = await c.get(toks, out=out)
                assert hit.num_tokens == 2 * CH and hit.kv is out
                assert hit.tiers == {"host": 2 * CH}
                assert torch.equal(out, kv)
            # a prefix hit is a view of out, as before
            out.zero_()
            longer = [*toks, *range(5000, 5000 + CH)]
            big = ipc.empty_shared(spec.shape(3 * CH), spec.dtype)
            assert (await c.get(longer, out=big)).num_tokens == 2 * CH
            hit = await c.get(longer, out=big)
            assert hit.num_tokens == 2 * CH
            assert hit.kv.data_ptr() == big.data_ptr()
            assert torch.equal(hit.kv, kv)
            assert len(asked) == 1  # only big's first get asked
        srv.stop()
        await serving


async def test_an_out_re_pointed_in_place_is_bound_afresh(tmp_path):
    """The same tensor object pointed at other memory (``set_``) or another shape is not the
    view the server keeps: the get binds it again, and the data lands in the new memory."""
    spec = small_spec()
    cfg = _config(tmp_path, spec)
    async with Server(cfg) as srv:
        serving = asyncio.create_task(srv.serve_forever())
        async with mc.connect(cfg.socket_path, spec=spec, namespace="srv", chunk_size=CH) as c:
            toks = list(range(2 * CH))
            kv = prefix_kv(spec, toks)
            assert await c.put(toks, ipc.to_shared(kv)) == 2 * CH
            out = ipc.empty_shared(spec.shape(2 * CH), spec.dtype)
            first = out.untyped_storage()
            assert (await c.get(toks, out=out)).num_tokens == 2 * CH
            other = ipc.empty_shared(spec.shape(2 * CH), spec.dtype)
            out.set_(other.untyped_storage(), 0, out.shape, out.stride())
            old_view = torch.empty(0, dtype=spec.dtype).set_(first, 0, out.shape, out.stride())
            old_view.zero_()
            assert (await c.get(toks, out=out)).num_tokens == 2 * CH
            assert torch.equal(other, kv) and torch.equal(out, kv)
            assert not old_view.any()  # nothing written to the memory out no longer views
            # a smaller view of the same memory under the same object: a new binding too
            out.set_(other.untyped_storage(), 0, spec.shape(CH), _contiguous(spec.shape(CH)))
            other.zero_()
            hit = await c.get(toks[:CH], out=out)
            assert hit.num_tokens == CH and torch.equal(out, kv.narrow(spec.token_dim, 0, CH))
            assert not other.flatten()[out.numel():].any()
        srv.stop()
        await serving


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


