"""One HTTP/1.1 connection: a request's bytes out, its answer parsed in (httptools).

A :class:`Connection` is an asyncio protocol. :meth:`Connection.start`
sends a request and gives the future its reader awaits: resolved at the
answer's end (:meth:`Connection.response` then hands it over) or, for a
stream, at its head (then :meth:`Connection.next_chunk` reads the body).
Which connection, and whether a request is sent again, is the Wire's
(:mod:`fleetroll._internal.wire.client`).
"""

from __future__ import annotations

import asyncio
import json
import select
from dataclasses import dataclass
from typing import Any, cast

import httptools

from fleetroll._internal.wire.decoding import Inflate, decoders
from fleetroll._internal.wire.errors import BadResponse, BodyTooLarge, ConnectionLost, WireError

__all__ = ["HEAD_CAP", "Connection", "Response"]

#: The largest response header block read (httpcore's h11 limit).
HEAD_CAP = 100 * 1024
#: Unread body a stream buffers before it stops reading the socket.
_STREAM_BUFFER = 256 * 1024
_HAS_POLL = hasattr(select, "poll")  # not on Windows: no idle check there


@dataclass(frozen=True, slots=True)
class Response:
    """An answer read to its end."""

    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class _Extra(Exception):
    """Bytes after a complete answer: the connection cannot be reused."""


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: a request, then its answer, in turn.

    The reader waits on ``_waiter``, which is only ever resolved with None:
    the state (``_error``, ``_complete``, ``_body``) says what happened. A
    request read whole is woken once, at the answer's end or failure; a
    stream also at its head and at each piece of body (:meth:`next_chunk`).
    """

    __slots__ = (
        "_active",
        "_body",
        "_buffered",
        "_cap",
        "_complete",
        "_decoders",
        "_error",
        "_head_bytes",
        "_headers",
        "_in_head",
        "_interim",
        "_keep_alive",
        "_no_body",
        "_parser",
        "_paused",
        "_size",
        "_status",
        "_streaming",
        "_waiter",
        "closed",
        "idle_since",
        "poller",
        "received",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.poller: select.poll | None = None
        self.closed = False
        self.idle_since = 0.0
        self.received = False  # any byte of the current answer
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._active = False  # an answer is expected
        self._status = 0
        self._headers: dict[str, str] = {}
        self._keep_alive = False
        self._no_body = False
        self._body: list[bytes] = []
        self._size = 0
        self._cap = 0
        self._in_head = True
        self._interim = False
        self._head_bytes = 0
        self._decoders: list[Inflate] | None = None
        self._streaming = False
        self._complete = False
        self._error: WireError | None = None
        self._buffered = 0
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (create_connection's), though not always a subclass
        # of asyncio.Transport: uvloop's is not (an isinstance check hung every
        # request on uvloop, the loop Ray's async actors and many trainers run).
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and _HAS_POLL:
            # For the idle check (stale): a poll object of its own costs a quarter
            # of a select call per reuse.
            self.poller = select.poll()
            self.poller.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        if not self._active:  # bytes nobody asked for: the connection is spoiled
            self.close()
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Extra):
                self.close()
            elif isinstance(cause, WireError):
                self._fail(cause)
            else:
                self._fail(BadResponse(f"a malformed HTTP answer ({cause or exc})"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("the server switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"a malformed HTTP answer ({exc})"))
            return
        if self._in_head:
            # Checked after each read (at most the loop's read size past the cap),
            # before the parser buffers more: an endless header costs nothing.
            self._head_bytes += len(data)
            if self._head_bytes > HEAD_CAP:
                self._fail(BadResponse(f"the answer's header block is over {HEAD_CAP} bytes"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._active or self._complete or self._error is not None:
            return
        if self._status and not self._framed():
            # An answer delimited by the connection's close ends here.
            try:
                self._flush()
            except WireError as failed:
                self._error = failed
            self._complete = True
        else:
            why = f" ({exc})" if exc else ""
            self._error = ConnectionLost(f"the connection closed before the answer ended{why}")
        self._wake()

    # -- httptools callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            raise _Extra  # a second answer to one request: stop parsing

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            # An interim answer (100 Continue, 103 Early Hints): skipped, as
            # httpx does; the answer follows on the same connection.
            self._interim = True
            self._headers = {}
            return
        self._in_head = False
        if self._no_body:
            # The answer to a HEAD: its length describes a body never sent, and
            # httptools cannot be told so: the answer ends here, and the parser
            # (expecting that body) goes with its connection.
            self._status = status
            self._complete = True
            self._wake()
            raise _Extra
        encoding = self._headers.get("content-encoding")
        if encoding is not None:
            self._decoders = decoders(encoding)  # refused before the head is handed over
        self._status = status
        if self._streaming:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._decoders is not None:
            body = self._decode(body)
            if not body:
                return
        self._add(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._keep_alive = self._parser.should_keep_alive()
        if self._decoders is not None:
            self._flush()
        self._complete = True
        self._wake()

    # -- body ----------------------------------------------------------------------

    def _add(self, body: bytes) -> None:
        size = self._size + len(body)
        if size > self._cap:
            raise BodyTooLarge(f"the answer is over {self._cap} bytes", limit=self._cap)
        self._size = size
        self._body.append(body)
        if self._streaming:
            self._buffered += len(body)
            if self._buffered > _STREAM_BUFFER and not self._paused and self.transport:
                self._paused = True
                self.transport.pause_reading()
            self._wake()

    def _decode(self, data: bytes) -> bytes:
        assert self._decoders is not None
        # One byte over what is left: enough to know the cap is passed, never
        # more (a few KiB that inflate to gigabytes stop at the cap).
        limit = self._cap - self._size + 1
        for layer in self._decoders:
            data = layer.decompress(data, limit)
            if len(data) >= limit:
                raise BodyTooLarge(
                    f"the answer is over {self._cap} bytes (decoded)", limit=self._cap
                )
        return data

    def _flush(self) -> None:
        if self._decoders is None:
            return
        data = b""
        limit = self._cap - self._size + 1
        for layer in self._decoders:
            if data:
                data = layer.decompress(data, limit)
            data += layer.flush()
        if data:
            self._add(data)

    # -- use -----------------------------------------------------------------------

    def _framed(self) -> bool:
        h = self._headers
        return "content-length" in h or "chunked" in h.get("transfer-encoding", "").lower()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: WireError) -> None:
        if self._error is None:
            self._error = exc
        self._wake()
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def stale(self) -> bool:
        """Whether an idle connection was closed by its server (or sent bytes unasked)."""
        if self.closed:
            return True
        if self.poller is None:
            return False
        try:
            return bool(self.poller.poll(0))  # readable: the close (or bytes nobody asked for)
        except (OSError, ValueError):
            return True

    def start(self, data: bytes, cap: int, no_body: bool, streaming: bool) -> asyncio.Future[None]:
        """Send one request's bytes; the future resolves at its answer's end (a
        stream's: at its head) or failure. Whoever awaits it closes the connection
        if the wait is cancelled or fails, then calls :meth:`settle`."""
        assert self.transport is not None
        self._status = 0
        self._headers = {}
        self._body = []
        self._size = 0
        self._cap = cap
        self._keep_alive = False
        self.received = False
        self._in_head = True
        self._head_bytes = 0
        self._decoders = None
        self._streaming = streaming
        self._no_body = no_body
        self._complete = False
        self._error = None
        self._buffered = 0
        self._paused = False
        self._active = True
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return waiter

    def settle(self) -> WireError | None:
        """After :meth:`start`'s wait: the failure to raise (the connection is then
        closed), or None. A stream whose head arrived hands a later failure to its
        reader instead."""
        self._waiter = None
        if not self._streaming:
            self._active = False
        error = self._error
        if error is None or (self._streaming and self._status):
            return None
        self.close()
        return error

    def response(self) -> Response:
        """The answer read to its end (after :meth:`settle` found no failure); the
        connection is closed unless the answer allows its reuse."""
        body = b"".join(self._body)
        self._body = []
        if not self._keep_alive:
            self.close()
        return Response(self._status, self._headers, body)

    async def next_chunk(self) -> bytes | None:
        """The body that arrived since the last call (waiting for some), or None at its end."""
        while True:
            body = self._body
            if body:
                chunk = body[0] if len(body) == 1 else b"".join(body)
                self._body = []
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    if not self.closed and self.transport is not None:
                        self.transport.resume_reading()
                return chunk
            if self._error is not None:
                self.close()
                raise self._error
            if self._complete:
                return None
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def reusable(self) -> bool:
        """After a stream: whether the whole answer arrived on a connection that stays open.

        Reading resumes if it was paused: the read that filled the stream's
        buffer may have brought the answer's last bytes, and the next request
        on this connection must be read.
        """
        self._active = False
        self._body = []
        self._buffered = 0
        if self._paused:
            self._paused = False
            if not self.closed and self.transport is not None:
                self.transport.resume_reading()
        return self._complete and self._error is None and self._keep_alive and not self.closed
