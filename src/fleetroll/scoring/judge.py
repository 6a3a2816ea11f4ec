"""A rubric scored by a model: the judge of a task's ``rewards`` (kind ``judge``).

The judge is any OpenAI-compatible ``/chat/completions`` endpoint
(``judge.base_url``, ``judge.model``, key from ``FLEETROLL_JUDGE_API_KEY``).
Each judgement is one chat completion of two messages:

* system: :data:`SYSTEM_PROMPT`, asking for one JSON object
  ``{"score": S, "reason": "..."}`` with S a number from 0 to 1;
* user: the task's prompt, the rubric and the judged text (the final answer,
  the last assistant message, or the transcript rendered as text), under
  ``# Task``, ``# Rubric`` and ``# The agent's ...`` headings; a text over
  ``judge.max_input_chars`` keeps its start and end with a marker between.

The answer's content is read as JSON (inside a Markdown code fence too, or
the first ``{...}`` in it): ``score`` must be a number in [0, 1], else the
judgement fails (:class:`~fleetroll.errors.JudgeError`, not retried: the
reward is null, never 0). Calls run under ``judge.timeout_s`` (retries
included), are retried per the one retry table
(:func:`fleetroll._internal.retrying.attempts`, operation ``"judge"``), at most
``judge.max_concurrent`` at once, and cached by content: the sha256 of the
model, the messages and the sampling parameters maps to the score, in
memory, the least recently used forgotten past ``judge.cache_entries``. The
same question asked while it is in flight waits for that answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Self

import anyio
import httpx
from pydantic import SecretStr

import fleetroll._internal.retrying as retrying
from fleetroll._internal.excerpts import error_excerpt, shorten
from fleetroll._internal.retrying import retry_after_s, transient_status
from fleetroll.errors import JudgeError
from fleetroll.settings import JudgeSettings
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.rewards import Target

__all__ = [
    "SYSTEM_PROMPT",
    "Judge",
    "JudgeConfig",
    "Judgement",
    "judge_messages",
    "missing_judge",
    "parse_score",
]

SYSTEM_PROMPT: Final = (
    "You grade the work of an AI agent against a rubric. Read the task, the rubric and"
    " the agent's text, then answer with one JSON object and nothing else:"
    ' {"score": S, "reason": "one sentence"}, where S is a number from 0 (does not meet'
    " the rubric at all) to 1 (fully meets it)."
)
_HEADINGS: Final[Mapping[str, str]] = {
    "final_answer": "The agent's final answer",
    "last_message": "The agent's last message",
    "transcript": "The conversation",
}
_FENCE = re.compile(r"^```[A-Za-z]*\s*(.*?)\s*```$", re.DOTALL)
_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """The judge's endpoint and bounds (``[judge]``, ``[retries]`` judge_*)."""

    base_url: str | None
    model: str
    api_key: SecretStr | None = field(default=None, repr=False)
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_tokens: int = 256
    temperature: float | None = 0.0
    max_concurrent: int = 16
    cache_entries: int = 10_000
    max_input_chars: int = 100_000
    max_answer_bytes: int = 1024 * 1024
    budget: retrying.Budget = field(default_factory=lambda: retrying.Budget(3, 0.5, 10.0))

    @classmethod
    def from_section(
        cls, j: JudgeSettings, *, api_key: SecretStr | None, budget: retrying.Budget
    ) -> Self:
        """The judge that ``[judge]`` describes, with its key (``judge_api_key``)
        and its retry budget (``RetrySettings.judge_budget``)."""
        return cls(
            base_url=j.base_url,
            model=j.model,
            api_key=api_key,
            timeout_s=j.timeout_s,
            connect_timeout_s=j.connect_timeout_s,
            max_tokens=j.max_tokens,
            temperature=j.temperature,
            max_concurrent=j.max_concurrent,
            cache_entries=j.cache_entries,
            max_input_chars=j.max_input_chars,
            max_answer_bytes=j.max_answer_bytes,
            budget=budget,
        )


@dataclass(frozen=True, slots=True)
class Judgement:
    """A score in [0, 1], why, and what it cost (nothing when from the cache)."""

    score: float
    reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False


def missing_judge(tasks: Iterable[TaskSpec], judge: JudgeSettings) -> str | None:
    """Why ``tasks`` cannot be scored here: one has a judge component and
    ``judge.base_url`` is not set (a line for people); None when they can."""
    if judge.base_url:
        return None
    judged = next((task for task in tasks if task.judged), None)
    if judged is None:
        return None
    return (
        f"task {judged.key!r} has a judge reward component but judge.base_url is not set"
        " (see docs/configuration.md, [judge])"
    )


def judge_messages(
    rubric: str, prompt: str, text: str, on: Target, *, max_chars: int
) -> list[dict[str, str]]:
    """The chat messages of one judgement (see the module's docstring)."""
    user = (
        f"# Task\n\n{prompt}\n\n# Rubric\n\n{rubric}\n\n"
        f"# {_HEADINGS[on]}\n\n{_clip(text, max_chars)}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[… {len(text) - limit} characters cut …]\n{text[-tail:]}"


def parse_score(content: str) -> tuple[float, str]:
    """The score and reason of a judge's answer.

    Raises:
        ValueError: no JSON object with a ``score`` that is a number in [0, 1].
    """
    text = content.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        value = json.loads(text)
    except ValueError:
        found = _OBJECT.search(text)
        if found is None:
            raise ValueError("no JSON object in it") from None
        try:
            value = json.loads(found.group(0))
        except ValueError:
            raise ValueError("no JSON object in it") from None
    if not isinstance(value, dict) or "score" not in value:
        raise ValueError("no 'score' in it")
    score = value["score"]
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        raise ValueError(f"'score' is not a number: {score!r}"[:200])
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"'score' is {score}, outside [0, 1]")
    reason = value.get("reason")
    return float(score), "" if reason is None else str(reason)


class Judge:
    """Asks the judge endpoint for scores; shared by every rollout of a process.

    Use it as an async context manager, or call :meth:`aclose` when done.

    Attributes:
        calls: chat completions the judge answered (with a score or not); error
            statuses, timeouts and cache hits are not counted.
    """

    def __init__(self, config: JudgeConfig, *, http_client: httpx.AsyncClient | None = None):
        self.config = config
        self.calls = 0
        self._client = http_client
        self._owns_client = http_client is None
        self._limiter = anyio.CapacityLimiter(config.max_concurrent)
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._pending: dict[str, anyio.Event] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client, if the judge made it."""
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    @property
    def url(self) -> str:
        """The chat completions endpoint, as called."""
        base = (self.config.base_url or "").rstrip("/")
        return f"{base}/chat/completions"

    @property
    def shown_url(self) -> str:
        """:attr:`url` as errors show it: without a user or password in it."""
        try:
            parsed = httpx.URL(self.url)
        except (httpx.InvalidURL, TypeError):
            return "(the judge's URL, which is not valid)"
        return str(parsed.copy_with(userinfo=b"")) if parsed.userinfo else self.url

    async def judge(self, rubric: str, prompt: str, text: str, on: Target) -> Judgement:
        """Score ``text`` against ``rubric`` (for the task whose prompt is ``prompt``).

        Raises:
            JudgeError: no judge is configured, it did not answer within
                ``judge.timeout_s`` (retries included), it answered an error
                status, or its answer holds no score in [0, 1].
        """
        c = self.config
        if not c.base_url:
            raise JudgeError(
                "no judge is configured: set judge.base_url (and FLEETROLL_JUDGE_API_KEY"
                " if the endpoint needs a key)",
                transient=False,
            )
        messages = judge_messages(rubric, prompt, text, on, max_chars=c.max_input_chars)
        body: dict[str, Any] = {"model": c.model, "messages": messages, "max_tokens": c.max_tokens}
        if c.temperature is not None:
            body["temperature"] = c.temperature
        content = json.dumps(body, sort_keys=True, ensure_ascii=False).encode()
        key = hashlib.sha256(content).hexdigest()
        while True:
            hit = self._cached(key)
            if hit is not None:
                return hit
            pending = self._pending.get(key)
            if pending is None:
                break
            # The same question is in flight (bounded by its deadline): take its
            # answer, or ask ourselves if it failed.
            await pending.wait()
        self._pending[key] = done = anyio.Event()
        try:
            async with self._limiter:
                payload = await self._ask(content)
            self.calls += 1
            judgement = self._judgement(payload)
            if c.cache_entries:
                self._cache[key] = (judgement.score, judgement.reason)
                while len(self._cache) > c.cache_entries:
                    self._cache.popitem(last=False)
            return judgement
        finally:
            del self._pending[key]
            done.set()

    def _cached(self, key: str) -> Judgement | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        return Judgement(hit[0], hit[1], cached=True)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            c = self.config
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(c.timeout_s, connect=min(c.timeout_s, c.connect_timeout_s)),
                limits=httpx.Limits(max_connections=c.max_concurrent),
            )
        return self._client

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.config.api_key is not None:
            headers["Authorization"] = f"Bearer {self.config.api_key.get_secret_value()}"
        return headers

    async def _ask(self, content: bytes) -> Any:
        """POST until an answer, a permanent failure, or no attempts or time left."""
        c = self.config
        url = self.shown_url
        tries = 0
        try:
            with anyio.fail_after(c.timeout_s) as scope:
                async for attempt in retrying.attempts("judge", c.budget, deadline=scope.deadline):
                    with attempt:
                        tries = attempt.num
                        body, status, headers = await self._post(content)
                        if not 200 <= status < 300:
                            raise JudgeError(
                                self._redact(
                                    f"{url} answered HTTP {status}: {error_excerpt(body)}"
                                ),
                                transient=transient_status(status),
                                status_code=status,
                                retry_after_s=retry_after_s(headers),
                            )
        except TimeoutError:
            raise JudgeError(
                f"no answer from {url} within judge.timeout_s ({c.timeout_s:g} s, retries"
                " included)",
                transient=True,
            ) from None
        except JudgeError as exc:
            if not exc.transient:
                raise
            raise JudgeError(
                f"{exc} (attempt {tries} of {c.budget.attempts})", transient=True
            ) from exc.__cause__
        try:
            return json.loads(body)
        except ValueError:
            raise JudgeError(
                self._redact(f"{url} answered a body that is not JSON: {error_excerpt(body)}"),
                transient=False,
            ) from None

    async def _post(self, content: bytes) -> tuple[bytes, int, httpx.Headers]:
        limit, url = self.config.max_answer_bytes, self.shown_url
        try:
            async with self._http().stream(
                "POST", self.url, content=content, headers=self._headers()
            ) as response:
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise JudgeError(
                            f"{url} answered over judge.max_answer_bytes ({limit} bytes)",
                            transient=False,
                        )
                    chunks.append(chunk)
                return b"".join(chunks), response.status_code, response.headers
        except httpx.TransportError as exc:
            raise JudgeError(
                self._redact(f"could not reach {url}: {type(exc).__name__}: {exc}"),
                transient=True,
            ) from exc
        except httpx.InvalidURL as exc:
            raise JudgeError(f"judge.base_url is not a valid URL: {exc}", transient=False) from exc

    def _judgement(self, payload: Any) -> Judgement:
        try:
            content = payload["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise JudgeError(
                f"{self.shown_url} answered something that is not a chat completion:"
                f" {shorten(json.dumps(payload, default=str))}",
                transient=False,
            ) from None
        try:
            score, reason = parse_score(content)
        except ValueError as exc:
            raise JudgeError(
                f'the judge\'s answer is not {{"score": 0..1}} ({exc}): {shorten(content)!r}',
                transient=False,
            ) from None
        usage = payload.get("usage") if isinstance(payload, dict) else None
        usage = usage if isinstance(usage, dict) else {}
        return Judgement(
            score,
            reason,
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
        )

    def _redact(self, text: str) -> str:
        key = self.config.api_key
        if key is not None and (secret := key.get_secret_value()):
            text = text.replace(secret, "***")
        return text


def _count(value: object) -> int:
    """A token count of a ``usage``; 0 for anything that is not a positive whole number."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
