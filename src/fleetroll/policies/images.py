"""Images as a vision-language model sees them: Qwen2-VL's resize rule, the
number of placeholder tokens each image becomes, and where those sit in a
prompt's ids.

A Qwen2-VL / Qwen2.5-VL processor resizes an image so both sides are
multiples of 28 (14-pixel patches, merged 2x2) with its pixel count within
``[min_pixels, max_pixels]`` (:func:`smart_resize`), and expands each image's
``<|image_pad|>`` into one token per 28x28 block. With ``policy.image_max_pixels``
fleetroll does that resize itself before the model sees a screenshot
(:func:`prepare_image`), so the server's own resize leaves it as it is and the
trajectory holds the very pixels the model saw.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IMAGE_FACTOR",
    "MIN_PIXELS",
    "PreparedImage",
    "decode_data_url",
    "image_spans",
    "prepare_image",
    "prepare_messages",
    "smart_resize",
]

#: Pixels per side of one placeholder token (14-pixel patches, merged 2x2).
IMAGE_FACTOR = 28
#: Qwen2-VL's processor default ``min_pixels`` (56 x 56).
MIN_PIXELS = 56 * 56
#: Qwen2-VL's limit on an image's aspect ratio.
_MAX_RATIO = 200


def smart_resize(
    height: int,
    width: int,
    *,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: ``(height, width)`` rounded to multiples of
    ``factor``, scaled down to at most ``max_pixels`` and up to at least
    ``min_pixels``, keeping the aspect ratio as closely as it can.

    Raises:
        ValueError: the aspect ratio exceeds 200 (the processor refuses it too).
    """
    if max(height, width) / min(height, width) > _MAX_RATIO:
        raise ValueError(f"an image of {width}x{height} has an aspect ratio over {_MAX_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image as the model sees it: resized by :func:`smart_resize`, as PNG."""

    png: bytes
    width: int
    height: int

    @property
    def placeholders(self) -> int:
        """How many placeholder tokens it becomes (one per 28x28 block)."""
        return (self.width // IMAGE_FACTOR) * (self.height // IMAGE_FACTOR)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.png).hexdigest()

    @property
    def url(self) -> str:
        """A ``data:`` URL of the PNG, as a chat message carries it."""
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL.

    Raises:
        ValueError: not a base64 data URL.
    """
    head, _, payload = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("only base64 data: URLs are resized (not a link)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"the image's base64 is malformed: {exc}") from None


def prepare_image(data: bytes, *, max_pixels: int, min_pixels: int = MIN_PIXELS) -> PreparedImage:
    """``data`` (any format Pillow reads) resized by Qwen2-VL's rule, as RGB PNG.

    Raises:
        ValueError: the bytes are no image Pillow reads.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            image = opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not an image: {exc}") from None
    height, width = smart_resize(
        image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels
    )
    if (width, height) != image.size:
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return PreparedImage(out.getvalue(), width, height)


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], *, max_pixels: int
) -> tuple[list[Mapping[str, Any]], list[PreparedImage]]:
    """``messages`` with every image part resized (:func:`prepare_image`), and
    the images in the order they appear (the order of their placeholders).

    Raises:
        ValueError: an image part is not a base64 data URL of an image.
    """
    out: list[Mapping[str, Any]] = []
    images: list[PreparedImage] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = []
        for part in content:
            if _is_image(part):
                image = prepare_image(
                    decode_data_url(str(part["image_url"].get("url", ""))), max_pixels=max_pixels
                )
                images.append(image)
                part = {**part, "image_url": {**part["image_url"], "url": image.url}}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def image_spans(ids: Sequence[int], counts: Sequence[int]) -> list[tuple[int, int]] | None:
    """Where each image's placeholders sit in ``ids``: ``[start, end)`` per image,
    in order, or None when they cannot be found exactly.

    The placeholder is the one token whose maximal runs in ``ids`` are exactly
    ``counts`` long, in order (a Qwen2-VL prompt: ``<|vision_start|>``, the
    image's ``<|image_pad|>`` repeated, ``<|vision_end|>``).
    """
    if not counts:
        return []
    runs: dict[int, list[tuple[int, int]]] = {}
    start = 0
    for index in range(1, len(ids) + 1):
        if index == len(ids) or ids[index] != ids[start]:
            runs.setdefault(ids[start], []).append((start, index))
            start = index
    found = [
        spans for spans in runs.values() if [end - begin for begin, end in spans] == list(counts)
    ]
    return found[0] if len(found) == 1 else None


def _is_image(part: object) -> bool:
    return (
        isinstance(part, Mapping)
        and part.get("type") == "image_url"
        and isinstance(part.get("image_url"), Mapping)
    )
