"""Streaming answers: the response :meth:`Wire.stream` hands over, its body read as it arrives."""

from __future__ import annotations

from fleetroll._internal.wire.connection import Connection

__all__ = ["StreamResponse"]


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
