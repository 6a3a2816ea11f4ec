"""The ``desktop`` environment: its screen logic on a real SQLite database, its tasks."""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fleet._async.tasks import Task
from mcp import Client
from PIL import Image

from fleetroll.emulator import Emulator
from fleetroll.emulator.envs.desktop import DesktopEnv
from fleetroll.emulator.envs.desktop_screen import DesktopScreen
from fleetroll.emulator.instances import bind_clock

#: Integration tests (the emulator over loopback, real processes): outside `-m "not slow"`.
pytestmark = pytest.mark.slow

TASKS = Path(__file__).parents[2] / "config" / "tasks" / "desktop.jsonl"

# Centres of the widgets, as laid out by desktop.py.
NAME, EMAIL, SUBJECT, MESSAGE = (460, 173), (460, 229), (460, 285), (460, 341)
COPY, SUBMIT = (252, 396), (310, 460)
COUNTRY_TOP, TERMS, CREATE = 324, (252, 500), (340, 600)
FILES_TOP, DELETE = 180, (910, 200)


def row(top: int, index: int) -> int:
    return top + index * 28 + 14


@pytest.fixture
def screen() -> DesktopScreen:
    return DesktopScreen()


def seeded(data_key: str) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    bind_clock(conn)  # fleet_now(), as an instance's connection has
    DesktopEnv().seed(conn, data_key)
    return conn


@pytest.fixture
def contact() -> Iterator[sqlite3.Connection]:
    conn = seeded("seed")
    yield conn
    conn.close()


@pytest.fixture
def signup() -> Iterator[sqlite3.Connection]:
    conn = seeded("signup")
    yield conn
    conn.close()


@pytest.fixture
def files() -> Iterator[sqlite3.Connection]:
    conn = seeded("files")
    yield conn
    conn.close()


def value(conn: sqlite3.Connection, name: str) -> str:
    return str(conn.execute("SELECT value FROM widgets WHERE name = ?", (name,)).fetchone()[0])


def checked(conn: sqlite3.Connection, name: str) -> bool:
    return bool(conn.execute("SELECT checked FROM widgets WHERE name = ?", (name,)).fetchone()[0])


def state(conn: sqlite3.Connection, key: str) -> str:
    return str(conn.execute("SELECT value FROM ui_state WHERE key = ?", (key,)).fetchone()[0])


def submissions(conn: sqlite3.Connection) -> list[tuple[str, str, dict[str, Any]]]:
    rows = conn.execute("SELECT form, action, payload_json FROM submissions ORDER BY id")
    return [(form, action, json.loads(payload)) for form, action, payload in rows]


def selected(conn: sqlite3.Connection, list_name: str) -> list[str]:
    rows = conn.execute(
        "SELECT label FROM list_items WHERE list_name = ? AND selected = 1", (list_name,)
    )
    return [r[0] for r in rows]


def test_clicking_a_field_focuses_it(screen, contact) -> None:
    assert screen.click(contact, *EMAIL) == "focused Email"
    assert state(contact, "focus") == "email"


def test_typing_fills_the_focused_field(screen, contact) -> None:
    screen.click(contact, *NAME)
    assert screen.type_text(contact, "Ada ") == "typed 4 characters into Full name"
    screen.type_text(contact, "Lovelace")
    assert value(contact, "name") == "Ada Lovelace" and value(contact, "email") == ""


def test_typing_with_nothing_focused_changes_nothing(screen, contact) -> None:
    assert screen.type_text(contact, "hello") == "typed, but nothing has focus"
    assert {value(contact, n) for n in ("name", "email", "subject", "message")} == {""}


def test_clicking_empty_space_says_nothing_is_there_and_drops_the_focus(screen, contact) -> None:
    screen.click(contact, *NAME)
    assert screen.click(contact, 900, 700) == "clicked at (900, 700): nothing there"
    assert state(contact, "focus") == ""


def test_backspace_deletes_the_last_character_of_the_focused_field(screen, signup) -> None:
    screen.click(signup, *EMAIL)
    note = screen.key(signup, "Backspace")
    assert value(signup, "email") == "sam@exmaple.co" and "sam@exmaple.co" in note


def test_select_all_then_typing_replaces_the_whole_text(screen, signup) -> None:
    screen.click(signup, *EMAIL)
    screen.key(signup, "ctrl+a")
    screen.type_text(signup, "new@example.org")
    assert value(signup, "email") == "new@example.org"
    screen.key(signup, "ctrl+a")
    screen.key(signup, "Backspace")
    assert value(signup, "email") == ""


def test_tab_moves_focus_to_the_next_widget_and_shift_tab_back(screen, contact) -> None:
    screen.click(contact, *NAME)
    assert screen.key(contact, "Tab") == "focused Email"
    screen.key(contact, "Tab")
    assert state(contact, "focus") == "subject"
    screen.key(contact, "shift+Tab")
    assert state(contact, "focus") == "email"


def test_a_tab_in_typed_text_moves_to_the_next_field(screen, contact) -> None:
    screen.click(contact, *NAME)
    screen.type_text(contact, "Ada\tada@example.com")
    assert value(contact, "name") == "Ada" and value(contact, "email") == "ada@example.com"


def test_clicking_a_checkbox_toggles_it(screen, contact) -> None:
    assert screen.click(contact, *COPY) == "checked Send me a copy"
    assert checked(contact, "copy")
    assert screen.click(contact, *COPY) == "unchecked Send me a copy"
    assert not checked(contact, "copy")


def test_space_toggles_the_focused_checkbox(screen, contact) -> None:
    screen.click(contact, *MESSAGE)
    screen.key(contact, "Tab")
    assert state(contact, "focus") == "copy"
    screen.key(contact, "space")
    assert checked(contact, "copy")


def test_scrolling_a_list_moves_it_and_stops_at_the_end(screen, signup) -> None:
    note = screen.scroll(signup, 460, 394, 2)
    assert state(signup, "scroll:country") == "6" and "rows 7-11 of 23" in note
    screen.scroll(signup, 460, 394, 50)
    assert state(signup, "scroll:country") == "18"
    assert screen.scroll(signup, 460, 394, 1) == "Country is already at the bottom"
    screen.scroll(signup, 460, 394, -50)
    assert state(signup, "scroll:country") == "0"


def test_scrolling_outside_a_list_does_nothing(screen, signup) -> None:
    assert screen.scroll(signup, *NAME, 3) == "nothing to scroll at (460, 173)"
    assert state(signup, "scroll:country") == "0"


def test_clicking_a_list_row_selects_the_item_shown_there(screen, signup) -> None:
    screen.click(signup, 400, row(COUNTRY_TOP, 2))
    assert selected(signup, "country") == ["Austria"]
    screen.scroll(signup, 460, 394, 5)
    assert screen.click(signup, 400, row(COUNTRY_TOP, 3)) == "selected Portugal"
    assert selected(signup, "country") == ["Portugal"]


def test_arrow_keys_move_the_selection_and_keep_it_in_view(screen, signup) -> None:
    screen.click(signup, 400, row(COUNTRY_TOP, 4))
    screen.key(signup, "Down")
    assert selected(signup, "country") == ["Canada"]
    assert state(signup, "scroll:country") == "1"


def test_submitting_with_a_missing_required_field_shows_an_error_and_sends_nothing(
    screen, contact
) -> None:
    screen.click(contact, *NAME)
    screen.type_text(contact, "Ada")
    note = screen.click(contact, *SUBMIT)
    assert "Email is required" in note and state(contact, "message") == "Email is required"
    assert state(contact, "error_field") == "email" and submissions(contact) == []


def test_submitting_with_a_bad_email_is_refused(screen, contact) -> None:
    for field, text in ((NAME, "Ada"), (EMAIL, "ada-at-example"), (MESSAGE, "Hi")):
        screen.click(contact, *field)
        screen.type_text(contact, text)
    screen.click(contact, *SUBMIT)
    assert state(contact, "message") == "Email must be a valid email address"
    assert submissions(contact) == []


def test_the_submit_button_writes_one_submission_with_the_form_values(screen, contact) -> None:
    for field, text in ((NAME, "Ada"), (EMAIL, "ada@example.com"), (MESSAGE, "Hi")):
        screen.click(contact, *field)
        screen.type_text(contact, text)
    screen.click(contact, *COPY)
    assert screen.click(contact, *SUBMIT) == "submitted contact form"
    payload = {"name": "Ada", "email": "ada@example.com", "subject": "", "message": "Hi"}
    assert submissions(contact) == [("contact", "submit", {**payload, "copy": True})]
    assert state(contact, "message_kind") == "ok"


def test_enter_presses_the_default_button(screen, signup) -> None:
    screen.click(signup, *NAME)
    screen.type_text(signup, "sam_r")
    screen.key(signup, "Tab")
    screen.key(signup, "Tab")
    screen.type_text(signup, "long-enough")
    screen.click(signup, 400, row(COUNTRY_TOP, 0))
    note = screen.key(signup, "Enter")
    assert "You must tick" in note and submissions(signup) == []
    screen.click(signup, *TERMS)
    assert screen.key(signup, "Return") == "submitted signup form"
    assert submissions(signup)[0][2]["country"] == "Argentina"


def test_delete_removes_the_selected_file_and_logs_it(screen, files) -> None:
    assert "nothing is selected" in screen.click(files, *DELETE)
    screen.scroll(files, 440, 376, 6)
    screen.click(files, 300, row(FILES_TOP, 7))
    assert screen.click(files, *DELETE) == "deleted roadmap-old.pdf"
    gone = files.execute("SELECT label FROM list_items WHERE deleted = 1").fetchall()
    assert gone == [("roadmap-old.pdf",)]
    assert submissions(files) == [("files", "delete", {"deleted": "roadmap-old.pdf"})]
    assert state(files, "scroll:files") == "17"  # one row fewer to scroll through


def test_the_files_screen_has_no_default_button(screen, files) -> None:
    assert "no default button" in screen.key(files, "Enter")


@pytest.mark.parametrize("data_key", DesktopEnv.data_keys)
def test_rendering_returns_an_image_of_the_screen_size(screen, data_key) -> None:
    conn = seeded(data_key)
    screen.click(conn, *NAME)
    screen.type_text(conn, "x" * 80)
    image = screen.render(conn)
    conn.close()
    assert isinstance(image, Image.Image) and image.size == (screen.width, screen.height)


def load_tasks() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TASKS.read_text().splitlines() if line.strip()]


class _Database:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def query(self, sql: str, args: list[Any] | None = None) -> SimpleNamespace:
        cursor = self._conn.execute(sql, args or [])
        columns = [d[0] for d in cursor.description or ()]
        return SimpleNamespace(columns=columns, rows=[list(r) for r in cursor.fetchall()])


class _Env:
    """The part of Fleet's env a verifier uses, over one connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def db(self, name: str = "current") -> _Database:
        assert name == "current"
        return _Database(self._conn)


def run_verifier(code: str, conn: sqlite3.Connection) -> Any:
    namespace: dict[str, Any] = {"json": json, "re": re}
    exec(compile(code, "verifier.py", "exec"), namespace)
    funcs = [v for k, v in namespace.items() if callable(v) and k not in ("json", "re")]
    assert len(funcs) == 1
    return funcs[0](_Env(conn), final_answer=None)


def act(screen: DesktopScreen, conn: sqlite3.Connection, arguments: dict[str, Any]) -> str:
    action = arguments["action"]
    if action == "click":
        return screen.click(conn, arguments["x"], arguments["y"])
    if action == "type":
        return screen.type_text(conn, arguments["text"])
    if action == "key":
        return screen.key(conn, arguments["key"])
    assert action == "scroll"
    return screen.scroll(conn, arguments["x"], arguments["y"], arguments["amount"])


def test_there_are_at_least_eight_computer_use_tasks_with_unique_keys() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 8 and len({t["key"] for t in tasks}) == len(tasks)
    assert {t["data_id"] for t in tasks} == set(DesktopEnv.data_keys)
    for t in tasks:
        assert t["env_id"] == "desktop" and t["metadata"]["task_modality"] == "computer_use"
        assert all(step["name"] == "computer" for step in t["solution"])
        assert t["max_steps"] >= len(t["solution"])


@pytest.mark.parametrize("task", load_tasks(), ids=lambda t: t["key"])
def test_each_task_fails_on_a_fresh_screen_and_passes_after_its_solution(screen, task) -> None:
    conn = seeded(task["data_id"])
    assert run_verifier(task["verifier_func"], conn) == 0.0
    for step in task["solution"]:
        note = act(screen, conn, step["arguments"])
        assert "nothing there" not in note and "not submitted" not in note, note
    assert run_verifier(task["verifier_func"], conn) == 1.0
    conn.close()


def test_a_task_solved_wrongly_scores_zero(screen) -> None:
    task = next(t for t in load_tasks() if t["key"] == "desktop-003")
    conn = seeded("signup")
    # Everything but the email fix: the typo goes through, and the verifier catches it.
    steps = [s for s in task["solution"] if s["arguments"].get("key") != "Backspace"]
    steps = [s for s in steps if s["arguments"].get("text") != "ample.com"]
    for step in steps:
        act(screen, conn, step["arguments"])
    assert run_verifier(task["verifier_func"], conn) == 0.0
    conn.close()


async def test_a_task_is_solved_through_the_computer_tool_and_verified_remotely(sdk) -> None:
    task = next(t for t in load_tasks() if t["key"] == "desktop-008")
    async with Emulator() as emu:
        env = await sdk(emu).make("desktop:v1", data_key="files:v1", image_type="mcp")
        verifier = Task(
            key=task["key"],
            prompt=task["prompt"],
            env_id="desktop",
            version="v1",
            verifier_func=task["verifier_func"],
        )
        fresh = await verifier.verify_detailed_async(env, final_answer=None)
        async with Client(f"{env.urls.root}api/v1/mcp") as session:
            for step in task["solution"]:
                result = await session.call_tool(step["name"], step["arguments"])
                assert not result.is_error
        done = await verifier.verify_detailed_async(env, final_answer=None)
        await env.close()
    assert fresh.result == 0.0 and done.success and done.result == 1.0


async def test_the_api_tools_read_and_fill_the_form_and_reject_bad_arguments(sdk) -> None:
    async with Emulator() as emu:
        env = await sdk(emu).make("desktop", data_key="seed")
        async with Client(env.mcp.url) as session:
            names = {t.name for t in (await session.list_tools()).tools}
            assert "computer" not in names
            assert {"get_form_state", "list_submissions", "set_field", "press_button"} <= names
            for name, text in (("name", "Ada"), ("email", "ada@example.com"), ("message", "Hi")):
                result = await session.call_tool("set_field", {"name": name, "value": text})
                assert not result.is_error
            pressed = await session.call_tool("press_button", {"name": "submit"})
            sent = await session.call_tool("list_submissions", {})
            unknown = await session.call_tool("set_field", {"name": "phone", "value": "1"})
            wrong_type = await session.call_tool("set_field", {"name": "copy", "value": "yes"})
            bad_limit = await session.call_tool("list_submissions", {"limit": 0})
        await env.close()
    assert pressed.structured_content is not None
    assert pressed.structured_content["note"] == "submitted contact form"
    assert sent.structured_content is not None
    assert sent.structured_content["result"][0]["payload"]["email"] == "ada@example.com"
    for bad, words in ((unknown, "no field named 'phone'"), (wrong_type, "true or false")):
        assert bad.is_error and words in bad.content[0].text
    assert bad_limit.is_error
