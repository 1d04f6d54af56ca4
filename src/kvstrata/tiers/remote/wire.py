"""The shared tier's page commands on the wire: RESP2 pipelines sent and read on a redis-py
connection's own socket, without redis-py's per-command packer and parser.

redis-py's pipeline sends every chunk by its own ``sendall`` and reads every reply through its
parser, which copies a value twice under the GIL (hiredis: into its reader's buffer, then into a
new ``bytes``): for values of a quarter MiB that was most of a fetch's client CPU, and every
copy held the GIL the store's other threads were waiting for. Here:

- a pipeline goes out by ``sendmsg``: each command's few header bytes and, for a SET, the host
  pool's bytes themselves (a :class:`~.values.PageValue`'s views), gathered by the kernel;
- a bulk reply of the length the caller expects is read by ``recv_into`` straight into the
  caller's buffer (the kernel's copy, GIL released); any other reply goes through a small
  read buffer (a value of another length into a ``bytearray`` of its own).

The connection stays redis-py's: it connects, authenticates and selects the database, and its
pool checks it before handing it out. Its parser is never used in between: an exchange reads
exactly the replies it asked for, so nothing is left behind for it, and any fault (timeout, lost
connection, a reply that is not RESP2) disconnects the connection, so the pool hands out a fresh
one next time.
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis._parsers.base import BaseParser
from redis.connection import Connection

from .values import PageValue

#: Bytes each small read asks for (reply headers, integers, errors; a value's first bytes); a
#: reply line longer than this is not one these commands get.
READ_BYTES = 16384
#: iovecs one ``sendmsg`` takes (Linux: 1024).
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
CRLF = b"\r\n"

Chunk = bytes | memoryview
#: Where a bulk value is read: one buffer, or pieces filled in order (a host page's views).
Into = memoryview | Sequence[memoryview] | None


def command(*args: bytes) -> bytes:
    """One RESP2 command of bulk-string arguments."""
    out = [b"*%d\r\n" % len(args)]
    out += [b"$%d\r\n%s\r\n" % (len(a), a) for a in args]
    return b"".join(out)


def set_command(key: bytes, value: PageValue, ttl_s: int) -> list[Chunk]:
    """``SET key value NX [EX ttl_s]`` as chunks: the value's header, then its views."""
    tail = b"$2\r\nNX\r\n" + (
        b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s) if ttl_s else b""
    )
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        6 if ttl_s else 4,
        len(key),
        key,
        value.nbytes,
    )
    return [head + value.header, *value.parts, CRLF + tail]


class ProtocolError(redis.exceptions.ConnectionError):
    """The server's reply is not what these commands get (the connection is dropped)."""


class _Reader:
    """Replies from ``sock``, buffered in small reads, bulk values straight into the caller's
    buffer."""

    def __init__(self, sock: socket.socket, buf: bytearray) -> None:
        self.sock, self.buf, self.view = sock, buf, memoryview(buf)
        self.pos = self.end = 0

    @property
    def pending(self) -> int:
        return self.end - self.pos

    def _fill(self) -> None:
        if self.pos == self.end:
            self.pos = self.end = 0
        elif self.end == len(self.buf):  # keep the unread tail, at the front
            n = self.end - self.pos
            self.view[:n] = self.view[self.pos : self.end]
            self.pos, self.end = 0, n
        got = self.sock.recv_into(self.view[self.end :])
        if got == 0:
            raise redis.exceptions.ConnectionError("the server closed the connection")
        self.end += got

    def line(self) -> bytes:
        while True:
            at = self.buf.find(CRLF, self.pos, self.end)
            if at >= 0:
                out = bytes(self.view[self.pos : at])
                self.pos = at + 2
                return out
            if self.end - self.pos >= len(self.buf):
                raise ProtocolError(f"a reply line longer than {len(self.buf)} bytes")
            self._fill()

    def read_into(self, dsts: Sequence[memoryview]) -> None:
        """Exactly as many bytes as ``dsts`` hold, in order: what is buffered, then the socket's
        (one ``recvmsg_into`` scatters into all of them: the kernel's copy, GIL released)."""
        views = list(dsts)
        i = _advance(views, 0, 0)
        while i < len(views) and self.pos < self.end:  # what the small reads already buffered
            take = min(self.end - self.pos, len(views[i]))
            views[i][:take] = self.view[self.pos : self.pos + take]
            self.pos += take
            i = _advance(views, i, take)
        while i < len(views):
            got = self.sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            if got == 0:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            i = _advance(views, i, got)

    def reply(self, into: Into) -> Any:
        """One reply: True for +OK, an int, None for a nil, an exception for an error, a bulk
        value in ``into`` (one view, or pieces filled in order) when it is exactly that long,
        returned as given (else in a ``bytearray`` of its own, returned as a memoryview)."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            pieces = [into] if isinstance(into, memoryview) else into
            if pieces is not None and sum(len(p) for p in pieces) == n:
                self.read_into(pieces)
                out: Any = into
            else:
                out = memoryview(bytearray(n))
                self.read_into([out])
            if self.line() != b"":
                raise ProtocolError("a bulk reply longer than its length")
            return out
        if kind == b":":
            return int(rest)
        if kind == b"_":  # RESP3's null, should the connection speak it
            return None
        if kind == b"+":
            return True if rest == b"OK" else rest
        if kind == b"-":
            return BaseParser.parse_error(rest.decode("utf-8", "replace"))
        raise ProtocolError(f"unexpected reply {line[:40]!r}")


@dataclass(frozen=True)
class Call:
    """One pipeline of an exchange: its commands' ``chunks``, where each reply is read
    (``into``, one per command) and who takes it (``each(j, reply)``); ``done()`` runs after
    the last reply."""

    chunks: Sequence[Chunk]
    into: Sequence[Into]
    each: Callable[[int, Any], None]
    done: Callable[[], None] | None = None

    def read(self, reader: _Reader) -> None:
        for j, dst in enumerate(self.into):
            reply = reader.reply(dst)
            with _theirs():
                self.each(j, reply)
        if self.done is not None:
            with _theirs():
                self.done()


class _Raised(Exception):
    """What the caller's own code raised inside an exchange (built a call, took a reply),
    carried past the handlers that turn socket and parsing faults into connection errors."""

    def __init__(self, err: BaseException) -> None:
        super().__init__(str(err))
        self.err = err


@contextlib.contextmanager
def _theirs() -> Iterator[None]:
    """Around the caller's code: redis-py's errors (a node down, said by a reply) pass as they
    are; anything else is the caller's and is raised to it unchanged (:class:`_Raised`)."""
    try:
        yield
    except (redis.exceptions.RedisError, _Raised):
        raise
    except Exception as err:
        raise _Raised(err) from err


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Past ``n`` more bytes of ``views[i:]`` (the view it stops in is cut in place): the index
    of the first view with bytes left, ``len(views)`` when none has."""
    while n:
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    while i < len(views) and len(views[i]) == 0:
        i += 1
    return i


def _send(sock: socket.socket, chunks: Sequence[Chunk]) -> None:
    """Every byte of ``chunks``, gathered by the kernel (``sendmsg``, IOV_MAX at a time)."""
    views = [memoryview(c).cast("B") for c in chunks]
    i = _advance(views, 0, 0)
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))


class WireConnection(Connection):
    """A redis-py connection that also runs :meth:`exchange`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_buf = bytearray(READ_BYTES)

    def exchange(
        self,
        chunks: Sequence[Chunk],
        into: Sequence[Into],
        each: Callable[[int, Any], None],
    ) -> None:
        """Send ``chunks`` (``len(into)`` commands), then read one reply per command and hand
        it to ``each(j, reply)`` as it arrives, a bulk value in ``into[j]`` where given and as
        long (see :meth:`_Reader.reply`; it may be reused for a later reply once ``each``
        returned). Raises redis-py's TimeoutError or ConnectionError, or what ``each`` raised,
        having dropped the connection."""
        self.exchange_many([Call(chunks, into, each)], window=1)

    def exchange_many(self, calls: Iterable[Call], window: int) -> None:
        """:meth:`exchange` of each call in turn, with up to ``window`` calls sent before the
        oldest one's replies are read. ``calls`` is drawn lazily: a call is built after the ones
        before it were sent, while the server works on them (a publish computes the next
        batch's CRC-32C there). Only for commands with small replies when ``window`` > 1: the
        replies of calls sent ahead wait in the server's buffers until they are read."""
        if self._sock is None:
            self.connect()
        sock = self._sock
        assert isinstance(sock, socket.socket)
        try:
            reader = _Reader(sock, self._read_buf)
            sent: collections.deque[Call] = collections.deque()
            drawn = iter(calls)
            while True:
                with _theirs():
                    call = next(drawn, None)
                if call is None:
                    break
                _send(sock, call.chunks)
                sent.append(call)
                if len(sent) >= window:
                    sent.popleft().read(reader)
            while sent:
                sent.popleft().read(reader)
            if reader.pending:
                raise ProtocolError(f"{reader.pending} bytes past the last reply")
        except _Raised as raised:  # the caller's own code failed: its error, as it was
            self.disconnect()
            raise raised.err from None
        except TimeoutError:  # socket.timeout
            self.disconnect()
            raise redis.exceptions.TimeoutError("timeout on the shared tier's socket") from None
        except OSError as err:
            self.disconnect()
            raise redis.exceptions.ConnectionError(f"shared tier socket: {err}") from None
        except ValueError as err:  # int() of a garbled line
            self.disconnect()
            raise ProtocolError(f"cannot read a reply: {err}") from None
        except BaseException:
            self.disconnect()
            raise
