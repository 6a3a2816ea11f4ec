"""The ``computer`` tool: a simulated screen, driven like a real desktop.

Actions follow the usual computer-use shape: ``screenshot``, ``click`` at
``x``/``y``, ``type`` ``text``, press a ``key``, ``scroll`` by ``amount``
notches at ``x``/``y``. Every answer carries a real PNG of the screen after the
action, as MCP image content. A screen's state lives in the instance's SQLite
database, so verifiers can score what was done on it.
"""

from __future__ import annotations

import abc
import base64
import io
import sqlite3
from typing import TYPE_CHECKING, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent
from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from fleetroll.emulator.envs.base import ToolGate

__all__ = ["Screen", "encode_png", "register_computer_tool"]

Action = Literal["screenshot", "click", "type", "key", "scroll"]


class Screen(abc.ABC):
    """A simulated screen whose state is in the instance database."""

    width: int = 1024
    height: int = 768

    @abc.abstractmethod
    def render(self, conn: sqlite3.Connection) -> Image.Image:
        """Draw the screen as it is now."""

    def click(self, conn: sqlite3.Connection, x: int, y: int) -> str:
        return f"clicked at ({x}, {y}): nothing there"

    def type_text(self, conn: sqlite3.Connection, text: str) -> str:
        return "typed, but nothing has focus"

    def key(self, conn: sqlite3.Connection, key: str) -> str:
        return f"pressed {key}: nothing happened"

    def scroll(self, conn: sqlite3.Connection, x: int, y: int, amount: int) -> str:
        return "nothing to scroll"


def font(size: int = 16) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """Pillow's built-in font at ``size`` (no system font files needed)."""
    return ImageFont.load_default(size=size)


def blank(screen: Screen, color: str = "#f4f5f7") -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (screen.width, screen.height), color)
    return image, ImageDraw.Draw(image)


def encode_png(image: Image.Image) -> str:
    """Base64 of the image as PNG (fast compression: screenshots are many)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def register_computer_tool(server: MCPServer, gate: ToolGate, screen: Screen) -> None:
    """Add the ``computer`` tool, acting on ``screen``, to ``server``."""

    @server.tool(
        name="computer",
        description=(
            "Use the computer. Actions: screenshot; click (x, y); type (text); "
            "key (key, e.g. Enter, Tab, Backspace); scroll (x, y, amount: notches, "
            "positive = down). Every action answers with a screenshot."
        ),
    )
    async def computer(
        action: Action,
        ctx: Context,
        x: int | None = None,
        y: int | None = None,
        text: str | None = None,
        key: str | None = None,
        amount: int | None = None,
    ) -> CallToolResult:
        inst = await gate.enter(ctx)
        conn = inst.conn

        def point() -> tuple[int, int]:
            if x is None or y is None:
                raise ToolError(f"action {action!r} needs both x and y")
            if not (0 <= x < screen.width and 0 <= y < screen.height):
                raise ToolError(f"({x}, {y}) is off the screen ({screen.width}x{screen.height})")
            return x, y

        if action == "screenshot":
            note = "screenshot"
        elif action == "click":
            note = screen.click(conn, *point())
        elif action == "type":
            if not text:
                raise ToolError("action 'type' needs a non-empty text")
            note = screen.type_text(conn, text)
        elif action == "key":
            if not key:
                raise ToolError("action 'key' needs a key")
            note = screen.key(conn, key)
        else:  # scroll
            if amount is None:
                raise ToolError("action 'scroll' needs an amount")
            note = screen.scroll(conn, *point(), amount)
        png = encode_png(screen.render(conn))
        return CallToolResult(
            content=[
                TextContent(type="text", text=note),
                ImageContent(type="image", data=png, mime_type="image/png"),
            ]
        )
