"""A judge endpoint on loopback, for tests of composite rewards.

A :class:`~fleetroll.testing.fake_openai.FakeChatServer` (real HTTP) whose
answers read the judgement prompt of :mod:`fleetroll.scoring.judge` (its
``# Rubric`` and the judged text) and score it deterministically::

    async with FakeJudge() as judge:
        settings = load_settings(judge={"base_url": judge.base_url})
        ...
    assert judge.calls == 1

By default the score of a rubric and a text is :func:`toy_score` (a fixed
function of both, in [0, 1]); pass ``score=`` for another. Set :attr:`mode`
at any time: ``"score"`` (the default), ``"fail"`` (HTTP 503 to every call),
``"hang"`` (never answer until the server stops), ``"garbage"`` (a chat
completion whose text holds no score), ``"unauthorized"`` (HTTP 401 whose
message echoes the ``Authorization`` header it got, as careless proxies do).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, Self

from fleetroll.testing.fake_openai import HANG, FakeChatServer, FakeError, Reply, completion

__all__ = ["FakeJudge", "JudgeMode", "judged", "toy_score"]

JudgeMode = Literal["score", "fail", "hang", "garbage", "unauthorized"]
_RUBRIC = "# Rubric\n\n"


def toy_score(rubric: str, text: str) -> float:
    """A deterministic score in [0, 1] (two decimals) for a rubric and a text."""
    return zlib.crc32(f"{rubric}\0{text}".encode()) % 101 / 100


def judged(body: dict[str, Any]) -> tuple[str, str]:
    """The rubric and the judged text of a judgement request (its user message)."""
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    after = user.split(_RUBRIC, 1)[1]
    rubric, _, rest = after.partition("\n\n# ")
    text = rest.partition("\n\n")[2]
    return rubric, text


class FakeJudge:
    """A judge on loopback that scores deterministically, or fails, or hangs.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``, once started.
        mode: how it answers the next calls (see the module's docstring).
        server: the chat server underneath (its ``requests`` and ``headers``).
    """

    def __init__(
        self, *, score: Callable[[str, str], float] = toy_score, mode: JudgeMode = "score"
    ) -> None:
        self.mode: JudgeMode = mode
        self._score = score
        self.server = FakeChatServer(self._reply)

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def calls(self) -> int:
        """Requests received, in every mode."""
        return len(self.server.requests)

    def _reply(self, body: dict[str, Any]) -> Reply:
        if self.mode == "fail":
            return FakeError(503, "fake judge: down")
        if self.mode == "hang":
            return HANG
        if self.mode == "unauthorized":
            sent = self.server.headers[-1].get("authorization", "")
            return FakeError(401, f"fake judge: {sent!r} is not a valid key")
        if self.mode == "garbage":
            return completion("The answer looks fine to me.")
        rubric, text = judged(body)
        score = self._score(rubric, text)
        usage = {"prompt_tokens": len(text) // 4 + 50, "completion_tokens": 12}
        return completion(f'{{"score": {score}, "reason": "fake"}}', usage=usage)

    async def __aenter__(self) -> Self:
        await self.server.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.server.__aexit__(exc_type, exc, tb)
