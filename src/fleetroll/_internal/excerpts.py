"""Short excerpts of what a server answered, for one-line error messages."""

from __future__ import annotations

import json

__all__ = ["error_excerpt", "shorten"]

#: How much of an answer goes into an error message.
EXCERPT_CHARS = 300


def error_excerpt(body: bytes, limit: int = EXCERPT_CHARS) -> str:
    """What an answer's body says, shortened (an OpenAI-style error's message)."""
    text = body.decode("utf-8", "replace")
    try:
        error = json.loads(text)["error"]
        # OpenAI-style {"error": {"message": ...}}: the message is the useful part.
        text = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        pass
    return shorten(str(text), limit) or "(empty body)"


def shorten(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` on one line, cut to ``limit`` characters with an ellipsis."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
