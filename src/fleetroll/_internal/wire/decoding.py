"""``Content-Encoding``: the ``gzip`` and ``deflate`` layers, decoded as an answer arrives."""

from __future__ import annotations

import zlib

from fleetroll._internal.wire.errors import BadResponse

__all__ = ["Inflate", "decoders"]


class Inflate:
    """One ``gzip`` or ``deflate`` layer, decoded as httpx's decoders do."""

    __slots__ = ("_retry_raw", "_z", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        # deflate: zlib-wrapped as the RFC says, or raw as some servers send it.
        self._retry_raw = name == "deflate"
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16 if name == "gzip" else zlib.MAX_WBITS)

    def decompress(self, data: bytes, limit: int) -> bytes:
        try:
            out = self._z.decompress(data, limit)
        except zlib.error as exc:
            if self._retry_raw:
                self._retry_raw = False
                self._z = zlib.decompressobj(-zlib.MAX_WBITS)
                return self.decompress(data, limit)
            raise _undecodable(self.name, exc) from None
        self._retry_raw = False
        return out

    def flush(self) -> bytes:
        try:
            return self._z.flush()
        except zlib.error as exc:  # pragma: no cover - flush rarely fails
            raise _undecodable(self.name, exc) from None


def _undecodable(name: str, exc: zlib.error) -> BadResponse:
    return BadResponse(f"the answer's {name} encoding does not decode ({exc})")


def decoders(encoding: str) -> list[Inflate] | None:
    """The layers to undo for a ``Content-Encoding``, the last applied first."""
    layers: list[Inflate] = []
    for value in reversed(encoding.split(",")):
        name = value.strip().lower()
        if name in ("gzip", "deflate"):
            layers.append(Inflate(name))
        elif name not in ("", "identity"):
            raise BadResponse(
                f"the answer is in the content encoding {name!r}, which the client "
                "cannot decode (it asked for identity; gzip and deflate are decoded)"
            )
    return layers or None
