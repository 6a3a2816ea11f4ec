"""Large texts are redacted off the event loop, in pieces, with the same result as whole."""

from __future__ import annotations

import random

import anyio
import pytest

from fleetroll.policies import ToolCall
from fleetroll.rollout.transcript import LARGE_TEXT, Transcript
from fleetroll.telemetry.events import Redactor
from fleetroll.tools.session import ToolResult

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


def text_of(rng: random.Random, size: int, *, authorization: bool = True) -> str:
    atoms = ATOMS if authorization else [a for a in ATOMS if "uthoriz" not in a]
    parts, length = [], 0
    while length < size:
        part = rng.choice(atoms) if rng.random() < 0.3 else "lorem ipsum dolor"
        parts.append(part)
        length += len(part)
    return "".join(parts)


@pytest.mark.parametrize("authorization", [True, False])
def test_redacting_in_pieces_gives_exactly_what_redacting_whole_gives(
    authorization: bool,
) -> None:
    rng = random.Random(27)
    for _ in range(8):
        text = text_of(rng, 700_000, authorization=authorization)
        assert REDACT.in_pieces(text) == REDACT(text)


def test_a_single_line_of_credentials_is_cut_at_whitespace_the_same() -> None:
    text = "token=abc sk-live-0123456789abcdef Bearer x.y password:  pw " * 40_000
    assert REDACT.in_pieces(text) == REDACT(text)
    assert "abc" not in REDACT.in_pieces(text) and "sk-live" not in REDACT.in_pieces(text)


def test_a_text_without_any_cut_point_is_redacted_whole() -> None:
    text = "token=" + "x" * 600_000
    assert REDACT.in_pieces(text) == "token=[REDACTED]"


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


@pytest.mark.parametrize(
    "credential",
    [
        "Bearer  abc123",
        "basic \tdXNlcjpwYXNzd29yZA==",
        "token  = abc123",
        "x-api-key \n: abc123",
        "secret   : abc",
        "password  = abc",
        "passwd\n\n= abc",
    ],
)
def test_no_piece_is_cut_between_a_credential_s_name_and_its_value(credential: str) -> None:
    # The first place to cut after a piece's length is right after the name.
    text = "y" * (Redactor._PIECE - 1) + " " + credential + " end" * 10

    assert REDACT.in_pieces(text) == REDACT(text)
    assert "abc" not in REDACT.in_pieces(text) and "dXNl" not in REDACT.in_pieces(text)
