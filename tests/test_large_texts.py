"""Large texts are redacted off the event loop, in pieces, with the same result as whole."""

from __future__ import annotations

import random

import anyio

from fleetroll.policies import ToolCall
from fleetroll.telemetry.events import Redactor
from fleetroll.tools import ToolResult
from fleetroll.transcript import LARGE_TEXT, Transcript, redact_in_pieces

REDACT = Redactor(["sk-live-0123456789abcdef"])
#: What texts are made of: credentials in every shape the redactor knows, and the
#: characters the cuts are made at, in every order.
ATOMS = [
    "token=abc123",
    '"api_key": "k-987"',
    "Authorization: Bearer xyz.789",
    "authorization:\n  Basic dXNlcjpwYXNz",
    "password = hunter2",
    "sk-live-0123456789abcdef",
    "pylf_v1_us_abcdef",
    '"secret":\n"s3cr3t"',
    'authorization: ",leak',
    '",',
    '"",',
    ".\n",
    ",\n",
    "\n",
    " ",
    ":",
    "=",
    "\\",
    '"',
    "word",
    "}",
]


def text_of(rng: random.Random, size: int) -> str:
    parts, length = [], 0
    while length < size:
        part = rng.choice(ATOMS) if rng.random() < 0.3 else "lorem ipsum dolor"
        parts.append(part)
        length += len(part)
    return "".join(parts)


def test_redacting_in_pieces_gives_exactly_what_redacting_whole_gives() -> None:
    rng = random.Random(27)
    for _ in range(12):
        text = text_of(rng, 700_000)
        assert redact_in_pieces(text, REDACT) == REDACT(text)


def test_a_text_without_any_cut_point_is_redacted_whole() -> None:
    text = "token=" + "x" * 600_000
    assert redact_in_pieces(text, REDACT) == "token=[REDACTED]"


async def test_a_large_tool_answer_is_redacted_once_off_the_loop_and_export_reuses_it() -> None:
    calls: list[int] = []

    def redact(text: str) -> str:
        calls.append(len(text))
        return REDACT(text)

    transcript = Transcript()
    transcript.add_prompt("go")
    answer = ('{"rows": [' + '"row", ' * (LARGE_TEXT // 4) + '"token=abc"]}\n') * 2
    transcript.add_answer(ToolCall(id="c1", name="read", arguments={}), ToolResult(text=answer))
    with anyio.fail_after(30):
        await transcript.redact_ahead(redact)
    redacted_ahead = sum(calls)
    assert redacted_ahead >= len(answer)

    calls.clear()
    exported = transcript.export(redact, keep_images=False)

    assert exported[1]["content"] == REDACT(answer) and "abc" not in exported[1]["content"]
    assert sum(calls) < LARGE_TEXT  # the large answer was not redacted again
