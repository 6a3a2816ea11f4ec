"""A scripted OpenAI-compatible chat completions server on loopback, for tests.

It speaks just enough of ``POST /v1/chat/completions`` to test a policy or a
whole rollout loop against real HTTP::

    async with FakeChatServer(tool_calling_script([("get_balance", {"account": "x"})])) as srv:
        policy = OpenAIChatPolicy(base_url=srv.base_url, model="fake")
        ...
    assert srv.requests[0]["tools"]

A script is either a list of replies (the n-th request gets the n-th reply) or
a function of the request body returning a reply (sync or async). A reply is
one of:

- a ``dict``: a chat completion, sent with status 200 (build one with
  :func:`completion` and :func:`tool_call`);
- :class:`FakeError`: an error status, optionally with headers (Retry-After);
- :class:`FakeRawResponse`: any body, e.g. something that is not JSON;
- :data:`HANG`: never answer (until the server stops), for deadline tests.

With ``vllm=VllmShape(...)`` the server answers like vLLM: every completion
gets token ids from a toy tokenizer (:func:`toy_tokenize`; the prompt's at the
top level and the completion's on the choice, when the request says
``return_token_ids``), logprobs (and ``top_logprobs``) when asked, a usage
that counts those tokens, ``finish_reason`` and the requested model's name.
Knobs make it end completions with ``length``, refuse prompts over a context
length (HTTP 400, vLLM's message; :func:`context_length_error` for a script
to send it when it likes) or leave token ids out (an OpenAI-like server).
:attr:`FakeChatServer.replies` holds every completion it sent.

``VllmShape(drift=True)`` is a chat template that re-renders history: every
completion starts with a thinking token (:data:`THINK`) that the rendering of
earlier assistant messages leaves out, as templates that strip reasoning do.
``VllmShape(token_in=True)`` also serves the token-in routes of prime-rl's
vLLM server: ``POST /tokenize`` (vLLM's: ``messages``, ``tools``,
``add_generation_prompt`` → ``tokens``) and ``POST /v1/chat/completions/tokens``
(a chat completion whose prompt is the body's ``tokens``).
``VllmShape(stream=True)`` streams a request that says ``stream: true`` as vLLM
does (:func:`streamed_chunks`: a chunk per token, its id and logprob beside it);
:attr:`FakeChatServer.replies` holds the whole answer all the same.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any, Self, TypeAlias

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll._internal.serving import serve_asgi

__all__ = [
    "HANG",
    "THINK",
    "FakeChatServer",
    "FakeError",
    "FakeRawResponse",
    "Hang",
    "Reply",
    "Script",
    "VllmShape",
    "completion",
    "context_length_error",
    "streamed_chunks",
    "tool_call",
    "tool_calling_script",
    "toy_tokenize",
]

_STARTUP_TIMEOUT_S = 10.0
_SHUTDOWN_TIMEOUT_S = 5.0
_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class FakeError:
    """Answer with an error status and an OpenAI-style error body.

    Args:
        status: the HTTP status (429, 500, 400...).
        message: ``error.message`` of the body.
        headers: extra response headers, e.g. ``{"Retry-After": "1"}``.
    """

    status: int
    message: str = "fake error"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FakeRawResponse:
    """Answer with exactly this body (malformed JSON, HTML from a proxy...)."""

    body: str | bytes
    status: int = 200
    media_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hang:
    """Never answer; the request is left open until the server stops."""


#: The one :class:`Hang` reply.
HANG = Hang()


@dataclass(frozen=True, slots=True)
class VllmShape:
    """How a vLLM-shaped server answers (see the module's docstring).

    Args:
        token_ids: answer ``return_token_ids``; False is an OpenAI-like server
            that never returns token ids.
        logprobs: answer ``logprobs``/``top_logprobs``; False ignores them.
        finish_length: end every completion with ``finish_reason: "length"``,
            its text (or tool-call arguments) cut in half, as a model that ran
            out of ``max_tokens`` would.
        max_context: answer HTTP 400 (vLLM's message) when the prompt's tokens
            plus ``max_tokens`` pass this.
        usage: answer a ``usage``; False leaves it out.
        drift: a chat template that drops each completion's leading
            :data:`THINK` token when it renders the history.
        token_in: serve ``/tokenize`` and ``/v1/chat/completions/tokens``.
        stream: answer a request with ``stream: true`` as vLLM streams it
            (:func:`streamed_chunks`); otherwise it gets the whole answer as JSON,
            as a server that does not stream.
    """

    token_ids: bool = True
    logprobs: bool = True
    finish_length: bool = False
    max_context: int | None = None
    usage: bool = True
    drift: bool = False
    token_in: bool = False
    stream: bool = False


_TOKEN = re.compile(r"\w+|[^\w\s]")
#: The toy tokenizer's special tokens: message start and end, an image patch.
_START, _END, _IMAGE = 1, 2, 3
#: With ``VllmShape(drift=True)``: the token every completion starts with (its
#: thinking), which the template leaves out of the history.
THINK = 4
#: One image token per this many characters of a data URL.
_IMAGE_CHARS_PER_TOKEN = 1024


def toy_tokenize(text: str) -> list[int]:
    """Deterministic token ids for ``text``: one per word or punctuation mark."""
    return [zlib.crc32(token.encode()) % 32_000 + 100 for token in _TOKEN.findall(text)]


def _toy_logprob(token_id: int, rank: int = 0) -> float:
    """A deterministic logprob (exact in JSON) for a token and its ``rank``-th alternative."""
    return -((token_id % 997) / 1000) - rank


def _prompt_ids(body: Mapping[str, Any], *, generation_prompt: bool = True) -> list[int]:
    """The toy tokenization of a request: its tools, then each message, then the
    answer's start (unless ``generation_prompt`` is False)."""
    ids: list[int] = []
    if body.get("tools"):
        ids += toy_tokenize(json.dumps(body["tools"]))
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        ids += [_START, *toy_tokenize(str(message.get("role")))]
        content = message.get("content")
        if isinstance(content, str):
            ids += toy_tokenize(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict):
                    continue
                if part.get("type") == "image_url":
                    url = str((part.get("image_url") or {}).get("url", ""))
                    ids += [_IMAGE] * (len(url) // _IMAGE_CHARS_PER_TOKEN + 1)
                else:
                    ids += toy_tokenize(str(part.get("text", "")))
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            ids += toy_tokenize(f"{function.get('name')} {function.get('arguments')}")
        ids.append(_END)
    return [*ids, _START, *toy_tokenize("assistant")] if generation_prompt else ids


def context_length_error(max_context: int, prompt_tokens: int, max_tokens: int = 0) -> FakeError:
    """vLLM's answer to a prompt of ``prompt_tokens`` (asking for ``max_tokens``
    more) that does not fit a context of ``max_context`` tokens: HTTP 400."""
    return FakeError(
        400,
        f"This model's maximum context length is {max_context} tokens. However,"
        f" you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages,"
        f" {max_tokens} in the completion). Please reduce the length of the messages"
        " or completion.",
    )


def _vllm_answer(
    shape: VllmShape,
    body: Mapping[str, Any],
    reply: Mapping[str, Any],
    prompt: list[int] | None = None,
) -> Reply:
    """``reply`` as vLLM would send it for ``body`` (or its context-length error);
    ``prompt``: the prompt's ids when the request gave them (token-in)."""
    prompt = _prompt_ids(body) if prompt is None else prompt
    max_tokens = body.get("max_tokens") or 0
    if shape.max_context is not None and len(prompt) + max_tokens > shape.max_context:
        return context_length_error(shape.max_context, len(prompt), max_tokens)
    answer: dict[str, Any] = json.loads(json.dumps(reply))  # a deep copy we may change
    answer["model"] = body.get("model", answer.get("model"))
    wants_ids = shape.token_ids and body.get("return_token_ids") is True
    answer["prompt_token_ids"] = prompt if wants_ids else None
    completion_tokens = 0
    for choice in answer["choices"]:  # each choice its own ids (a reply with n > 1 choices)
        completion_tokens += _vllm_choice(shape, body, choice, wants_ids=wants_ids)
    if shape.usage:
        answer["usage"] = {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt) + completion_tokens,
        }
    else:
        answer.pop("usage", None)
    return answer


def _vllm_choice(
    shape: VllmShape, body: Mapping[str, Any], choice: dict[str, Any], *, wants_ids: bool
) -> int:
    """One choice of a reply as vLLM sends it (changed in place); its token count."""
    message = choice["message"]
    if shape.finish_length:
        choice["finish_reason"] = "length"
        if message.get("tool_calls"):
            function = message["tool_calls"][-1]["function"]
            function["arguments"] = function["arguments"][: len(function["arguments"]) // 2]
        elif isinstance(message.get("content"), str):
            message["content"] = message["content"][: len(message["content"]) // 2]
    words = [message["content"]] if isinstance(message.get("content"), str) else []
    for call in message.get("tool_calls") or ():
        words.append(f"{call['function']['name']} {call['function']['arguments']}")
    texts = _TOKEN.findall(" ".join(words))
    completion_ids = toy_tokenize(" ".join(words))
    if shape.drift:
        completion_ids.insert(0, THINK)
        texts.insert(0, "<think></think>")
    if choice["finish_reason"] != "length":
        completion_ids.append(_END)
        texts.append("<|im_end|>")
    choice["token_ids"] = completion_ids if wants_ids else None
    choice["logprobs"] = None
    if shape.logprobs and body.get("logprobs") is True:
        top = body.get("top_logprobs") or 0
        choice["logprobs"] = {
            "content": [
                {
                    "token": text,
                    "logprob": _toy_logprob(token_id),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": text if rank == 0 else f"{text}~{rank}",
                            "logprob": _toy_logprob(token_id, rank),
                            "bytes": None,
                        }
                        for rank in range(top)
                    ],
                }
                for token_id, text in zip(completion_ids, texts, strict=True)
            ]
        }
    return len(completion_ids)


Reply: TypeAlias = Mapping[str, Any] | FakeError | FakeRawResponse | Hang
Script: TypeAlias = Sequence[Reply] | Callable[[dict[str, Any]], Reply | Awaitable[Reply]]


def tool_call(
    name: str, arguments: Mapping[str, Any] | str = _EMPTY, *, id: str | None = None
) -> dict[str, Any]:
    """One entry of ``message.tool_calls``.

    ``arguments`` is sent JSON-encoded; pass a string to send it as it is
    (e.g. invalid JSON).
    """
    encoded = arguments if isinstance(arguments, str) else json.dumps(dict(arguments))
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": encoded}}
    if id is not None:
        call["id"] = id
    return call


def completion(
    content: str | None = None,
    tool_calls: Sequence[Mapping[str, Any]] = (),
    *,
    model: str = "fake-model",
    usage: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A chat completion body with one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [dict(call) for call in tool_calls]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if tool_calls else "stop",
            }
        ],
        "usage": dict(usage)
        if usage is not None
        else {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def tool_calling_script(
    calls: Sequence[tuple[str, Mapping[str, Any]]], *, final_answer: str = "done"
) -> Callable[[dict[str, Any]], Reply]:
    """A script that makes ``calls`` one per turn, then answers ``final_answer``.

    The turn is the number of assistant messages in the request, so the
    script is stateless and serves any number of concurrent conversations.
    Call ids are ``call_0``, ``call_1``...
    """
    steps = list(calls)

    def script(body: dict[str, Any]) -> Reply:
        messages = body.get("messages") or []
        turn = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
        if turn >= len(steps):
            return completion(final_answer)
        name, arguments = steps[turn]
        return completion(tool_calls=[tool_call(name, arguments, id=f"call_{turn}")])

    return script


class FakeChatServer:
    """An OpenAI-compatible chat completions server on loopback.

    Use it as an async context manager; ``script`` may also be set (or
    replaced) while it runs.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``, set once started.
        requests: the JSON body of every request received, in order.
        headers: the headers of every request received (lower-case names).
        script_errors: exceptions the script raised (each answered with 500).
        abandoned: the requests whose client left before their reply was ready.

    Raises:
        RuntimeError: the server could not start.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        host: str = "127.0.0.1",
        vllm: VllmShape | None = None,
    ) -> None:
        self.script = script
        self.vllm = vllm
        self.requests: list[dict[str, Any]] = []
        #: Every chat completion sent (status 200), in the order sent.
        self.replies: list[dict[str, Any]] = []
        #: The body of every ``/tokenize`` request (``VllmShape(token_in=True)``).
        self.tokenize_requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.script_errors: list[Exception] = []
        #: The numbers (from 0) of the requests whose client had left by the time
        #: their reply was ready (it gave up, or was cancelled).
        self.abandoned: list[int] = []
        self.base_url = ""
        self._host = host
        self._release_hung: anyio.Event | None = None
        self._stack = contextlib.AsyncExitStack()

    def reset(self, script: Script | None = None) -> None:
        """Start afresh with ``script``, to share one server between tests.

        The records are cleared and requests left hanging are answered (503).
        """
        self.script = script
        self.requests.clear()
        self.replies.clear()
        self.tokenize_requests.clear()
        self.headers.clear()
        self.script_errors.clear()
        self.abandoned.clear()
        if self._release_hung is not None:
            self._release_hung.set()
            self._release_hung = anyio.Event()

    async def __aenter__(self) -> Self:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self._running())
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await exit_transparently(self._stack, exc_type, exc, tb)

    @contextlib.asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions/tokens", self._chat_tokens, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
            ]
        )
        self._release_hung = anyio.Event()
        try:
            async with serve_asgi(
                app,
                host=self._host,
                lifespan="off",
                startup_timeout_s=_STARTUP_TIMEOUT_S,
                shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
            ) as url:
                self.base_url = f"{url}/v1"
                try:
                    yield
                finally:
                    self._release_hung.set()  # answer HANG requests, so shutdown is quick
        except OSError as exc:
            raise RuntimeError(f"the fake OpenAI server could not start: {exc}") from exc

    async def _models(self, request: Request) -> Response:
        """The model listing (``fleetroll run``'s pre-flight asks it); not a recorded request."""
        model = {"id": "served", "object": "model", "created": 0, "owned_by": "fleetroll"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize`` of a chat: the prompt's ids as the template renders them."""
        if self.vllm is None or not self.vllm.token_in:
            return _error(404, "Not Found")
        body = json.loads(await request.body())
        self.tokenize_requests.append(body)
        ids = _prompt_ids(body, generation_prompt=body.get("add_generation_prompt", True))
        return JSONResponse({"count": len(ids), "max_model_len": 32_768, "tokens": ids})

    async def _chat_tokens(self, request: Request) -> Response:
        """prime-rl's token-in chat completion: the prompt is the body's ``tokens``."""
        if self.vllm is None or not self.vllm.token_in:
            return _error(404, "Not Found")
        body = json.loads(await request.body() or b"null")
        if not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
            return _error(400, "fake OpenAI server: 'tokens' (a list of token ids) is required")
        return await self._chat(request)

    async def _chat(self, request: Request) -> Response:
        number = len(self.requests)
        self.headers.append(dict(request.headers))
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            self.requests.append({})
            return _error(400, f"fake OpenAI server: the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            self.requests.append({})
            return _error(400, "fake OpenAI server: the request body is not a JSON object")
        self.requests.append(body)
        try:
            reply = await self._reply(number, body)
        except Exception as exc:  # a bug in the test's script: report it, keep serving
            self.script_errors.append(exc)
            logging.getLogger(__name__).exception("the fake OpenAI server's script failed")
            return _error(500, f"fake OpenAI server: the script raised {exc!r}")
        if await request.is_disconnected():
            self.abandoned.append(number)  # answered all the same, to nobody
        if self.vllm is not None and isinstance(reply, Mapping):
            tokens = body.get("tokens") if request.url.path.endswith("/tokens") else None
            reply = _vllm_answer(self.vllm, body, reply, tokens)
        if isinstance(reply, Mapping):
            self.replies.append(dict(reply))
            if self.vllm is not None and self.vllm.stream and body.get("stream") is True:
                chunks = streamed_chunks(reply, body)
                data = [f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks]
                return StreamingResponse(
                    _each([*data, "data: [DONE]\n\n"]), media_type="text/event-stream"
                )
        return await self._respond(reply)

    async def _reply(self, number: int, body: dict[str, Any]) -> Reply:
        script = self.script
        if script is None:
            return FakeError(400, "fake OpenAI server: no script is set")
        if callable(script):
            reply = script(body)
            if inspect.isawaitable(reply):
                reply = await reply
            return reply
        if number >= len(script):
            return FakeError(
                400, f"fake OpenAI server: the script has no reply for request #{number + 1}"
            )
        return script[number]

    async def _respond(self, reply: Reply) -> Response:
        if isinstance(reply, Hang):
            assert self._release_hung is not None, "the server is running"
            await self._release_hung.wait()
            return _error(503, "fake OpenAI server: a hanging request was released")
        if isinstance(reply, FakeError):
            return _error(reply.status, reply.message, reply.headers)
        if isinstance(reply, FakeRawResponse):
            return Response(
                reply.body,
                status_code=reply.status,
                media_type=reply.media_type,
                headers=dict(reply.headers),
            )
        return JSONResponse(dict(reply))


async def _each(parts: Sequence[str]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part.encode()


_PIECE = re.compile(r"\s*\S+|\s+")


def streamed_chunks(answer: Mapping[str, Any], body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat completion as vLLM streams it (``chat.completion.chunk``): per choice,
    a first chunk with the role and the message's other fields (``reasoning_content``
    whole; the answer's own fields, ``prompt_token_ids`` among them, on the very
    first), then one chunk per token with its ``token_ids``, ``token_versions``
    and ``logprobs`` entry and a piece of the content (a word with the spaces
    before it), the tool calls' deltas (id and name, then the arguments in two
    pieces), a last with ``finish_reason``; a usage chunk when ``body`` asks."""
    base = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk",
        "created": answer.get("created", 0),
        "model": answer.get("model"),
    }
    own = {k: v for k, v in answer.items() if k not in (*base, "choices", "usage")}
    chunks: list[dict[str, Any]] = []
    for index, whole in enumerate(answer.get("choices") or ()):
        message = whole.get("message") or {}
        ids = whole.get("token_ids")
        versions = whole.get("token_versions")
        entries = (whole.get("logprobs") or {}).get("content")
        others = {k: v for k, v in message.items() if k not in ("role", "content", "tool_calls")}
        delta = {"role": "assistant", "content": "", **others}  # reasoning_content whole
        first: dict[str, Any] = {"index": index, "delta": delta}
        if ids is not None:
            first["token_ids"] = []
        chunks.append({**base, **own, "choices": [first]})
        own = {}
        content = message.get("content")
        pieces = _PIECE.findall(content) if isinstance(content, str) else []
        tokens = len(ids) if ids is not None else len(entries or ())
        for position in range(max(tokens, len(pieces))):
            choice: dict[str, Any] = {"index": index, "delta": {}}
            if position < len(pieces):
                choice["delta"]["content"] = pieces[position]
            if ids is not None:
                choice["token_ids"] = ids[position : position + 1]
            if versions is not None:
                choice["token_versions"] = versions[position : position + 1]
            if entries is not None:
                choice["logprobs"] = {"content": entries[position : position + 1]}
            chunks.append({**base, "choices": [choice]})
        for number, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") or {}
            arguments = function.get("arguments") or ""
            half = len(arguments) // 2
            named = {**call, "index": number, "function": {**function, "arguments": ""}}
            for piece in (
                named,
                {"index": number, "function": {"arguments": arguments[:half]}},
                {"index": number, "function": {"arguments": arguments[half:]}},
            ):
                chunks.append(
                    {**base, "choices": [{"index": index, "delta": {"tool_calls": [piece]}}]}
                )
        per_token = ("message", "token_ids", "token_versions", "logprobs")
        last = {k: v for k, v in whole.items() if k not in per_token}
        chunks.append({**base, "choices": [{**last, "index": index, "delta": {}}]})
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and "usage" in answer:
        chunks.append({**base, "choices": [], "usage": answer["usage"]})
    return chunks


def _error(status: int, message: str, headers: Mapping[str, str] = _EMPTY) -> Response:
    body = {"error": {"message": message, "type": "fake_error", "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers))
