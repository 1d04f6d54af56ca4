"""Tests for kvstrata.tiers.remote.wire: RESP2 replies read from a socket in any split, bulk
values straight into the caller's buffer or scattered over its pieces, pipelines sent whole however the kernel cuts them, and
a connection dropped (never reused) after a reply it cannot account for."""

from __future__ import annotations

import socket
import threading

import pytest
import redis
from redis_rig import RedisServer

from kvstrata.tiers.remote.client import RedisClient
from kvstrata.tiers.remote.config import parse_url
from kvstrata.tiers.remote.wire import IOV_MAX, ProtocolError, _Reader, _send, command


def feed(data: bytes, piece: int) -> tuple[socket.socket, threading.Thread]:
    """The reading end of a socket pair whose other end sends ``data`` ``piece`` bytes at a
    time, then closes."""
    ours, theirs = socket.socketpair()
    ours.settimeout(10)

    def write() -> None:
        with theirs:
            for at in range(0, len(data), piece):
                theirs.sendall(data[at : at + piece])

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return ours, writer


REPLIES = b"+OK\r\n:3\r\n$-1\r\n_\r\n-ERR wrong\r\n-MOVED 12 h:1\r\n$5\r\nhello\r\n$3\r\nabc\r\n"


@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_replies_in_any_split(piece: int) -> None:
    sock, writer = feed(REPLIES, piece)
    with sock:
        reader = _Reader(sock, bytearray(64))
        into = memoryview(bytearray(5))
        assert reader.reply(None) is True
        assert reader.reply(None) == 3
        assert reader.reply(None) is None and reader.reply(None) is None
        err = reader.reply(None)
        assert type(err) is redis.exceptions.ResponseError and str(err) == "wrong"
        assert isinstance(reader.reply(None), redis.exceptions.MovedError)
        value = reader.reply(into)
        assert value is into and bytes(into) == b"hello", "a value of the expected length"
        other = reader.reply(into)  # 3 bytes, not 5: a buffer of its own
        assert other is not into and bytes(other) == b"abc" and bytes(into) == b"hello"
        assert reader.pending == 0
    writer.join()


def test_a_large_value_lands_in_place() -> None:
    blob = bytes(range(256)) * 4096  # 1 MiB: many recv calls
    sock, writer = feed(b"$%d\r\n%s\r\n:1\r\n" % (len(blob), blob), 65536)
    with sock:
        reader = _Reader(sock, bytearray(4096))
        into = memoryview(bytearray(len(blob)))
        assert reader.reply(into) is into and bytes(into) == blob
        assert reader.reply(None) == 1
    writer.join()


@pytest.mark.parametrize("piece", [1, 100, 4096, 65536])
def test_a_value_scatters_into_pieces_in_order(piece: int) -> None:
    """A value read into pieces (a slot header, then a host page's views, some empty) fills them
    in order whatever the kernel's split and whatever the small reads already buffered; pieces
    of another total length get a buffer of their own."""
    blob = bytes(range(256)) * 1000
    sizes = [64, 0, 16384, 1, 50000, len(blob) - 64 - 16384 - 1 - 50000]
    wire = b"".join(b"$%d\r\n%s\r\n" % (len(blob), blob) for _ in range(2))
    sock, writer = feed(wire, piece)
    with sock:
        reader = _Reader(sock, bytearray(4096))
        pieces = [memoryview(bytearray(n)) for n in sizes]
        assert reader.reply(pieces) is pieces
        assert b"".join(bytes(p) for p in pieces) == blob
        other = reader.reply(pieces[:3])  # 16,448 bytes asked for: not this value
        assert isinstance(other, memoryview) and bytes(other) == blob
        assert reader.pending == 0
    writer.join()


@pytest.mark.parametrize(
    "data", [b"$3\r\nabcd\r\n", b"*1\r\n$1\r\na\r\n", b"+" + b"x" * 200 + b"\r\n"]
)
def test_replies_these_commands_never_get_are_refused(data: bytes) -> None:
    sock, writer = feed(data, 4096)
    with sock, pytest.raises(ProtocolError):
        _Reader(sock, bytearray(64)).reply(memoryview(bytearray(3)))
    writer.join()


def test_a_closed_connection_is_a_connection_error() -> None:
    sock, writer = feed(b"$10\r\nabc", 4096)
    with sock, pytest.raises(redis.exceptions.ConnectionError):
        _Reader(sock, bytearray(64)).reply(memoryview(bytearray(10)))
    writer.join()


def test_send_gets_every_byte_out_past_partial_sends_and_iov_max() -> None:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # the kernel cuts every call
    chunks: list[bytes | memoryview] = [
        bytes([i % 251]) * (1 + i % 700) for i in range(IOV_MAX + 300)
    ]
    chunks.insert(5, memoryview(b""))
    chunks.append(memoryview(bytearray(b"z" * 300_000)))
    want = b"".join(bytes(c) for c in chunks)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            got.extend(theirs.recv(65536))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with ours, theirs:
        _send(ours, chunks)
        reader.join(30)
    assert bytes(got) == want


def test_a_reply_past_the_asked_ones_drops_the_connection(redis_server: RedisServer) -> None:
    """Two commands sent, one reply asked for: the exchange fails and its connection is
    dropped, so the pool never hands out a socket with a stray reply in it."""
    client = RedisClient(parse_url(redis_server.url), 2.0, 4)
    try:
        pool = client._redis.connection_pool  # type: ignore[union-attr]
        conn = pool.get_connection()
        try:
            with pytest.raises(ProtocolError, match="past the last reply"):
                conn.exchange([command(b"PING"), command(b"PING")], [None], lambda j, r: None)
            assert conn._sock is None
        finally:
            pool.release(conn)
        assert client.exists([b"nobody"]) == [False]  # a fresh connection answers
    finally:
        client.close()


@pytest.mark.parametrize("window", [1, 2, 3])
def test_calls_sent_ahead_are_built_after_the_ones_before_were_sent(
    redis_server: RedisServer, window: int
) -> None:
    """``exchange_many`` draws each call once the ones before it were sent and reads the oldest
    call's replies only once ``window`` calls are out: the order of events proves both, and
    every reply reaches its own call."""
    from kvstrata.tiers.remote.wire import Call

    client = RedisClient(parse_url(redis_server.url), 2.0, 4)
    events: list[str] = []
    replies: dict[int, list[object]] = {}

    def calls(n: int):  # type: ignore[no-untyped-def]
        for c in range(n):
            events.append(f"build {c}")
            got: list[object] = []
            replies[c] = got
            key = b"wire-window-%d" % c
            yield Call(
                [command(b"SET", key, b"v%d" % c), command(b"GET", key)],
                [None, None],
                lambda j, r, got=got: got.append(bytes(r) if isinstance(r, memoryview) else r),
                lambda c=c: events.append(f"done {c}"),
            )

    try:
        pool = client._redis.connection_pool  # type: ignore[union-attr]
        conn = pool.get_connection()
        try:
            conn.exchange_many(calls(4), window)
        finally:
            pool.release(conn)
    finally:
        client.close()
    assert replies == {c: [True, b"v%d" % c] for c in range(4)}
    want: list[str] = []
    for c in range(4):  # call c is built, then the oldest is read once `window` are out
        want.append(f"build {c}")
        if c + 1 >= window:
            want.append(f"done {c + 1 - window}")
    want += [f"done {c}" for c in range(max(0, 4 - window + 1), 4)]
    assert events == want
