"""The wire protocol (frames, decoder, error mapping) and the Unix-socket plumbing."""

from __future__ import annotations

import os
import random
import socket
import struct
import tempfile
import time

import anyio
import anyio.lowlevel
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from musacache import _errors
from musacache._errors import CacheUnavailableError, MusaCacheError, ProtocolError
from musacache.ipc._wire import (
    HEADER_SIZE,
    MAGIC,
    MAX_FDS_PER_FRAME,
    PROTOCOL_VERSION,
    Connection,
    FrameDecoder,
    FrameError,
    Reply,
    Request,
    connect_unix,
    encode_error,
    encode_frame,
    encode_reply,
    encode_request,
    error_from_wire,
    error_to_wire,
    peer_credentials,
    recv_with_fds,
    send_with_fds,
)

HEADER = struct.Struct(">2sBBI")


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def decode_all(decoder: FrameDecoder) -> list[Request | Reply]:
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    return frames


def raw_frame(body: bytes, *, nfds: int = 0, version: int = PROTOCOL_VERSION,
              magic: bytes = MAGIC, length: int | None = None) -> bytes:
    return HEADER.pack(magic, version, nfds, len(body) if length is None else length) + body


# -- encoding and decoding ----------------------------------------------------------------


def test_request_and_replies_roundtrip() -> None:
    decoder = FrameDecoder()
    args = {"tokens": list(range(10)), "blob": b"\x00\xff", "nested": {"a": [1.5, None, True]}}
    decoder.feed(encode_request(7, "lookup", args))
    decoder.feed(encode_reply(7, {"hit": 256}))
    decoder.feed(encode_error(8, _errors.SlotRangeError("slot 99 is outside the cache")))
    request, reply, error = decode_all(decoder)
    assert request == Request(7, "lookup", args)
    assert reply == Reply(7, {"hit": 256})
    assert reply.ok and reply.unwrap() == {"hit": 256}
    assert isinstance(error, Reply) and error.id == 8 and not error.ok
    with pytest.raises(_errors.SlotRangeError, match="slot 99"):
        error.unwrap()
    assert decoder.buffered == 0


def test_header_layout_is_what_the_docs_say() -> None:
    frame = encode_request(1, "stats", nfds=3)
    magic, version, nfds, length = HEADER.unpack_from(frame)
    assert (magic, version, nfds) == (b"MK", PROTOCOL_VERSION, 3)
    assert length == len(frame) - HEADER_SIZE == len(frame) - 8
    assert msgpack.unpackb(frame[8:]) == {"id": 1, "op": "stats", "args": {}}


def test_partial_reads_byte_by_byte_and_many_frames_per_read() -> None:
    frames = [encode_request(i, "get", {"i": i, "pad": "x" * i}) for i in range(50)]
    stream = b"".join(frames)
    one_by_one = FrameDecoder()
    got = []
    for i in range(len(stream)):
        one_by_one.feed(stream[i:i + 1])
        got.extend(decode_all(one_by_one))
    all_at_once = FrameDecoder()
    all_at_once.feed(stream)
    expected = [Request(i, "get", {"i": i, "pad": "x" * i}) for i in range(50)]
    assert got == expected
    assert decode_all(all_at_once) == expected


def test_oversized_length_is_refused_from_the_header_alone() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    decoder.feed(raw_frame(b"", length=(1 << 32) - 1))
    with pytest.raises(FrameError, match="exceeds the limit") as info:
        decoder.next_frame()
    assert info.value.fatal
    assert decoder.buffered == 0
    with pytest.raises(FrameError):  # sticky
        decoder.feed(b"more")


def test_frame_at_the_limit_is_accepted() -> None:
    body_budget = 1000
    frame = encode_request(1, "put", {"x": b"a" * (body_budget - 30)})
    decoder = FrameDecoder(max_frame_size=len(frame) - HEADER_SIZE)
    decoder.feed(frame)
    assert isinstance(decoder.next_frame(), Request)


def test_bad_magic_fails_on_the_first_byte() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"G")
    with pytest.raises(FrameError, match="magic") as info:
        decoder.next_frame()
    assert info.value.fatal


def test_wrong_version_is_fatal_and_named() -> None:
    decoder = FrameDecoder()
    decoder.feed(raw_frame(msgpack.packb({"id": 1, "op": "x"}), version=PROTOCOL_VERSION + 1))
    with pytest.raises(FrameError, match=f"version {PROTOCOL_VERSION + 1}") as info:
        decoder.next_frame()
    assert info.value.fatal


def test_unknown_op_is_recoverable_with_the_request_id() -> None:
    decoder = FrameDecoder(ops={"get", "put"}, expect="request")
    decoder.feed(encode_request(41, "drop_tables") + encode_request(42, "get"))
    with pytest.raises(FrameError, match="unknown op") as info:
        decoder.next_frame()
    assert not info.value.fatal and info.value.request_id == 41
    assert decoder.next_frame() == Request(42, "get", {})


@pytest.mark.parametrize(
    ("body", "request_id"),
    [
        (b"\xc1", None),  # never-used msgpack byte
        (b"\x92\x01", None),  # truncated array
        (msgpack.packb([1, 2]), None),
        (msgpack.packb({"id": 1}), 1),
        (msgpack.packb({"id": True, "op": "get"}), None),
        (msgpack.packb({"id": -1, "op": "get"}), None),
        (msgpack.packb({"id": 2, "op": 5}), 2),
        (msgpack.packb({"id": 3, "op": ""}), 3),
        (msgpack.packb({"id": 4, "op": "get", "args": [1]}), 4),
        (msgpack.packb({"id": 5, "op": "get", "result": 1}), 5),
        (msgpack.packb({"id": 6, "result": 1, "error": {"type": "x", "message": "y"}}), 6),
        (msgpack.packb({"id": 7, "error": "boom"}), 7),
        (msgpack.packb({"id": None, "result": 1}), None),
        (msgpack.packb({1: 2}), None),
        (msgpack.packb({"id": 8, "op": "get", "args": msgpack.ExtType(5, b"x")}), None),
        (b"\x91" * 5000, None),  # nesting deeper than the unpacker allows
    ],
)
def test_malformed_bodies_are_recoverable_protocol_errors(body: bytes,
                                                          request_id: int | None) -> None:
    decoder = FrameDecoder()
    decoder.feed(raw_frame(body) + encode_request(99, "ok"))
    with pytest.raises(FrameError) as info:
        decoder.next_frame()
    assert isinstance(info.value, ProtocolError)
    assert not info.value.fatal
    assert info.value.request_id == request_id
    assert decoder.next_frame() == Request(99, "ok", {})


def test_expect_filters_the_direction() -> None:
    server = FrameDecoder(expect="request")
    server.feed(encode_reply(3, "x"))
    with pytest.raises(FrameError, match="only requests") as info:
        server.next_frame()
    assert info.value.request_id == 3 and not info.value.fatal
    client = FrameDecoder(expect="reply")
    client.feed(encode_request(4, "get"))
    with pytest.raises(FrameError, match="only replies"):
        client.next_frame()


def test_encoding_errors_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode_request(1, "put", {"x": object()})
    with pytest.raises(ProtocolError, match="exceeds"):
        encode_request(1, "put", {"x": b"a" * 2000}, max_frame_size=1000)
    for bad_id in (-1, 1 << 64, True, 1.0, "1"):
        with pytest.raises(ProtocolError, match="request id"):
            encode_request(bad_id, "get")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="fds"):
        encode_frame({"id": 1, "op": "x"}, nfds=MAX_FDS_PER_FRAME + 1)
    with pytest.raises(ProtocolError, match="op"):
        encode_request(1, "")


# -- fds attached to frames ----------------------------------------------------------------


def test_fds_travel_with_their_frame() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    plain = encode_request(1, "a")
    with_fds = encode_request(2, "b", nfds=2)
    # One read may hold a frame without fds followed by the frame the fds came with.
    decoder.feed(plain + with_fds[:5], [r, w])
    decoder.feed(with_fds[5:])
    first, second = decode_all(decoder)
    assert first.fds == () and second.fds == (r, w)
    os.close(r)
    os.close(w)


def test_fds_on_a_frame_that_declares_none_are_fatal_and_closed() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    decoder.feed(encode_request(1, "a"), [r, w])
    decoder.feed(encode_request(2, "b"))
    # The batch ends inside the first frame: no later frame can claim it.
    with pytest.raises(FrameError, match="declared none") as info:
        decoder.next_frame()
    assert info.value.fatal
    assert not fd_is_open(r) and not fd_is_open(w)


def test_fds_on_an_incomplete_frame_that_declares_none_are_fatal_at_its_header() -> None:
    """Found by a probe: fds sent with the first byte of a frame that declares none, whose
    body never comes, were held by the decoder until the peer went away. Its header says
    the batch ends inside it, so they are refused (and closed) as soon as it is read."""
    r, w = os.pipe()
    decoder = FrameDecoder()
    frame = encode_request(1, "a", {"pad": b"x" * 100})
    decoder.feed(frame[:1], [r, w])
    decoder.feed(frame[1:20])
    with pytest.raises(FrameError, match="declared none") as info:
        decoder.next_frame()
    assert info.value.fatal
    assert not fd_is_open(r) and not fd_is_open(w)


def test_fds_after_frames_that_declare_none_in_one_read_go_to_the_last() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    decoder.feed(encode_request(1, "a") + encode_request(2, "b", nfds=2), [r, w])
    first, second = decoder.next_frame(), decoder.next_frame()
    assert first is not None and first.fds == ()
    assert second is not None and second.fds == (r, w)
    for fd in second.fds:
        os.close(fd)


def test_missing_fds_are_fatal() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_request(1, "a", nfds=1))
    with pytest.raises(FrameError, match="none arrived") as info:
        decoder.next_frame()
    assert info.value.fatal


def test_a_bad_body_closes_its_fds_and_the_stream_goes_on() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    decoder.feed(raw_frame(b"\xc1", nfds=2), [r, w])
    decoder.feed(encode_request(5, "ok"))
    with pytest.raises(FrameError) as info:
        decoder.next_frame()
    assert not info.value.fatal
    assert not fd_is_open(r) and not fd_is_open(w)
    assert decoder.next_frame() == Request(5, "ok", {})


def test_close_releases_pending_fds_and_too_many_fds_is_fatal() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    decoder.feed(encode_request(1, "a", nfds=2)[:3], [r, w])
    decoder.close()
    assert not fd_is_open(r) and not fd_is_open(w)
    fds = [fd for _ in range(2) for fd in os.pipe()]
    greedy = FrameDecoder(max_fds=3)
    with pytest.raises(FrameError, match="more than 3 fds"):
        greedy.feed(b"MK", fds)
    assert not any(fd_is_open(fd) for fd in fds)


# -- error mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", _errors.__all__)
def test_every_error_type_roundtrips(name: str) -> None:
    cls = getattr(_errors, name)
    wire = error_to_wire(cls(f"{name} happened"))
    assert wire == {"type": name, "message": f"{name} happened"}
    back = error_from_wire(msgpack.unpackb(msgpack.packb(wire)))
    assert type(back) is cls and str(back) == f"{name} happened"


def test_every_exported_error_travels_as_itself() -> None:
    """Each error class ``musacache`` exports is in the wire's table, so a client gets that
    class back, not its nearest base (a ``TierTimeoutError`` must not arrive as a bare
    ``TierError``)."""
    import musacache

    exported = {n for n in musacache.__all__
                if isinstance(getattr(musacache, n), type)
                and issubclass(getattr(musacache, n), MusaCacheError)}
    assert exported and exported <= set(_errors.__all__), exported - set(_errors.__all__)


def test_foreign_unknown_and_subclassed_errors() -> None:
    foreign = error_to_wire(KeyError("k"))
    assert foreign["type"] == "MusaCacheError" and "KeyError" in foreign["message"]
    assert error_to_wire(FrameError("bad", fatal=True))["type"] == "ProtocolError"
    unknown = error_from_wire({"type": "FluxCapacitorError", "message": "m"})
    assert type(unknown) is MusaCacheError and "FluxCapacitorError" in str(unknown)
    assert type(error_from_wire({"type": 3})) is ProtocolError
    assert type(error_from_wire(["x"])) is ProtocolError
    with pytest.raises(_errors.PermissionDeniedError):
        Reply(1, error=error_to_wire(_errors.PermissionDeniedError("uid 7"))).unwrap()


# -- fuzzing the decoder ---------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "str", "bytes", "float", "none", "bool"]
    if depth < 3:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, rng.randrange(-(1 << 63), 1 << 64)])
    if kind == "str":
        return "".join(rng.choice("abc\u00e9\u4e2d") for _ in range(rng.randrange(8)))
    if kind == "bytes":
        return rng.randbytes(rng.randrange(16))
    if kind == "float":
        return rng.random()
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_random_value(rng, 3)): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _valid_frame(rng: random.Random) -> bytes:
    rid = rng.randrange(1 << 64)
    choice = rng.randrange(3)
    if choice == 0:
        return encode_request(rid, rng.choice(["get", "put", "x" * rng.randrange(1, 9)]),
                              {"k": _random_value(rng)})
    if choice == 1:
        return encode_reply(rid, _random_value(rng))
    return encode_error(rid, _errors.TierError("s3 down"))


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    choice = rng.randrange(9)
    if choice == 0:  # flip bits
        for _ in range(rng.randrange(1, 9)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 1:  # truncate
        del data[rng.randrange(len(data)):]
    elif choice == 2:  # append garbage
        data += rng.randbytes(rng.randrange(1, 64))
    elif choice == 3:  # lie about the length
        struct.pack_into(">I", data, 4, rng.choice([0, 1, len(data), (1 << 32) - 1,
                                                   rng.randrange(1 << 32)]))
    elif choice == 4:  # lie about the fd count
        data[3] = rng.randrange(256)
    elif choice == 5:  # another version
        data[2] = rng.randrange(256)
    elif choice == 6:  # random body behind a valid header
        body = rng.randbytes(rng.randrange(64))
        data = bytearray(raw_frame(body))
    elif choice == 7:  # any msgpack value as the body
        data = bytearray(raw_frame(msgpack.packb(_random_value(rng))))
    else:  # pure noise
        data = bytearray(rng.randbytes(rng.randrange(1, 128)))
    return bytes(data)


def _drive(decoder: FrameDecoder, stream: bytes, rng: random.Random) -> int:
    """Feed ``stream`` in random chunks, taking frames; return how many frames came out.

    Only ProtocolError may escape; a fatal one ends the stream.
    """
    frames = 0
    pos = 0
    while pos < len(stream):
        step = rng.choice([1, 2, 7, 64, 4096])
        decoder.feed(stream[pos:pos + step])
        pos += step
        assert decoder.buffered <= len(stream)
        while True:
            try:
                frame = decoder.next_frame()
            except FrameError as exc:
                if exc.fatal:
                    return frames
                continue
            if frame is None:
                break
            frames += 1
    return frames


def test_fuzz_decoder_with_random_and_mutated_frames() -> None:
    rng = random.Random(20240531)
    cases = 12_000
    decoded = 0
    started = time.monotonic()
    for _ in range(cases):
        frames = [_valid_frame(rng) for _ in range(rng.randrange(1, 4))]
        index = rng.randrange(len(frames))
        frames[index] = _mutate(rng, frames[index])
        decoder = FrameDecoder(max_frame_size=rng.choice([64, 1024, 1 << 16]),
                               ops=rng.choice([None, {"get", "put"}]),
                               expect=rng.choice(["any", "request", "reply"]))
        try:
            decoded += _drive(decoder, b"".join(frames), rng)
        except FrameError as exc:
            assert exc.fatal  # only a sticky fatal failure escapes feed()
    # The mutations must leave many frames decodable, or the fuzz tests nothing but noise.
    assert decoded > cases // 3
    assert time.monotonic() - started < 30


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=300), chunk=st.integers(1, 64), declared=st.integers(0, 400))
def test_hypothesis_arbitrary_bodies_only_raise_protocol_errors(body: bytes, chunk: int,
                                                                declared: int) -> None:
    decoder = FrameDecoder(max_frame_size=256)
    stream = raw_frame(body, length=declared) + body[:declared]
    try:
        for pos in range(0, len(stream), chunk):
            decoder.feed(stream[pos:pos + chunk])
            while True:
                try:
                    if decoder.next_frame() is None:
                        break
                except FrameError as exc:
                    if exc.fatal:
                        raise
    except ProtocolError:
        pass


# -- sockets -----------------------------------------------------------------------------


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


async def test_send_and_receive_bytes_with_fds(pair) -> None:
    a, b = pair
    a.setblocking(False)
    b.setblocking(False)
    r, w = os.pipe()
    await send_with_fds(a, b"hello", [r, w])
    data, fds = await recv_with_fds(b)
    assert data == b"hello" and len(fds) == 2
    assert [os.fstat(fd).st_ino for fd in fds] == [os.fstat(r).st_ino, os.fstat(w).st_ino]
    assert all(not os.get_inheritable(fd) for fd in fds)
    for fd in (r, w, *fds):
        os.close(fd)


async def test_too_many_fds_for_the_receiver_are_closed(pair) -> None:
    a, b = pair
    b.setblocking(False)
    pipes = [fd for _ in range(3) for fd in os.pipe()]
    before = open_fd_count()
    a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("6i", *pipes))])
    with pytest.raises(ProtocolError, match="more than 2 fds"):
        await recv_with_fds(b, max_fds=2)
    assert open_fd_count() == before
    for fd in pipes:
        os.close(fd)


def test_peer_credentials_of_a_socketpair(pair) -> None:
    assert peer_credentials(pair[0]) == (os.getpid(), os.getuid(), os.getgid())


async def test_connection_many_requests_in_flight_with_fds(pair) -> None:
    a, b = pair
    client, server = Connection(a, expect="reply"), Connection(b, expect="request")
    big = b"k" * 150_000  # bigger than the socket buffer: sends go out in pieces
    pipe_r, pipe_w = os.pipe()
    received: list[Request] = []

    async def send(i: int) -> None:
        fds = [pipe_r] if i % 5 == 0 else []
        await client.send_request(i, "put", {"i": i, "data": big}, fds=fds)

    async def serve() -> None:
        while len(received) < 40:
            frame = await server.receive()
            assert isinstance(frame, Request)
            received.append(frame)
            await server.send_reply(frame.id, frame.args["i"] * 2)

    replies: dict[int, int] = {}

    async def read_replies() -> None:
        while len(replies) < 40:
            frame = await client.receive()
            assert isinstance(frame, Reply)
            replies[frame.id] = frame.unwrap()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            tg.start_soon(read_replies)
            for i in range(40):
                tg.start_soon(send, i)
    assert sorted(r.id for r in received) == list(range(40))
    assert all(r.args["data"] == big and r.args["i"] == r.id for r in received)
    for request in received:
        assert len(request.fds) == (1 if request.id % 5 == 0 else 0)
        for fd in request.fds:
            assert os.fstat(fd).st_ino == os.fstat(pipe_r).st_ino
            os.close(fd)
    assert replies == {i: 2 * i for i in range(40)}
    os.close(pipe_r)
    os.close(pipe_w)


async def test_fds_find_their_frames_when_reads_glue_frames_together(pair) -> None:
    # The kernel glues frames without fds in front of one with fds into a single read and
    # stops after it; all frames are queued before the first read to provoke exactly that.
    a, b = pair
    client, server = Connection(a), Connection(b)
    r, w = os.pipe()
    plan = {1: [], 2: [r], 3: [], 4: [], 5: [r, w], 6: []}
    for rid, fds in plan.items():
        await client.send_request(rid, "op", fds=fds)
    got = {}
    with anyio.fail_after(5):
        for _ in plan:
            frame = await server.receive()
            assert isinstance(frame, Request)
            got[frame.id] = [os.fstat(fd).st_ino for fd in frame.fds]
            for fd in frame.fds:
                os.close(fd)
    assert got == {rid: [os.fstat(fd).st_ino for fd in fds] for rid, fds in plan.items()}
    os.close(r)
    os.close(w)


async def test_receive_does_not_block_the_loop_and_survives_cancellation(pair) -> None:
    a, b = pair
    client, server = Connection(a), Connection(b)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        with anyio.move_on_after(0.2):
            await server.receive()
        assert ticks >= 10
        frame = encode_request(1, "half")
        await client.send_frame(frame)
        # Cancel a receive while only part of the next frame has arrived.
        await send_with_fds(client.socket, encode_request(2, "next")[:4])
        first = await server.receive()
        with anyio.move_on_after(0.05):
            await server.receive()
        await send_with_fds(client.socket, encode_request(2, "next")[4:])
        second = await server.receive()
        tg.cancel_scope.cancel()
    assert isinstance(first, Request) and first.op == "half"
    assert isinstance(second, Request) and second.op == "next"


async def test_eof_clean_and_in_the_middle_of_a_frame() -> None:
    a, b = socket.socketpair()
    server = Connection(b)
    a.sendall(encode_request(1, "bye"))
    a.close()
    assert isinstance(await server.receive(), Request)
    assert await server.receive() is None
    await server.aclose()

    c, d = socket.socketpair()
    torn = Connection(d)
    c.sendall(encode_request(1, "torn")[:-2])
    c.close()
    with pytest.raises(FrameError, match="middle of a frame") as info:
        await torn.receive()
    assert info.value.fatal
    await torn.aclose()


async def test_closing_wakes_a_blocked_receiver(pair) -> None:
    conn = Connection(pair[1])
    outcome: list[BaseException] = []

    async def receive() -> None:
        try:
            await conn.receive()
        except CacheUnavailableError as exc:
            outcome.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await anyio.sleep(0.05)
            await conn.aclose()
    assert len(outcome) == 1
    with pytest.raises(CacheUnavailableError):
        await conn.send_request(1, "x")
    with pytest.raises(CacheUnavailableError):
        await conn.receive()


async def test_unix_path_connect_and_peer_credentials() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "s.sock")
        with pytest.raises(CacheUnavailableError, match="no musacache server"):
            await connect_unix(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        listener.setblocking(False)
        client_sock = await connect_unix(path)
        await anyio.wait_readable(listener)
        server_sock, _ = listener.accept()
        creds = peer_credentials(server_sock)
        assert creds.pid == os.getpid() and creds.uid == os.getuid()
        async with Connection(client_sock) as client, Connection(server_sock) as server:
            await client.send_request(9, "hello", {"v": 1})
            assert await server.receive() == Request(9, "hello", {"v": 1})
        listener.close()


# -- bounded msgpack bodies ------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
            | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=300))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=6)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=6), max_leaves=60)


def _count(obj: object) -> tuple[int, int]:
    """(objects, depth) of an unpacked msgpack value, as check_body_shape counts them (an
    empty container opens no level: nothing can nest in it)."""
    if isinstance(obj, (list, dict)) and not obj:
        return 1, 0
    if isinstance(obj, list):
        inner = [_count(v) for v in obj]
        return 1 + sum(n for n, _ in inner), 1 + max((d for _, d in inner), default=0)
    if isinstance(obj, dict):
        inner = [_count(v) for kv in obj.items() for v in kv]
        return 1 + sum(n for n, _ in inner), 1 + max((d for _, d in inner), default=0)
    return 1, 0


@given(_values)
@settings(max_examples=300, deadline=None)
def test_body_shape_walk_agrees_with_msgpack(value) -> None:
    from musacache.ipc._protocol import check_body_shape

    body = msgpack.packb(value, use_bin_type=True)
    objects, depth = _count(value)
    if objects <= 64 and depth <= 3:
        check_body_shape(body, max_objects=64, max_depth=3)
    else:
        with pytest.raises(FrameError, match="refused"):
            check_body_shape(body, max_objects=64, max_depth=3)
    check_body_shape(body)  # the real limits are far above anything generated here
    # A cut body is never accepted.
    if len(body) > 1:
        with pytest.raises(FrameError):
            check_body_shape(body[:-1])


def test_amplifying_bodies_are_refused_before_unpacking() -> None:
    dec = FrameDecoder(expect="request")
    flood = b"\x83\xa2id\x01\xa2op\xa6lookup\xa4args\x81\xa6tokens\xdd" + \
        (8 << 20).to_bytes(4, "big") + b"\x90" * (8 << 20)
    dec.feed(struct.pack(">2sBBI", MAGIC, PROTOCOL_VERSION, 0, len(flood)) + flood)
    with pytest.raises(FrameError, match="refused") as info:
        dec.next_frame()
    assert not info.value.fatal and info.value.request_id is None


async def test_send_nowait_finishes_a_partly_sent_frame_before_any_other(pair) -> None:
    """A reply sent from the reader callback (send_nowait) that the socket takes only in
    part: a task sends the rest, and every other frame waits for it, so the peer reads whole
    frames in order."""
    a, b = pair
    conn = Connection(a, max_frame_size=1 << 24)
    big = encode_reply(1, b"x" * (4 << 20), max_frame_size=1 << 24)  # past the socket buffer
    small = encode_reply(2, "after")
    got: list[Reply] = []

    def read_all() -> None:
        decoder = FrameDecoder(max_frame_size=1 << 24, expect="reply")
        b.settimeout(10)
        while len(got) < 3:
            decoder.feed(b.recv(1 << 20))
            while (frame := decoder.next_frame()) is not None:
                assert isinstance(frame, Reply)
                got.append(frame)

    assert conn.send_nowait(big)  # its start is out, a task sends the rest
    assert conn._tail is not None
    assert not conn.send_nowait(small)  # refused while the rest is pending: nothing sent
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, read_all)
        await conn.send_frame(small)
        assert conn._tail is None
        assert conn.send_nowait(encode_reply(3, "now"))
    assert [r.id for r in got] == [1, 2, 3]
    assert got[0].result == b"x" * (4 << 20) and got[1].result == "after"
    await conn.aclose()


def test_small_bodies_are_refused_past_the_nesting_limit() -> None:
    """Small bodies skip the nesting walk only when they hold too few container bytes to
    nest past MAX_DEPTH: a small body nested one level too deep is still refused."""
    from musacache.ipc._protocol import MAX_DEPTH

    def nested(levels: int) -> dict[str, object]:
        value: object = 1
        for _ in range(levels - 2):  # the body map and args make two levels
            value = [value]
        return {"id": 1, "op": "lookup", "args": {"x": value}}

    for levels, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        decoder = FrameDecoder(expect="request")
        decoder.feed(encode_frame(nested(levels)))
        if ok:
            assert isinstance(decoder.next_frame(), Request)
        else:
            with pytest.raises(FrameError, match="nested deeper") as info:
                decoder.next_frame()
            assert not info.value.fatal
    # Bytes that look like container leads inside a bin payload: walked, and accepted.
    decoder = FrameDecoder(expect="request")
    decoder.feed(encode_frame({"id": 1, "op": "lookup", "args": {"tokens": b"\x91" * 64}}))
    assert isinstance(decoder.next_frame(), Request)


async def test_send_soon_sends_a_turns_frames_at_its_end_and_in_order(pair) -> None:
    """Small requests made in one turn of the loop go out together at its end (one syscall
    for many requests: ``musacache bench scale --only server``); behind a frame still being
    sent, they wait for it, still whole."""
    a, b = pair
    conn = Connection(a, max_frame_size=1 << 24)
    frames = [encode_request(i, "lookup", {"tokens": bytes(64)}) for i in range(10)]
    b.setblocking(False)
    for f in frames:
        conn.send_soon(f)
    with pytest.raises(BlockingIOError):
        b.recv(1)  # nothing before the end of the turn
    await anyio.lowlevel.checkpoint()
    await anyio.lowlevel.checkpoint()
    b.settimeout(10)
    want = b"".join(frames)
    got = b""
    while len(got) < len(want):
        got += b.recv(1 << 16)
    assert got == want

    # Behind a frame the socket took only in part: the held frames follow it, whole.
    big = encode_reply(99, b"x" * (4 << 20), max_frame_size=1 << 24)
    assert conn.send_nowait(big) and conn._tail is not None
    for f in frames:
        conn.send_soon(f)
    received: list[int] = []

    def read_all() -> None:
        decoder = FrameDecoder(max_frame_size=1 << 24)
        while len(received) < 11:
            decoder.feed(b.recv(1 << 20))
            while (frame := decoder.next_frame()) is not None:
                received.append(frame.id)

    await anyio.to_thread.run_sync(read_all)
    assert received == [99, *range(10)]
    await conn.aclose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=40), st.booleans())
def test_a_large_frame_read_in_pieces_comes_whole_and_the_next_one_after_it(cuts, with_fds):
    """A frame above ``defer_above`` that arrives over many reads is kept as the reads came
    and handed out whole as a RawFrame (with the fds its header declared); the frames read
    with its last bytes come after it."""
    from musacache.ipc._wire import RawFrame

    decoder = FrameDecoder(defer_above=1000)
    fds = list(os.pipe()) if with_fds else []
    big = encode_request(1, "put", {"data": bytes(range(256)) * 20}, nfds=len(fds))
    small = encode_request(2, "lookup", {"tokens": b"\0" * 8})
    stream = big + small
    at, first = 0, True
    for cut in cuts:
        piece, at = stream[at:at + cut], at + cut
        if piece:
            decoder.feed(piece, fds if first else [])
            first = False
    if at < len(stream):
        decoder.feed(stream[at:], fds if first else [])
    assert decoder.received == len(stream)
    raw = decoder.next_frame()
    assert isinstance(raw, RawFrame) and tuple(raw.fds) == tuple(fds)
    assert len(raw.body) == len(big) - HEADER_SIZE
    req = decoder.parse(raw)
    assert req.id == 1 and req.args["data"] == bytes(range(256)) * 20
    nxt = decoder.next_frame()
    assert isinstance(nxt, Request) and nxt.id == 2
    assert decoder.next_frame() is None and decoder.buffered == 0
    for fd in fds:
        os.close(fd)
