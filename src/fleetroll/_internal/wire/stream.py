"""Streaming answers: :meth:`Wire.stream`'s context and the response read as it arrives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from fleetroll._internal.wire.connection import Connection

if TYPE_CHECKING:
    from fleetroll._internal.wire.client import Route, Wire

__all__ = ["Stream", "StreamResponse"]


class StreamResponse:
    """An answer whose body is read as it arrives (see :meth:`Wire.stream`)."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        self._conn: Connection | None = conn  # None once its context has ended
        self.status = status
        self.headers = headers  # lower-case names; a repeated header keeps its last value

    def aiter_bytes(self) -> StreamResponse:
        """The body, piece by piece as it arrives (decoded; ``max_bytes`` applied).

        Raises:
            BodyTooLarge, BadResponse, ConnectionLost: see the module.
        """
        return self

    def __aiter__(self) -> StreamResponse:
        return self

    async def __anext__(self) -> bytes:
        if self._conn is None:  # its connection may carry another answer by now
            raise RuntimeError("the stream was read after its `async with` ended")
        chunk = await self._conn.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aread(self) -> bytes:
        """The rest of the body.

        Raises:
            BodyTooLarge, BadResponse, ConnectionLost: see the module.
        """
        pieces = [chunk async for chunk in self]
        return b"".join(pieces)


class Stream:
    """``Wire.stream``'s context: the exchange's head on entry, its connection settled on exit."""

    __slots__ = (
        "_body",
        "_conn",
        "_headers",
        "_max_bytes",
        "_method",
        "_response",
        "_route",
        "_url",
        "_wire",
    )

    def __init__(
        self,
        wire: Wire,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        max_bytes: int,
    ) -> None:
        self._wire = wire
        self._method = method
        self._url = url
        self._body = body
        self._headers = headers
        self._max_bytes = max_bytes
        self._conn: Connection | None = None
        self._route: Route | None = None
        self._response: StreamResponse | None = None

    async def __aenter__(self) -> StreamResponse:
        wire = self._wire
        target, data = wire._encode(self._method, self._url, self._body, self._headers)
        self._route = target.route
        conn = await wire._send(target, data, self._method, self._max_bytes, False, True)
        self._conn = conn
        self._response = StreamResponse(conn, conn._status, conn._headers)
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._response is not None:
            self._response._conn = None
        if conn.reusable():
            assert self._route is not None
            self._wire._put_back(self._route, conn)
        else:
            conn.close()
