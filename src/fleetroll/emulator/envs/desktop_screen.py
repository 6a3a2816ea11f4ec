"""The ``desktop`` environment's screen: form widgets kept, driven and drawn in SQLite.

Everything the screen shows lives in the instance database, so a verifier can
score it with SQL:

* ``widgets``: text and password fields, checkboxes, buttons and scrollable
  lists, each with its box on the screen (``x, y, w, h``), its ``value`` (text
  fields) or ``checked`` (checkboxes), whether it is ``required``, a
  validation ``rule`` (``email``, ``min8``) and, for buttons, an ``action``
  (``submit``, ``clear``, ``delete``);
* ``list_items``: the lists' rows, with ``selected`` and ``deleted``;
* ``ui_state``: focus, the lists' scroll offsets, the message banner and the
  form's name, title and default button;
* ``submissions``: what the form's buttons sent, as JSON.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from fleetroll.emulator.computer import Screen, blank, font

__all__ = [
    "MAX_CHARS",
    "ROW_H",
    "SCROLL_ROWS",
    "DesktopScreen",
    "Widget",
    "form_state",
    "press",
    "widgets",
]

#: Height of one list row, in pixels.
ROW_H = 28
#: List rows moved by one scroll notch.
SCROLL_ROWS = 3
#: Width of a list's scrollbar, at its right edge.
SCROLLBAR_W = 14
#: Longest text a field takes.
MAX_CHARS = 100
LABEL_X = 60

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")
_KEYS = {
    "return": "enter",
    "kp_enter": "enter",
    "backspace": "backspace",
    "iso_left_tab": "shift+tab",
    " ": "space",
    "esc": "escape",
    "arrowup": "up",
    "arrowdown": "down",
    "control+a": "ctrl+a",
}


@dataclass(frozen=True, slots=True)
class Widget:
    name: str
    kind: str  # text, password, checkbox, button, list
    label: str
    x: int
    y: int
    w: int
    h: int
    value: str
    checked: bool
    required: bool
    rule: str | None
    action: str | None

    def contains(self, px: int, py: int) -> bool:
        return self.x <= px < self.x + self.w and self.y <= py < self.y + self.h

    @property
    def is_text(self) -> bool:
        return self.kind in ("text", "password")


def widgets(conn: sqlite3.Connection) -> list[Widget]:
    """The form's widgets, in tab order."""
    rows = conn.execute(
        "SELECT name, kind, label, x, y, w, h, value, checked, required, rule, action"
        " FROM widgets ORDER BY id"
    )
    return [
        Widget(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], bool(r[8]), bool(r[9]), r[10], r[11])
        for r in rows
    ]


def _widget(conn: sqlite3.Connection, name: str) -> Widget | None:
    return next((w for w in widgets(conn) if w.name == name), None)


def _get(conn: sqlite3.Connection, key: str, default: str = "") -> str:
    row = conn.execute("SELECT value FROM ui_state WHERE key = ?", (key,)).fetchone()
    return str(row[0]) if row else default


def _set(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO ui_state (key, value) VALUES (?, ?)", (key, value))


def _focus(conn: sqlite3.Connection, name: str) -> None:
    _set(conn, "focus", name)
    _set(conn, "select_all", "")


def _message(conn: sqlite3.Connection, text: str, kind: str = "", field: str = "") -> None:
    _set(conn, "message", text)
    _set(conn, "message_kind", kind)
    _set(conn, "error_field", field)


def _items(conn: sqlite3.Connection, list_name: str) -> list[tuple[int, str, str, bool]]:
    """A list's rows still shown: ``(id, label, detail, selected)``."""
    rows = conn.execute(
        "SELECT id, label, detail, selected FROM list_items"
        " WHERE list_name = ? AND deleted = 0 ORDER BY position",
        (list_name,),
    )
    return [(r[0], r[1], r[2], bool(r[3])) for r in rows]


def _selected(conn: sqlite3.Connection, list_name: str) -> str | None:
    return next((label for _, label, _, sel in _items(conn, list_name) if sel), None)


def _scroll_to(conn: sqlite3.Connection, lst: Widget, offset: int) -> int:
    top = max(0, len(_items(conn, lst.name)) - lst.h // ROW_H)
    offset = min(max(offset, 0), top)
    _set(conn, f"scroll:{lst.name}", str(offset))
    return offset


def _scroll_of(conn: sqlite3.Connection, lst: Widget) -> int:
    return int(_get(conn, f"scroll:{lst.name}", "0"))


def _select(conn: sqlite3.Connection, lst: Widget, item_id: int) -> None:
    conn.execute(
        "UPDATE list_items SET selected = (id = ?) WHERE list_name = ?", (item_id, lst.name)
    )


def _payload(conn: sqlite3.Connection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for w in widgets(conn):
        if w.is_text:
            out[w.name] = w.value
        elif w.kind == "checkbox":
            out[w.name] = w.checked
        elif w.kind == "list":
            out[w.name] = _selected(conn, w.name)
    return out


def _problem(conn: sqlite3.Connection) -> tuple[str, str] | None:
    """The first reason the form cannot be submitted, and the widget at fault."""
    for w in widgets(conn):
        value = w.value.strip()
        if w.is_text and w.required and not value:
            return f"{w.label} is required", w.name
        if w.is_text and value and w.rule == "email" and not _EMAIL.match(value):
            return f"{w.label} must be a valid email address", w.name
        if w.is_text and value and w.rule == "min8" and len(value) < 8:
            return f"{w.label} must be at least 8 characters", w.name
        if w.kind == "checkbox" and w.required and not w.checked:
            return f"You must tick “{w.label}”", w.name
        if w.kind == "list" and w.required and _selected(conn, w.name) is None:
            return f"Choose a {w.label.lower()}", w.name
    return None


def _record(conn: sqlite3.Connection, action: str, payload: dict[str, Any]) -> None:
    conn.execute(
        # fleet_now(): the instance's clock (its reset's timestamp, when pinned).
        "INSERT INTO submissions (form, action, payload_json, created_at)"
        " VALUES (?, ?, ?, fleet_now())",
        (_get(conn, "form"), action, json.dumps(payload, sort_keys=True)),
    )


def press(conn: sqlite3.Connection, button: Widget) -> str:
    """Do what ``button`` does; a note saying what happened."""
    form = _get(conn, "form")
    if button.action == "submit":
        problem = _problem(conn)
        if problem is not None:
            _message(conn, problem[0], "error", problem[1])
            return f"pressed {button.label}: not submitted, {problem[0]}"
        _record(conn, "submit", _payload(conn))
        _message(conn, _get(conn, "done_message", "Submitted."), "ok")
        return f"submitted {form} form"
    if button.action == "clear":
        conn.execute("UPDATE widgets SET value = '', checked = 0")
        conn.execute("UPDATE list_items SET selected = 0")
        _message(conn, "Form cleared.")
        return f"cleared {form} form"
    if button.action == "delete":
        lst = next((w for w in widgets(conn) if w.kind == "list"), None)
        if lst is None:
            return f"pressed {button.label}: there is nothing here to delete"
        target = next((i for i in _items(conn, lst.name) if i[3]), None)
        if target is None:
            _message(conn, f"Select an item in {lst.label or 'the list'} first", "error")
            return f"pressed {button.label}: nothing is selected"
        conn.execute("UPDATE list_items SET deleted = 1, selected = 0 WHERE id = ?", (target[0],))
        _scroll_to(conn, lst, _scroll_of(conn, lst))
        _record(conn, "delete", {"deleted": target[1]})
        _message(conn, f"Deleted {target[1]}", "ok")
        return f"deleted {target[1]}"
    return f"pressed {button.label}: nothing happened"


def form_state(conn: sqlite3.Connection) -> dict[str, Any]:
    """The form as JSON: fields, checkboxes, lists, focus and message."""
    fields: list[dict[str, Any]] = []
    for w in widgets(conn):
        entry: dict[str, Any] = {"name": w.name, "kind": w.kind, "label": w.label}
        if w.is_text:
            entry["value"] = "*" * len(w.value) if w.kind == "password" else w.value
        elif w.kind == "checkbox":
            entry["checked"] = w.checked
        elif w.kind == "list":
            entry["items"] = [label for _, label, _, _ in _items(conn, w.name)]
            entry["selected"] = _selected(conn, w.name)
        if w.kind != "button":
            entry["required"] = w.required
        fields.append(entry)
    return {
        "form": _get(conn, "form"),
        "title": _get(conn, "title"),
        "focus": _get(conn, "focus") or None,
        "message": _get(conn, "message") or None,
        "fields": fields,
    }


class DesktopScreen(Screen):
    """A one-page form app: click, type and scroll like on a real desktop."""

    def click(self, conn: sqlite3.Connection, x: int, y: int) -> str:
        hit = next((w for w in widgets(conn) if w.contains(x, y)), None)
        if hit is None:
            _focus(conn, "")
            return f"clicked at ({x}, {y}): nothing there"
        _focus(conn, hit.name)
        if hit.kind == "checkbox":
            conn.execute("UPDATE widgets SET checked = 1 - checked WHERE name = ?", (hit.name,))
            return f"{'unchecked' if hit.checked else 'checked'} {hit.label}"
        if hit.kind == "button":
            return press(conn, hit)
        if hit.kind == "list":
            return self._click_list(conn, hit, x, y)
        return f"focused {hit.label}"

    def _click_list(self, conn: sqlite3.Connection, lst: Widget, x: int, y: int) -> str:
        shown = lst.h // ROW_H
        offset = _scroll_of(conn, lst)
        if x >= lst.x + lst.w - SCROLLBAR_W:  # the scrollbar pages, like a real one
            step = shown if y >= lst.y + lst.h // 2 else -shown
            return self._scrolled(conn, lst, _scroll_to(conn, lst, offset + step), offset)
        items = _items(conn, lst.name)
        index = offset + (y - lst.y) // ROW_H
        if index >= len(items):
            return f"clicked empty space in {lst.label or 'the list'}"
        _select(conn, lst, items[index][0])
        return f"selected {items[index][1]}"

    def _scrolled(self, conn: sqlite3.Connection, lst: Widget, new: int, old: int) -> str:
        total = len(_items(conn, lst.name))
        name = lst.label or "the list"
        if new == old:
            return f"{name} is already at the {'top' if new == 0 else 'bottom'}"
        last = min(total, new + lst.h // ROW_H)
        return f"scrolled {name}: rows {new + 1}-{last} of {total} shown"

    def type_text(self, conn: sqlite3.Connection, text: str) -> str:
        notes: list[str] = []
        run = ""
        for ch in text:
            if ch in "\n\t":
                if run:
                    notes.append(self._insert(conn, run))
                    run = ""
                notes.append(self.key(conn, "Enter" if ch == "\n" else "Tab"))
            elif ch.isprintable():
                run += ch
        if run:
            notes.append(self._insert(conn, run))
        return "; ".join(notes) or "typed nothing printable"

    def _insert(self, conn: sqlite3.Connection, text: str) -> str:
        target = _widget(conn, _get(conn, "focus"))
        if target is None:
            return "typed, but nothing has focus"
        if not target.is_text:
            return f"typed, but {target.label} is not a text field"
        old = "" if _get(conn, "select_all") == target.name else target.value
        value = (old + text)[:MAX_CHARS]
        conn.execute("UPDATE widgets SET value = ? WHERE name = ?", (value, target.name))
        _set(conn, "select_all", "")
        kept = len(value) - len(old)
        cut = (
            f" ({len(text) - kept} over the {MAX_CHARS}-character limit dropped)"
            if kept < len(text)
            else ""
        )
        return f"typed {kept} characters into {target.label}{cut}"

    def key(self, conn: sqlite3.Connection, key: str) -> str:
        name = key.strip().lower()
        name = _KEYS.get(name, name)
        focused = _widget(conn, _get(conn, "focus"))
        if name in ("tab", "shift+tab"):
            order = widgets(conn)
            at = next((i for i, w in enumerate(order) if focused and w.name == focused.name), None)
            step = -1 if name == "shift+tab" else 1
            if at is None:
                nxt = order[0] if step > 0 else order[-1]
            else:
                nxt = order[(at + step) % len(order)]
            _focus(conn, nxt.name)
            return f"focused {nxt.label}"
        if name == "escape":
            _focus(conn, "")
            return "focus cleared"
        if focused is not None and focused.is_text:
            if name == "backspace":
                value = "" if _get(conn, "select_all") == focused.name else focused.value[:-1]
                conn.execute("UPDATE widgets SET value = ? WHERE name = ?", (value, focused.name))
                _set(conn, "select_all", "")
                if focused.kind == "password":
                    return f"deleted a character from {focused.label}"
                return f"{focused.label} now reads {value!r}"
            if name == "ctrl+a":
                _set(conn, "select_all", focused.name)
                return f"selected all text in {focused.label}"
            if name == "space":
                return self._insert(conn, " ")
        if focused is not None and name == "space" and focused.kind in ("checkbox", "button"):
            return self.click(conn, focused.x + 1, focused.y + 1)
        if focused is not None and focused.kind == "list" and name in ("up", "down"):
            return self._arrow(conn, focused, -1 if name == "up" else 1)
        if name == "enter":
            if focused is not None and focused.kind == "button":
                return press(conn, focused)
            default = _widget(conn, _get(conn, "default_button"))
            if default is None:
                return "pressed Enter: this screen has no default button"
            return press(conn, default)
        return f"pressed {key}: nothing happened"

    def _arrow(self, conn: sqlite3.Connection, lst: Widget, step: int) -> str:
        items = _items(conn, lst.name)
        if not items:
            return f"{lst.label or 'the list'} is empty"
        at = next((i for i, item in enumerate(items) if item[3]), -1)
        index = min(max(at + step, 0), len(items) - 1)
        _select(conn, lst, items[index][0])
        offset, shown = _scroll_of(conn, lst), lst.h // ROW_H
        if not offset <= index < offset + shown:  # keep the selection in view
            _scroll_to(conn, lst, index if index < offset else index - shown + 1)
        return f"selected {items[index][1]}"

    def scroll(self, conn: sqlite3.Connection, x: int, y: int, amount: int) -> str:
        lst = next((w for w in widgets(conn) if w.kind == "list" and w.contains(x, y)), None)
        if lst is None:
            return f"nothing to scroll at ({x}, {y})"
        if amount == 0:
            return f"scrolled {lst.label or 'the list'} by 0: nothing moved"
        old = _scroll_of(conn, lst)
        return self._scrolled(conn, lst, _scroll_to(conn, lst, old + amount * SCROLL_ROWS), old)

    # Drawing

    def render(self, conn: sqlite3.Connection) -> Image.Image:
        image, draw = blank(self, "#f4f5f7")
        draw.rectangle((0, 0, self.width, 56), fill="#2b3a55")
        draw.text((24, 16), _get(conn, "app"), fill="#ffffff", font=font(22))
        draw.text((LABEL_X, 70), _get(conn, "title"), fill="#1d2433", font=font(26))
        message, kind = _get(conn, "message"), _get(conn, "message_kind")
        if message:
            colors = {"error": ("#fdecec", "#b42318"), "ok": ("#e8f6ec", "#1e7b34")}
            bg, fg = colors.get(kind, ("#e9eef6", "#2b3a55"))
            draw.rounded_rectangle((LABEL_X, 108, 980, 138), 6, fill=bg)
            draw.text((LABEL_X + 12, 114), message, fill=fg, font=font(16))
        else:
            draw.text((LABEL_X, 114), _get(conn, "hint"), fill="#5b6577", font=font(16))
        focus, error = _get(conn, "focus"), _get(conn, "error_field")
        select_all = _get(conn, "select_all")
        for w in widgets(conn):
            outline = "#1a73e8" if w.name == focus else "#b42318" if w.name == error else None
            if w.is_text:
                self._draw_field(draw, w, outline, focused=w.name == focus, all_=select_all)
            elif w.kind == "checkbox":
                self._draw_checkbox(draw, w, outline)
            elif w.kind == "button":
                primary = w.name == _get(conn, "default_button") or w.action == "delete"
                self._draw_button(draw, w, outline, primary)
            elif w.kind == "list":
                self._draw_list(conn, draw, w, outline)
        return image

    def _label(self, draw: ImageDraw.ImageDraw, w: Widget, y: int) -> None:
        text = w.label + (" *" if w.required else "")
        draw.text((LABEL_X, y), text, fill="#1d2433", font=font(17))

    def _draw_field(
        self, draw: ImageDraw.ImageDraw, w: Widget, outline: str | None, *, focused: bool, all_: str
    ) -> None:
        self._label(draw, w, w.y + 8)
        draw.rectangle((w.x, w.y, w.x + w.w, w.y + w.h), fill="#ffffff", outline="#8a94a6")
        if outline:
            draw.rectangle(
                (w.x - 1, w.y - 1, w.x + w.w + 1, w.y + w.h + 1), outline=outline, width=2
            )
        shown = "*" * len(w.value) if w.kind == "password" else w.value
        f = font(17)
        while shown and draw.textlength(shown, font=f) > w.w - 20:  # keep the caret's end in view
            shown = shown[1:]
        left, top = w.x + 8, w.y + (w.h - 17) // 2
        if all_ == w.name and shown:
            draw.rectangle(
                (left - 1, top - 2, left + draw.textlength(shown, font=f), top + 19), fill="#b3d1fa"
            )
        draw.text((left, top), shown, fill="#111111", font=f)
        if focused:
            caret = left + draw.textlength(shown, font=f) + 1
            draw.line((caret, top - 1, caret, top + 19), fill="#111111", width=1)

    def _draw_checkbox(self, draw: ImageDraw.ImageDraw, w: Widget, outline: str | None) -> None:
        x, y, side = w.x, w.y, min(w.h, 24)
        draw.rectangle((x, y, x + side, y + side), fill="#ffffff", outline="#5b6577", width=2)
        if w.checked:
            draw.rectangle((x, y, x + side, y + side), fill="#1a73e8", outline="#1a73e8", width=2)
            draw.line((x + 5, y + 12, x + 10, y + 18, x + 19, y + 6), fill="#ffffff", width=3)
        text = w.label + (" *" if w.required else "")
        draw.text((x + side + 12, y + 3), text, fill="#1d2433", font=font(17))
        if outline:
            draw.rectangle((x - 3, y - 3, x + w.w, y + side + 3), outline=outline, width=2)

    def _draw_button(
        self, draw: ImageDraw.ImageDraw, w: Widget, outline: str | None, primary: bool
    ) -> None:
        fill, fg = ("#1a73e8", "#ffffff") if primary else ("#e3e7ee", "#1d2433")
        box = (w.x, w.y, w.x + w.w, w.y + w.h)
        draw.rounded_rectangle(
            box, 8, fill=fill, outline=outline or fill, width=2 if outline else 1
        )
        f = font(18)
        width = draw.textlength(w.label, font=f)
        draw.text((w.x + (w.w - width) / 2, w.y + (w.h - 18) / 2), w.label, fill=fg, font=f)

    def _draw_list(
        self, conn: sqlite3.Connection, draw: ImageDraw.ImageDraw, w: Widget, outline: str | None
    ) -> None:
        if w.label:
            self._label(draw, w, w.y + 4)
        draw.rectangle((w.x, w.y, w.x + w.w, w.y + w.h), fill="#ffffff", outline="#8a94a6")
        items = _items(conn, w.name)
        if any(detail for _, _, detail, _ in items):
            draw.text((w.x + 10, w.y - 22), "Name", fill="#5b6577", font=font(15))
            draw.text((w.x + w.w - 260, w.y - 22), "Size · Modified", fill="#5b6577", font=font(15))
        shown, offset = w.h // ROW_H, _scroll_of(conn, w)
        right = w.x + w.w - SCROLLBAR_W
        for row, (_, label, detail, selected) in enumerate(items[offset : offset + shown]):
            top = w.y + row * ROW_H
            fg = "#ffffff" if selected else "#1d2433"
            if selected:
                draw.rectangle((w.x + 1, top + 1, right - 1, top + ROW_H - 1), fill="#1a73e8")
            elif row % 2:
                draw.rectangle((w.x + 1, top + 1, right - 1, top + ROW_H - 1), fill="#f6f8fb")
            draw.text((w.x + 10, top + 6), label, fill=fg, font=font(16))
            if detail:
                draw.text((w.x + w.w - 260, top + 6), detail, fill=fg, font=font(15))
        draw.rectangle((right, w.y + 1, w.x + w.w - 1, w.y + w.h - 1), fill="#eceff3")
        if len(items) > shown:
            thumb_h = max(20, w.h * shown // len(items))
            thumb_y = w.y + (w.h - thumb_h) * offset // (len(items) - shown)
            draw.rounded_rectangle(
                (right + 2, thumb_y, right + SCROLLBAR_W - 3, thumb_y + thumb_h), 4, fill="#9aa3b2"
            )
        if outline:
            draw.rectangle(
                (w.x - 1, w.y - 1, w.x + w.w + 1, w.y + w.h + 1), outline=outline, width=2
            )
