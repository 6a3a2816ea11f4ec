"""Text UTF-8 cannot encode (a lone surrogate: a file name that is not UTF-8,
read with ``surrogateescape``, or JSON's ``\\udc80`` escape), made writable.

No pydantic here: telemetry's redactor uses it, and is imported before the
process decides which pydantic plugins it loads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["utf8_safe", "utf8_safe_value"]


def utf8_safe(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) written as escapes
    (``\\udc80``); ``text`` itself when it has none."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def utf8_safe_value(value: Any) -> Any:
    """``value`` (JSON-shaped: mappings, lists, strings, numbers) with every string in
    it, keys too, as :func:`utf8_safe` makes it; ``value`` itself when none needs it."""
    if isinstance(value, str):
        return utf8_safe(value)
    if isinstance(value, dict):
        out = {
            utf8_safe(k) if isinstance(k, str) else k: utf8_safe_value(v) for k, v in value.items()
        }
        same = all(a is b for a, b in zip(out.values(), value.values(), strict=True))
        return value if same and list(out) == list(value) else out
    if isinstance(value, list | tuple):
        items = [utf8_safe_value(v) for v in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    return value
