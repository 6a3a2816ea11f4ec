"""The one exception the service's internals raise to answer a request with an error."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ApiError", "loc_of"]


class ApiError(Exception):
    """An HTTP error answer: ``status`` and a message for people.

    A 422 carries ``loc`` (where the problem is, e.g. ``["body", "tasks", 2,
    "env_key"]``) and is answered as a validation error body; every other
    status as ``{"detail": message}``. Messages never hold a secret.
    """

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        loc: Sequence[str | int] = (),
        type: str = "value_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.loc = list(loc)
        self.type = type
        self.headers = dict(headers or {})


def loc_of(field: str | None) -> list[str | int]:
    """A task-file field (``"solution.0.name"``) as a location list."""
    if not field:
        return []
    return [int(part) if part.isdigit() else part for part in field.split(".")]
