"""``desktop``: a one-page desktop form app, driven through the screen (computer_use).

Each data key seeds a different screen: ``seed`` a contact form, ``signup`` an
account sign-up (with a scrollable country list and a terms checkbox),
``settings`` a settings page with toggles and a time zone list, ``files`` a
file browser where a file is selected and deleted. The widgets, the screen's
state and what was submitted all live in the instance database (see
:mod:`.desktop_screen`), so verifiers score the screen with SQL. The API tools
read the form and the submissions, and can fill fields and press buttons.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from fleetroll.emulator.computer import Screen
from fleetroll.emulator.envs.base import SampleEnv, ToolGate, create_schema
from fleetroll.emulator.envs.desktop_screen import (
    MAX_CHARS,
    ROW_H,
    DesktopScreen,
    form_state,
    press,
    widgets,
)

__all__ = ["DesktopEnv"]

_SCHEMA = """
CREATE TABLE widgets (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    label TEXT NOT NULL,
    x INTEGER NOT NULL,
    y INTEGER NOT NULL,
    w INTEGER NOT NULL,
    h INTEGER NOT NULL,
    value TEXT NOT NULL DEFAULT '',
    checked INTEGER NOT NULL DEFAULT 0,
    required INTEGER NOT NULL DEFAULT 0,
    rule TEXT,
    action TEXT
);
CREATE TABLE list_items (
    id INTEGER PRIMARY KEY,
    list_name TEXT NOT NULL,
    label TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    position INTEGER NOT NULL,
    selected INTEGER NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE ui_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE submissions (
    id INTEGER PRIMARY KEY,
    form TEXT NOT NULL,
    action TEXT NOT NULL,
    payload_json TEXT NOT NULL,
    created_at TEXT NOT NULL
);
"""

FIELD_X = 240
FIELD_W = 440
FIELD_H = 34

# (name, kind, label, x, y, w, h, value, checked, required, rule, action)
_Row = tuple[str, str, str, int, int, int, int, str, int, int, str | None, str | None]


def _text(
    name: str,
    label: str,
    y: int,
    *,
    value: str = "",
    required: bool = False,
    rule: str | None = None,
    kind: str = "text",
) -> _Row:
    return (name, kind, label, FIELD_X, y, FIELD_W, FIELD_H, value, 0, int(required), rule, None)


def _check(name: str, label: str, y: int, *, checked: bool = False, required: bool = False) -> _Row:
    return (
        name,
        "checkbox",
        label,
        FIELD_X,
        y,
        420,
        24,
        "",
        int(checked),
        int(required),
        None,
        None,
    )


def _button(name: str, label: str, x: int, y: int, w: int, action: str) -> _Row:
    return (name, "button", label, x, y, w, 40, "", 0, 0, None, action)


def _list(name: str, label: str, x: int, y: int, w: int, rows: int, *, required: bool) -> _Row:
    return (name, "list", label, x, y, w, rows * ROW_H, "", 0, int(required), None, None)


@dataclass(frozen=True, slots=True)
class _Form:
    form: str
    app: str
    title: str
    done_message: str
    default_button: str
    hint: str
    widgets: list[_Row]
    items: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    preselected: dict[str, str] = field(default_factory=dict)


_COUNTRIES = [
    "Argentina", "Australia", "Austria", "Belgium", "Brazil", "Canada", "Chile", "Denmark",
    "Finland", "France", "Germany", "India", "Ireland", "Italy", "Japan", "Mexico",
    "Netherlands", "Norway", "Portugal", "Spain", "Sweden", "United Kingdom", "United States",
]  # fmt: skip
_ZONES = [
    "UTC", "Africa/Cairo", "America/Chicago", "America/Denver", "America/Los_Angeles",
    "America/New_York", "America/Sao_Paulo", "Asia/Dubai", "Asia/Kolkata", "Asia/Shanghai",
    "Asia/Singapore", "Asia/Tokyo", "Australia/Sydney", "Europe/Amsterdam", "Europe/Berlin",
    "Europe/Dublin", "Europe/Lisbon", "Europe/London", "Europe/Madrid", "Europe/Paris",
    "Europe/Rome", "Europe/Stockholm", "Pacific/Auckland", "Pacific/Honolulu",
]  # fmt: skip
_FILES = [
    ("agenda-2026-01.docx", "24 KB · 2026-01-04"), ("annual-report.pdf", "2.1 MB · 2026-02-11"),
    ("backup-notes.txt", "3 KB · 2025-07-19"), ("brand-guide.pdf", "8.4 MB · 2025-03-02"),
    ("budget-2025.xlsx", "96 KB · 2025-01-15"), ("client-list.csv", "41 KB · 2025-11-30"),
    ("contract-acme.pdf", "310 KB · 2025-06-08"), ("contract-globex.pdf", "295 KB · 2025-09-21"),
    ("draft-old.docx", "18 KB · 2024-05-12"), ("expenses-q1.xlsx", "52 KB · 2025-04-03"),
    ("expenses-q2.xlsx", "49 KB · 2025-07-02"), ("expenses-q3.xlsx", "57 KB · 2025-10-06"),
    ("headshot.png", "1.2 MB · 2025-02-14"), ("invoice-1042.pdf", "88 KB · 2025-10-31"),
    ("invoice-1043.pdf", "90 KB · 2025-11-30"), ("logo-final.svg", "12 KB · 2025-03-01"),
    ("logo-final-v2.svg", "13 KB · 2025-03-09"), ("meeting-notes.md", "6 KB · 2026-01-20"),
    ("onboarding.pptx", "4.7 MB · 2025-08-18"), ("org-chart.png", "640 KB · 2025-09-01"),
    ("payroll-2025.xlsx", "120 KB · 2025-12-31"), ("press-kit.zip", "22 MB · 2025-05-05"),
    ("product-roadmap.pdf", "1.4 MB · 2026-01-08"), ("receipts-march.zip", "3.3 MB · 2025-04-01"),
    ("resume.pdf", "140 KB · 2025-10-10"), ("roadmap-old.pdf", "1.1 MB · 2024-11-22"),
    ("sales-pitch.pptx", "6.2 MB · 2025-12-02"), ("tax-return-2024.pdf", "530 KB · 2025-04-15"),
    ("team-photo.jpg", "3.9 MB · 2025-06-30"), ("tmp-export.csv", "2 KB · 2026-01-27"),
    ("travel-policy.pdf", "210 KB · 2025-01-09"), ("vacation-photos.zip", "48 MB · 2025-08-30"),
]  # fmt: skip

_FORMS: dict[str, _Form] = {
    "seed": _Form(
        form="contact",
        app="Acme Support",
        title="Contact us",
        done_message="Thanks! Your message was sent.",
        default_button="submit",
        hint="Fields marked * are required.",
        widgets=[
            _text("name", "Full name", 156, required=True),
            _text("email", "Email", 212, required=True, rule="email"),
            _text("subject", "Subject", 268),
            _text("message", "Message", 324, required=True),
            _check("copy", "Send me a copy", 384),
            _button("submit", "Submit", FIELD_X, 440, 140, "submit"),
            _button("clear", "Clear", 400, 440, 120, "clear"),
        ],
    ),
    "signup": _Form(
        form="signup",
        app="Nimbus Cloud",
        title="Create your account",
        done_message="Account created. Welcome to Nimbus!",
        default_button="create",
        hint="Fields marked * are required.",
        widgets=[
            _text("username", "Username", 156, required=True),
            _text("email", "Email", 212, value="sam@exmaple.com", required=True, rule="email"),
            _text("password", "Password", 268, required=True, rule="min8", kind="password"),
            _list("country", "Country", FIELD_X, 324, FIELD_W, 5, required=True),
            _check("terms", "I accept the terms of service", 488, required=True),
            _check("newsletter", "Email me product news", 528, checked=True),
            _button("create", "Create account", FIELD_X, 580, 200, "submit"),
        ],
        items={"country": [(c, "") for c in _COUNTRIES]},
    ),
    "settings": _Form(
        form="settings",
        app="Orbit Desktop",
        title="Settings",
        done_message="Settings saved.",
        default_button="save",
        hint="Changes take effect when you press Save.",
        widgets=[
            _text("display_name", "Display name", 156, value="Jon Smyth", required=True),
            _check("dark_mode", "Dark mode", 216),
            _check("notifications", "Email notifications", 256, checked=True),
            _check("auto_update", "Install updates automatically", 296, checked=True),
            _check("share_usage", "Share usage statistics", 336, checked=True),
            _list("timezone", "Time zone", FIELD_X, 392, FIELD_W, 6, required=True),
            _button("save", "Save", FIELD_X, 584, 140, "submit"),
        ],
        items={"timezone": [(z, "") for z in _ZONES]},
        preselected={"timezone": "UTC"},
    ),
    "files": _Form(
        form="files",
        app="Orbit Files",
        title="Documents",
        done_message="Done.",
        default_button="",
        hint="Select a file, then press Delete.",
        widgets=[
            _list("files", "", 60, 180, 760, 14, required=False),
            _button("delete", "Delete", 840, 180, 140, "delete"),
        ],
        items={"files": _FILES},
    ),
}


def _ui_state(form: _Form) -> list[tuple[str, str]]:
    return [
        ("form", form.form),
        ("app", form.app),
        ("title", form.title),
        ("done_message", form.done_message),
        ("default_button", form.default_button),
        ("hint", form.hint),
        ("focus", ""),
        ("select_all", ""),
        ("message", ""),
        ("message_kind", ""),
        ("error_field", ""),
    ]


class DesktopEnv(SampleEnv):
    key: ClassVar[str] = "desktop"
    name: ClassVar[str] = "Desktop"
    description: ClassVar[str] = (
        "A desktop form app (contact form, sign-up, settings, file browser) used through "
        "the screen: click fields, type, press keys, scroll lists, press buttons."
    )
    modality = "computer_use"
    data_keys: ClassVar[tuple[str, ...]] = tuple(_FORMS)

    def seed(self, conn: sqlite3.Connection, data_key: str) -> None:
        form = _FORMS[data_key]
        create_schema(conn, _SCHEMA)
        conn.executemany(
            "INSERT INTO widgets (name, kind, label, x, y, w, h, value, checked, required, rule,"
            " action) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            form.widgets,
        )
        for list_name, rows in form.items.items():
            chosen = form.preselected.get(list_name)
            conn.executemany(
                "INSERT INTO list_items (list_name, label, detail, position, selected)"
                " VALUES (?, ?, ?, ?, ?)",
                [
                    (list_name, label, detail, i, int(label == chosen))
                    for i, (label, detail) in enumerate(rows)
                ],
            )
            conn.execute("INSERT INTO ui_state VALUES (?, '0')", (f"scroll:{list_name}",))
        conn.executemany("INSERT INTO ui_state (key, value) VALUES (?, ?)", _ui_state(form))

    def screen(self) -> Screen:
        return DesktopScreen()

    def register_tools(self, server: MCPServer, gate: ToolGate) -> None:
        @server.tool(
            description=(
                "The form on screen as JSON: every field with its value (passwords masked), "
                "checkboxes, lists with their items and selection, focus and the message shown."
            )
        )
        async def get_form_state(ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            return form_state(conn)

        @server.tool(description="What the form's buttons have sent so far, oldest first.")
        async def list_submissions(ctx: Context, limit: int = 20) -> list[dict[str, Any]]:
            conn = (await gate.enter(ctx)).conn
            if not 1 <= limit <= 100:
                raise ToolError("limit must be between 1 and 100")
            return [
                {"id": i, "form": f, "action": a, "payload": json.loads(p), "created_at": t}
                for i, f, a, p, t in conn.execute(
                    "SELECT id, form, action, payload_json, created_at FROM submissions"
                    " ORDER BY id LIMIT ?",
                    (limit,),
                )
            ]

        @server.tool(
            description=(
                "Set a field by name: text for a text or password field, true/false for a "
                "checkbox, an item's label for a list (selects it)."
            )
        )
        async def set_field(name: str, value: str | bool, ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            target = next((w for w in widgets(conn) if w.name == name), None)
            if target is None or target.kind == "button":
                known = ", ".join(w.name for w in widgets(conn) if w.kind != "button")
                raise ToolError(f"no field named {name!r}; fields are: {known}")
            if target.kind == "checkbox":
                if not isinstance(value, bool):
                    raise ToolError(f"{name} is a checkbox: value must be true or false")
                conn.execute("UPDATE widgets SET checked = ? WHERE name = ?", (int(value), name))
            elif isinstance(value, bool):
                raise ToolError(f"{name} is a {target.kind}: value must be a string")
            elif target.kind == "list":
                row = conn.execute(
                    "SELECT id FROM list_items WHERE list_name = ? AND label = ? AND deleted = 0",
                    (name, value),
                ).fetchone()
                if row is None:
                    raise ToolError(f"{name} has no item {value!r}")
                conn.execute(
                    "UPDATE list_items SET selected = (id = ?) WHERE list_name = ?", (row[0], name)
                )
            elif len(value) > MAX_CHARS:
                raise ToolError(f"{name} takes at most {MAX_CHARS} characters")
            else:
                conn.execute("UPDATE widgets SET value = ? WHERE name = ?", (value, name))
            return form_state(conn)

        @server.tool(description="Press a button by name (as clicking it would).")
        async def press_button(name: str, ctx: Context) -> dict[str, Any]:
            conn = (await gate.enter(ctx)).conn
            buttons = [w for w in widgets(conn) if w.kind == "button"]
            target = next((w for w in buttons if w.name == name), None)
            if target is None:
                known = ", ".join(w.name for w in buttons)
                raise ToolError(f"no button named {name!r}; buttons are: {known}")
            return {"note": press(conn, target), "state": form_state(conn)}
