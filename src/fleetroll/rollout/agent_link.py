"""One rollout of an agent of its own, as its gateway sees it (``--agent-command``).

:class:`AgentLink` is the :class:`fleetroll.policies.gateway.Link` of a
rollout whose agent is a command (:mod:`fleetroll.rollout.agent_command`): the
agent's policy calls and its MCP traffic both pass through it, so the rollout
ends as the built-in loop's would on the same faults:

- a policy call is forwarded to the policy servers once the trainer's gate
  admits it, holding one of the rollout's steps while it runs (concurrent calls
  count: past ``max_steps`` a call is refused and the rollout ends as
  ``max_steps``); its turn is recorded only once the agent received the answer;
  a policy failure (the server's error, its deadline) ends the rollout as
  ``policy_error``, whatever the agent does next; a streamed call is relayed
  chunk by chunk as the server streams it (:meth:`AgentLink.stream`; whole
  where the policy's settings need whole answers), recorded from its chunks
  joined, and a failure once its chunks flow reaches the agent as its
  dialect's error event before the rollout ends; a prompt longer than the
  model's context (the server's context-length error, which the agent still
  gets, or an estimate over ``policy.max_context_tokens`` before the call, as
  the built-in loop's) ends it as ``context_overflow``, scored;
- the agent's MCP requests go through the rollout's relay, which forwards each
  to the instance's endpoint (streaming) and knows which are in flight: a
  ``tools/call`` has ``timeouts.call_tool_s`` (other requests
  ``timeouts.list_tools_s``) and one that gets no answer is a tool failure as
  the built-in loop's (``tool_failure``, ``instance_lost``, or an error the
  agent sees with ``pool.on_tool_failure = "continue"``); the rollout's deadline
  passing while a request waits on the instance is ``platform_timeout``; each
  ``tools/call`` answered or failed is one ``fleet_tool_call`` record, as the
  built-in loop's (its seconds until its answer, ``ok``, ``error`` or
  ``failed``), carrying the rollout's event attributes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.types import Message, Receive, Scope, Send

from fleetroll._internal.deadlines import now
from fleetroll.errors import ContextOverflowError, PolicyError, ToolCallFailed
from fleetroll.policies.gate import gate_of_rollout
from fleetroll.policies.gateway import GatewayRefusal
from fleetroll.policies.openai import OpenAIChatPolicy, Streamed
from fleetroll.policies.servers import Affinity
from fleetroll.policies.turns import AssistantTurn, TokenTurn
from fleetroll.results import FailureReason
from fleetroll.rollout.dispatch import record_tool_call, tool_call_failed
from fleetroll.rollout.machine import Rollout
from fleetroll.rollout.transcript import CHARS_PER_TOKEN, _text_chars
from fleetroll.telemetry.events import Events
from fleetroll.tools.session import describe

__all__ = ["AgentLink"]

#: Headers not passed on by the relay: hop-by-hop ones, those of the agent's own
#: connection, and its key for the gateway (not the instance's business).
_DROPPED = frozenset(
    {
        b"host",
        b"connection",
        b"keep-alive",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"accept-encoding",
        b"authorization",
    }
)
#: Closing a relayed answer's stream: bounded, shielded. Not a setting: closing
#: a response does no I/O worth waiting for longer.
_CLOSE_S = 5.0
#: A JSON-RPC error code for a request the relay answered itself (JSON-RPC's
#: "server error" range).
_RELAY_ERROR = -32000


@dataclass
class _Pending:
    """An answer on its way to the agent (:class:`fleetroll.policies.gateway.Pending`)."""

    answer: dict[str, Any]
    got: bool = False

    def received(self) -> None:
        self.got = True


@dataclass(frozen=True, slots=True)
class _LastCall:
    """An agent's last recorded call, which its next may continue (token-in)."""

    messages: list[Any]
    #: The message the agent was answered.
    answer: dict[str, Any]
    ids: TokenTurn


def _same_answer(message: Any, answer: dict[str, Any]) -> bool:
    """Whether ``message`` is the assistant message ``answer`` as the agent sends
    it back: the same text (none and empty alike) and the same tool calls (ids,
    names, arguments as JSON values); other fields (an SDK's ``refusal``) aside."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return False
    if (message.get("content") or None) != (answer.get("content") or None):
        return False

    def calls(m: dict[str, Any]) -> list[tuple[Any, Any, Any]] | None:
        out = []
        for call in m.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                return None
            arguments = function.get("arguments")
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except ValueError:
                parsed = arguments
            out.append((call.get("id"), function.get("name"), parsed))
        return out

    mine = calls(message)
    return mine is not None and mine == calls(answer)


class _Stream:
    """A streamed answer on its way to the agent
    (:class:`fleetroll.policies.gateway.Streaming`): the policy's chunks, or a
    whole answer (``whole``, with the :class:`_Pending` that records it)."""

    def __init__(
        self,
        whole: dict[str, Any] | None,
        pending: _Pending | None,
        streamed: Streamed | None = None,
    ) -> None:
        self.whole = whole
        self._pending = pending
        self._streamed = streamed
        self.got = False
        #: Why the stream failed once it flowed: the rollout ends (``policy_error``)
        #: when the block does, after the agent got the error event.
        self.failed: str | None = None

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        if self._streamed is None or self.whole is not None:
            return
        try:
            async for chunk in self._streamed.chunks():
                yield chunk
        except PolicyError as exc:
            self.failed = str(exc)
            raise GatewayRefusal(502, str(exc), kind="api_error") from None

    def answer(self) -> dict[str, Any]:
        if self.whole is not None:
            return self.whole
        assert self._streamed is not None
        try:
            return self._streamed.result()[0]
        except PolicyError as exc:
            self.failed = str(exc)
            raise GatewayRefusal(502, str(exc), kind="api_error") from None

    def received(self) -> None:
        self.got = True
        if self._pending is not None:
            self._pending.received()


@dataclass
class _Exchange:
    """One MCP request relayed: the JSON-RPC requests it holds, and what came back."""

    ids: set[Any]
    #: ``tools/call`` requests by id: the tool's name.
    tools: dict[Any, str]
    answered: set[Any] = field(default_factory=set)
    errors: int = 0
    #: When the request was sent (``time.monotonic()``).
    began: float = 0.0
    #: ``tools/call`` requests by id: seconds until their answer (or their
    #: failure) and the ``fleet_tool_call`` outcome, ``ok``, ``error`` or ``failed``.
    outcomes: dict[Any, tuple[float, str]] = field(default_factory=dict)
    _buffer: bytes = b""

    @property
    def complete(self) -> bool:
        return bool(self.ids) and self.ids <= self.answered

    def message(self, data: bytes) -> None:
        """A JSON-RPC message the server sent (a response to one of ours, or not)."""
        try:
            parsed = json.loads(data)
        except ValueError:
            return
        for message in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(message, dict) or (
                "result" not in message and "error" not in message
            ):
                continue
            key = message.get("id")
            if isinstance(key, str | int) and key in self.ids and key not in self.answered:
                self.answered.add(key)
                if key not in self.tools:
                    continue
                result = message.get("result")
                failed = isinstance(result, dict) and bool(result.get("isError"))
                self.errors += failed
                outcome = "error" if failed or "error" in message else "ok"
                self.outcomes[key] = (time.monotonic() - self.began, outcome)

    def unanswered_failed(self) -> list[str]:
        """Mark the ``tools/call`` requests without an answer ``failed``; their tools."""
        took = time.monotonic() - self.began
        failed = [key for key in self.tools if key not in self.answered]
        for key in failed:
            self.outcomes[key] = (took, "failed")
        return [self.tools[key] for key in failed]

    def sse(self, chunk: bytes) -> None:
        """Server-Sent Events as they arrive: each event's data is a message."""
        self._buffer += chunk.replace(b"\r\n", b"\n")
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            data = [
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            ]
            if data:
                self.message(b"\n".join(data))


class AgentLink:
    """One rollout, as its gateway sees it (see the module's docstring).

    Args:
        rollout: the rollout its agent acts for.
        policy: where its policy calls go.
        affinity: the rollout's policy server affinity.
        mcp_url: the instance's MCP endpoint, where the relay forwards to.
        max_request_bytes: the largest MCP request body relayed (HTTP 413 past it).
    """

    def __init__(
        self,
        rollout: Rollout,
        policy: OpenAIChatPolicy,
        affinity: Affinity | None,
        *,
        mcp_url: str,
        max_request_bytes: int,
    ) -> None:
        self.rollout = rollout
        self.policy = policy
        self.model = policy.model
        self.affinity = affinity
        self.mcp_url = mcp_url
        self.max_request_bytes = max_request_bytes
        #: Set once the rollout's acting phase is over: calls are refused.
        self.ended = anyio.Event()
        #: Policy calls forwarded and not yet settled: each holds a step.
        self._reserved = 0
        #: What runs for the agent (its calls, its relayed requests): :meth:`end` cancels it.
        self._scopes: set[anyio.CancelScope] = set()
        #: The relayed requests waiting on the instance: what, and since when (``now()``).
        self._waits: dict[int, tuple[str, float]] = {}
        #: The rollout's event attributes (this link's requests are served in the
        #: gateway's tasks, outside the rollout's context).
        self._bound = Events.bound()
        #: The prompt+completion tokens of the last recorded call, as the server
        #: counted them (``policy.max_context_tokens``); None before any count.
        self._context_tokens: int | None = None
        #: The last recorded call (``policy.token_in``): its messages, the
        #: message it answered, and its ids; None before one with ids.
        self._last: _LastCall | None = None

    def end(self) -> None:
        """The acting phase is over: refuse calls from now on, and cancel those in flight.

        A request still waiting on the instance when the rollout's deadline had
        passed makes it ``platform_timeout``, as a tool call of the built-in
        loop does (:meth:`fleetroll.rollout.progress.Progress.platform_wait`),
        judged here because the request's own task ends later.
        """
        progress = self.rollout.progress
        deadline, at = progress.deadline, now()
        for what, began in self._waits.values():
            if progress.overrun is None and began < deadline <= at:
                progress.overrun = (what, deadline - began)
        self.ended.set()
        for scope in self._scopes:
            scope.cancel()

    def _refuse_if_ended(self) -> None:
        if self.ended.is_set() or self.rollout.finished:
            raise GatewayRefusal(409, "this rollout has ended: no more policy calls")

    # -- policy calls -------------------------------------------------------

    def _check_call(self, body: dict[str, Any]) -> None:
        """Refuse a call past the step budget or the context (ending the rollout)."""
        rollout = self.rollout
        self._refuse_if_ended()
        limit = rollout.max_steps
        if rollout.progress.steps + self._reserved >= limit:
            # Calls in flight hold their steps: concurrent calls cannot pass the budget.
            rollout.fail(FailureReason.MAX_STEPS, f"the step budget of {limit} ran out")
            self.end()
            raise GatewayRefusal(409, f"the step budget of {limit} ran out")
        max_context = rollout.engine.config.policy.max_context_tokens
        if max_context is not None:
            estimate = self._context_estimate(body["messages"])
            if estimate > max_context:
                error = (
                    f"the next prompt would hold about {estimate} tokens, over"
                    f" policy.max_context_tokens = {max_context}"
                )
                self._overflowed(error)
                raise GatewayRefusal(400, error)

    def _recorded(
        self, body: dict[str, Any], turns: Sequence[Any], version: int, latency: float
    ) -> None:
        """Record a call the agent received (its first choice's turn, then the others)."""
        observed = _after_last_assistant(body["messages"])
        self.rollout.record_call(
            turns[0],
            policy_version=version,
            latency_s=latency,
            observations=observed,
            others=turns[1:],
        )
        usage = turns[0].usage
        if usage is not None and "prompt_tokens" in usage:
            self._context_tokens = usage["prompt_tokens"] + usage.get("completion_tokens", 0)

    @asynccontextmanager
    async def stream(self, body: dict[str, Any]) -> AsyncIterator[_Stream]:
        """A streamed call (:meth:`fleetroll.policies.gateway.Link.stream`): the
        server's chunks relayed as they come when the policy streams tokens
        (:attr:`~fleetroll.policies.openai.OpenAIChatPolicy.streams_tokens`),
        else :meth:`complete`'s whole answer. Recorded as :meth:`complete`
        records; a failure once the chunks flow ends the rollout as
        ``policy_error`` and the agent's stream with an error event."""
        if not self.policy.streams_tokens:
            async with self.complete(body) as pending:
                yield _Stream(pending.answer, pending)
            return
        rollout = self.rollout
        self._check_call(body)
        self._reserved += 1
        began: float | None = None
        flowing = False
        try:
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    version = await rollout.admit_policy_call()
                    self._refuse_if_ended()
                    began = time.monotonic()
                    async with self.policy.stream(body, affinity=self.affinity) as streamed:
                        self._refuse_if_ended()  # it ended while the server began
                        relayed = _Stream(streamed.whole, None, streamed)
                        flowing = True
                        yield relayed
                    if relayed.failed is not None:  # the agent got its error event first
                        self._policy_failed(relayed.failed)
                    elif relayed.got and not self.ended.is_set():
                        _, turns = streamed.result()
                        self._recorded(body, turns, version, time.monotonic() - began)
                except ContextOverflowError as exc:
                    self._overflowed(str(exc))
                    if not flowing:
                        raise GatewayRefusal(400, str(exc)) from None
                except PolicyError as exc:
                    self._policy_failed(str(exc))
                    if not flowing:
                        raise GatewayRefusal(502, str(exc), kind="api_error") from None
                finally:
                    self._scopes.discard(scope)
                    if began is not None:
                        rollout.progress.timings.policy_s += time.monotonic() - began
            if scope.cancelled_caught and not flowing:
                raise GatewayRefusal(409, "this rollout has ended: no more policy calls")
        finally:
            self._reserved -= 1

    @asynccontextmanager
    async def complete(self, body: dict[str, Any]) -> AsyncIterator[_Pending]:
        self._check_call(body)
        self._reserved += 1
        try:
            with anyio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    answer, turns, version, latency = await self._forward(
                        body, self._continued(body["messages"])
                    )
                finally:
                    self._scopes.discard(scope)
            if scope.cancelled_caught:
                raise GatewayRefusal(409, "this rollout has ended: no more policy calls")
            self._refuse_if_ended()  # it ended while the server answered: not its turn
            pending = _Pending(answer)
            yield pending
            if pending.got and not self.ended.is_set():
                self._recorded(body, turns, version, latency)
                self._remember(body["messages"], answer, turns[0])
        finally:
            self._reserved -= 1

    def _remember(self, messages: list[Any], answer: dict[str, Any], turn: AssistantTurn) -> None:
        """Keep the call just recorded for token-in: its messages, the message
        the agent was answered (the first choice's) and its ids."""
        data = turn.data
        choices = answer.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices else None
        if (
            data is None
            or data.prompt_token_ids is None
            or data.completion_token_ids is None
            or not isinstance(message, dict)
        ):
            self._last = None
            return
        ids = TokenTurn(
            len(messages), data.prompt_token_ids, data.completion_token_ids, data.finish_reason
        )
        self._last = _LastCall(list(messages), message, ids)

    def _continued(self, messages: list[Any]) -> TokenTurn | None:
        """The last call's ids when ``messages`` continue it (``policy.token_in``):
        its messages as they were, then the answer it got, then more; else None
        (an agent that rewrote or dropped its history goes as messages)."""
        last = self._last
        if last is None or self.policy.token_in is not True:
            return None
        end = len(last.messages)
        if len(messages) <= end + 1 or messages[:end] != last.messages:
            return None
        return last.ids if _same_answer(messages[end], last.answer) else None

    async def _forward(
        self, body: dict[str, Any], history: TokenTurn | None
    ) -> tuple[dict[str, Any], Any, int, float]:
        rollout = self.rollout
        version = await rollout.admit_policy_call()
        self._refuse_if_ended()
        began = time.monotonic()
        try:
            # The rollout's gate, as its built-in loop's calls see it: an aborted
            # answer (policy.weight_update = "abort") resumes once the update ends.
            with gate_of_rollout(rollout.engine.policy_gate):
                answer, turns = await self.policy.forward(
                    body, affinity=self.affinity, history=history
                )
        except ContextOverflowError as exc:
            self._overflowed(str(exc))
            raise GatewayRefusal(400, str(exc)) from None  # the server's answer, as it said it
        except PolicyError as exc:
            self._policy_failed(str(exc))
            raise GatewayRefusal(502, str(exc), kind="api_error") from None
        except Exception as exc:  # the policy is an adapter: its bugs are its failures
            self._policy_failed(f"the policy raised {describe(exc)}")
            raise GatewayRefusal(502, "the policy failed", kind="api_error") from None
        finally:
            latency = time.monotonic() - began
            rollout.progress.timings.policy_s += latency
        return answer, turns, version, latency

    def _policy_failed(self, error: str) -> None:
        """The built-in loop's end on a failed policy call: ``policy_error``, not scored
        (the agent's next move, an exit or a retry, changes nothing)."""
        if not self.ended.is_set():
            self.rollout.fail(FailureReason.POLICY_ERROR, error)
            self.end()

    def _overflowed(self, error: str) -> None:
        """The built-in loop's end on a prompt too long for the model's context:
        ``context_overflow``, scored (the agent's next move changes nothing)."""
        if not self.ended.is_set():
            self.rollout.fail(FailureReason.CONTEXT_OVERFLOW, error)
            self.end()

    def _context_estimate(self, messages: Sequence[Any]) -> int:
        """About how many tokens the prompt of ``messages`` holds, as the built-in
        loop estimates its next prompt: the server's count of the last recorded
        call's prompt and completion, plus the text the agent added after its last
        assistant message (images not counted). Without a count (the first call, a
        server that sends no usage) or an assistant message (a history the agent
        started over), all of the request's text."""
        base = self._context_tokens
        has_assistant = any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
        if base is not None and has_assistant:
            added = _after_last_assistant(messages)
        else:
            base, added = 0, [m for m in messages if isinstance(m, dict)]
        chars = sum(_text_chars(m) for m in added)
        return base + -(-chars // CHARS_PER_TOKEN)

    # -- the MCP relay ------------------------------------------------------

    async def relay(
        self, scope: Scope, receive: Receive, send: Send, http: httpx.AsyncClient
    ) -> None:
        """Forward one of the agent's MCP requests to the instance, streaming the answer.

        The agent's disconnect, or the rollout's end, cancels it.
        """
        method: str = scope["method"]
        try:
            body = await _read_body(receive, self.max_request_bytes)
        except GatewayRefusal as exc:
            await _refuse(send, exc.status, exc.message)
            return
        if self.ended.is_set() or self.rollout.finished:
            await _refuse(send, 409, "this rollout has ended: its MCP relay is closed")
            return
        exchange = _requests(body) if method == "POST" else _Exchange(set(), {})
        t = self.rollout.engine.config.timeouts
        limit: float | None = t.call_tool_s if exchange.tools else t.list_tools_s
        if method == "GET":
            what, limit = None, None  # the server's own stream: as long as the rollout acts
        elif exchange.tools:
            what = "the tool call " + ", ".join(sorted(set(exchange.tools.values())))
        else:
            what = "the agent's MCP request"
        self.rollout.progress.cost.tool_calls += len(exchange.tools)
        query = scope.get("query_string", b"").decode("latin-1")
        url = (
            self.mcp_url
            if not query
            else f"{self.mcp_url}{'&' if '?' in self.mcp_url else '?'}{query}"
        )
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROPPED]
        headers.append((b"accept-encoding", b"identity"))  # relayed as sent, parsed as it comes
        request = http.build_request(method, url, headers=headers, content=body)
        started: list[bool] = []

        async def forward() -> None:
            exchange.began = time.monotonic()
            upstream = await http.send(request, stream=True)
            try:
                sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
                kept = [(k, v) for k, v in upstream.headers.raw if k.lower() not in _DROPPED]
                await send(
                    {"type": "http.response.start", "status": upstream.status_code, "headers": kept}
                )
                started.append(True)
                collected = b""
                async for chunk in upstream.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if sse:
                        exchange.sse(chunk)
                        if exchange.complete:
                            break  # answered: a stream kept open after it is not waited on
                    elif len(collected) < self.max_request_bytes:
                        collected += chunk
                if not sse:
                    exchange.message(collected)
                await send({"type": "http.response.body", "body": b""})
            finally:
                with anyio.move_on_after(_CLOSE_S, shield=True):
                    await upstream.aclose()

        key = id(exchange)
        with anyio.CancelScope() as cancel, Events.bind(**self._bound):
            self._scopes.add(cancel)
            if what is not None:
                self._waits[key] = (what, now())
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        while (await receive())["type"] != "http.disconnect":
                            pass
                        tg.cancel_scope.cancel()  # the agent left: so does its request

                    tg.start_soon(watch)
                    wait = self.rollout.progress.platform_wait(what) if what else nullcontext()
                    with wait:
                        await self._exchange(forward, exchange, limit, send, started)
                    tg.cancel_scope.cancel()
            finally:
                self._scopes.discard(cancel)
                self._waits.pop(key, None)
                # Each call answered or failed, as the built-in loop's; one cut short
                # by the agent leaving or the rollout ending has no outcome.
                events = self.rollout.engine.events
                for call, (took, outcome) in exchange.outcomes.items():
                    record_tool_call(events, exchange.tools[call], took, outcome)
        self.rollout.progress.tool_errors += exchange.errors
        if cancel.cancelled_caught and not started:  # the rollout ended first
            await _refuse(send, 409, "this rollout has ended: its MCP relay is closed")

    async def _exchange(
        self,
        forward: Callable[[], Awaitable[None]],
        exchange: _Exchange,
        limit: float | None,
        send: Send,
        started: list[bool],
    ) -> None:
        """Run ``forward`` within ``limit``; no answer is the platform's failure."""
        try:
            with anyio.fail_after(limit) if limit is not None else nullcontext():
                await forward()
            return
        except TimeoutError:
            kind = "call_tool_s" if exchange.tools else "list_tools_s"
            error = f"no answer within timeouts.{kind} = {limit:g} s"
        except (httpx.HTTPError, OSError) as exc:
            error = f"the MCP endpoint could not be reached: {describe(exc)}"
        rollout = self.rollout
        instance = rollout.instance
        config = rollout.engine.config
        for name in exchange.unanswered_failed():
            assert instance is not None, "acting, so provisioned"
            # Recorded even if the agent leaves meanwhile; is_alive is one request.
            with anyio.move_on_after(config.timeouts.release_s, shield=True):
                await tool_call_failed(
                    name,
                    ToolCallFailed(error, operation="call_tool"),
                    progress=rollout.progress,
                    provider=rollout.engine.provider,
                    events=rollout.engine.events,
                    stop_on_failure=config.pool.on_tool_failure == "fail",
                    instance=instance,
                )
        if rollout.progress.reason is not None:
            self.end()  # the rollout ended (tool_failure, instance_lost): so does its agent
        if started:
            return  # the answer had begun: it ends here, cut short
        unanswered = sorted(exchange.ids - exchange.answered, key=str)
        if unanswered:
            answer: Any = [
                {"jsonrpc": "2.0", "id": i, "error": {"code": _RELAY_ERROR, "message": error}}
                for i in unanswered
            ]
            await _send_json(send, 200, answer[0] if len(answer) == 1 else answer)
        else:
            await _refuse(send, 504 if "timeouts" in error else 502, error)


def _requests(body: bytes) -> _Exchange:
    """The JSON-RPC requests of an MCP POST (notifications and responses have no answer)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return _Exchange(set(), {})
    ids: set[Any] = set()
    tools: dict[Any, str] = {}
    for message in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(message, dict) or "method" not in message or "id" not in message:
            continue
        key = message["id"]
        if not isinstance(key, str | int):
            continue
        ids.add(key)
        params = message.get("params")
        if message["method"] == "tools/call" and isinstance(params, dict):
            tools[key] = str(params.get("name"))
    return _Exchange(ids, tools)


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayRefusal(400, "the agent left before its request was read")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayRefusal(
                413, f"the request is over policy.agent_max_request_bytes ({limit} bytes)"
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_json(send: Send, status: int, body: Any) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _refuse(send: Send, status: int, message: str) -> None:
    await _send_json(
        send, status, {"error": {"message": message, "type": "relay_error", "code": status}}
    )


def _after_last_assistant(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages of a request after its last assistant message: what the agent
    observed since its previous call (its tool answers). Empty without one."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "assistant":
            return [m for m in messages[index + 1 :] if isinstance(m, dict)]
    return []
