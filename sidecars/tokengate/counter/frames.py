"""Counter frames: CountTokens on the counter workers' unix sockets, what the nginx edge
speaks (``lua/tokengate/sidecar.lua``), without gRPC's HTTP/2.

Why not gRPC there: a Python gRPC server spends most of a call outside the call. Measured
on a 2-core machine, one worker, 16 calls in flight, the same 2,000 cold 1k-token chat
bodies (``make bench-counter`` prints both): grpc's thread-pool server used 950-1,410 µs
of CPU per call, of which the servicer itself 560-830 µs; its 10 threads switched context
about 15 times per call, and tokenizing alone cost 1.5x what it costs in a quiet thread.
This protocol, one asyncio thread per worker, used 415-585 µs for the same calls (175-255
against 555-880 µs when every segment was cached). It also spares the edge its loopback
hop server: nginx's cosockets speak it directly.

Protocol, per connection (many calls, answered in order):

- request: a gRPC Length-Prefixed-Message (gRPC over HTTP/2 spec: one byte compressed
  flag, always 0; four bytes big-endian length; the serialized ``CountRequest``);
- reply: one byte, the gRPC status code (0 OK, 3 INVALID_ARGUMENT, 5 NOT_FOUND,
  13 INTERNAL, ...), then a Length-Prefixed-Message: the serialized ``CountReply`` when
  0, else the status message in UTF-8.

A request that is no such message (a compressed flag, a length above
``MAX_MESSAGE_BYTES``, bytes that are no ``CountRequest``) is answered INVALID_ARGUMENT
and, when its length cannot be trusted, the connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Self

import grpc
from google.protobuf.message import DecodeError

from tokengate import grpc_server
from tokengate.config import COUNTER_MAX_MESSAGE_BYTES
from tokengate.counter.counter_service import CountFailure
from tokengate.v1 import counter_pb2

if TYPE_CHECKING:
    from grpc_health.v1 import health

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = COUNTER_MAX_MESSAGE_BYTES
# a Length-Prefixed-Message's header: compressed flag, length
MESSAGE_HEADER = struct.Struct(">BI")
# a reply's: status code, then the message's header
REPLY_HEADER = struct.Struct(">BBI")

Count = Callable[[counter_pb2.CountRequest], counter_pb2.CountReply]


def framed(payload: bytes) -> bytes:
    """``payload`` as a Length-Prefixed-Message: a request (a serialized CountRequest),
    or the message part of a reply."""
    return MESSAGE_HEADER.pack(0, len(payload)) + payload


def reply(code: grpc.StatusCode, payload: bytes) -> bytes:
    """One reply: ``code``'s number, then ``payload`` (a serialized CountReply for OK,
    else the UTF-8 message) as a Length-Prefixed-Message."""
    return bytes((code.value[0],)) + framed(payload)


def answer(count: Count, message: bytes) -> bytes:
    """The reply to one request ``message`` (a serialized CountRequest): ``count``'s
    reply, its ``CountFailure``, or INTERNAL for anything else (logged; the worker keeps
    serving)."""
    try:
        request = counter_pb2.CountRequest.FromString(message)
    except DecodeError:
        return reply(grpc.StatusCode.INVALID_ARGUMENT, b"request: not a CountRequest")
    try:
        return reply(grpc.StatusCode.OK, count(request).SerializeToString())
    except CountFailure as e:
        return reply(e.code, e.message.encode())
    except Exception:
        log.exception("CountTokens failed on a %d-byte request", len(message))
        return reply(grpc.StatusCode.INTERNAL, b"counter failed on this body")


class _Connection(asyncio.Protocol):
    """One client connection: requests in, replies out, in order."""

    def __init__(self, count: Count) -> None:
        self._count = count
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        buf, transport = self._buf, self._transport
        assert transport is not None
        buf += data
        while len(buf) >= MESSAGE_HEADER.size:
            flag, n = MESSAGE_HEADER.unpack_from(buf)
            if flag != 0 or n > MAX_MESSAGE_BYTES:
                why = b"request: compressed" if flag else b"request: larger than 64 MiB"
                transport.write(reply(grpc.StatusCode.INVALID_ARGUMENT, why))
                transport.close()
                return
            if len(buf) < MESSAGE_HEADER.size + n:
                return
            message = bytes(buf[MESSAGE_HEADER.size:MESSAGE_HEADER.size + n])
            del buf[:MESSAGE_HEADER.size + n]
            transport.write(answer(self._count, message))


async def serve(count: Count, listen: grpc_server.Listen, index: int, grace_s: float,
                tcp_server: grpc.Server | None = None, services: Sequence[str] = (),
                on_ready: Callable[[list[str]], None] | None = None,
                on_reload: Callable[[], None] | None = None) -> None:
    """Serve worker ``index`` until SIGTERM/SIGINT: counter frames on its unix socket
    (``listen.socket_of(index)``, published as ``tokengate.grpc_server`` publishes
    gRPC's: bound under a private name, mode 0660, renamed into place) and, when
    ``listen.tcp`` is set, ``tcp_server`` (its servicers added; health and reflection are
    added here) on those addresses. Calls on the socket run one at a time in this
    thread, so ``on_reload()`` (SIGHUP) runs between two of them. ``on_ready(addresses)``
    once listening; at the end, the socket is withdrawn first, then gRPC's calls in
    flight get ``grace_s`` seconds."""
    loop = asyncio.get_running_loop()
    sock = grpc_server.UnixSocket.of(listen, index)
    unix: asyncio.AbstractServer | None = None
    identity = None
    health_servicer: health.HealthServicer | None = None
    tcp = tcp_server if listen.tcp else None
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, grpc_server.reload, on_reload)
    addresses: list[str] = []
    try:
        # the socket first: a client that found the TCP port (the readiness probe) finds
        # the socket too
        if sock is not None:
            sock.path.parent.mkdir(parents=True, exist_ok=True)
            sock.private.unlink(missing_ok=True)
            unix = await loop.create_unix_server(lambda: _Connection(count),
                                                 path=str(sock.private))
            identity = sock.publish()
        if tcp is not None:
            from grpc_health.v1 import health

            health_servicer = health.HealthServicer()
            addresses, _ = grpc_server.bind(tcp, grpc_server.Listen(listen.tcp), index,
                                            services, health_servicer)
            tcp.start()
            for name in ("", *services):
                health_servicer.set(name, grpc_server.SERVING)
        if sock is not None:
            addresses.append(f"frames:{sock.path}")
        if on_ready is not None:
            on_ready(addresses)
        await stop.wait()
        if health_servicer is not None:
            health_servicer.enter_graceful_shutdown()
    finally:
        if sock is not None:
            sock.withdraw(identity)
        if unix is not None:
            unix.close()
        if tcp is not None:
            await loop.run_in_executor(None, lambda: tcp.stop(grace=grace_s).wait())


class Client:
    """A blocking client of one worker's socket (tools, tests): ``count(request)`` ->
    CountReply, raises ``CountFailure`` for a status other than OK and ``OSError`` when
    the socket cannot be reached or answers no reply within ``timeout_s``."""

    def __init__(self, path: str, timeout_s: float = 10.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the counter closed the connection")
            out += chunk
        return bytes(out)

    def send(self, message: bytes) -> tuple[int, bytes]:
        """``message`` (any bytes, framed as a request) -> (status code, payload)."""
        self._sock.sendall(framed(message))
        code, _, n = REPLY_HEADER.unpack(self._read(REPLY_HEADER.size))
        return code, self._read(n)

    def count(self, request: counter_pb2.CountRequest) -> counter_pb2.CountReply:
        code, payload = self.send(request.SerializeToString())
        if code != 0:
            status = next(s for s in grpc.StatusCode if s.value[0] == code)
            raise CountFailure(status, payload.decode())
        return counter_pb2.CountReply.FromString(payload)
