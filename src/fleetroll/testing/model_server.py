"""A vLLM-shaped inference server on loopback that runs a real (tiny) model, for tests.

Where :class:`fleetroll.testing.fake_openai.FakeChatServer` answers from a
script, this server samples from a Hugging Face causal LM on the CPU (the
tiny model of :mod:`fleetroll.testing.tiny_model`, or any model saved with
``save_pretrained``), so token ids and logprobs are the model's own and a
trainer can recompute them::

    path = save_tiny_model(tmp_path / "tiny", seed=0)
    async with ModelServer(path) as server:
        policy = OpenAIChatPolicy(base_url=server.base_url, model=server.model_name, ...)

It answers as vLLM does (``vllm serve --enable-auto-tool-choice
--tool-call-parser hermes``, with its dev-mode routes), in the shapes
fleetroll's policy reads:

- ``GET /v1/models``: the one model, with ``max_model_len`` and the weights'
  ``version`` (an int, 0 at start, +1 per weight update);
- ``POST /v1/chat/completions``: the chat template applied on the server
  (``tools``, ``add_generation_prompt``), sampling with ``temperature``,
  ``top_p``, ``top_k``, ``max_tokens``, ``seed`` and ``n``; the assistant's
  ``<tool_call>{json}</tool_call>`` parsed hermes-style into ``tool_calls``
  (when the request has ``tools``); with ``return_token_ids``, the prompt's ids
  at the top level (``prompt_token_ids``) and each choice's ``token_ids``; with
  ``logprobs`` (and ``top_logprobs``), ``choices[].logprobs.content``;
- with ``stream: true`` (either chat route), the answer as vLLM streams it:
  ``chat.completion.chunk`` events, a first with the role (and the answer's
  ``prompt_token_ids``), one per generated token with its text delta and,
  beside it, its ``token_ids`` (with ``return_token_ids``), ``token_versions``
  and ``logprobs.content`` (with ``logprobs``), the tool calls' deltas by
  ``index`` (id and name, then the arguments in pieces), a last with
  ``finish_reason``; a usage chunk with ``stream_options.include_usage``; then
  ``data: [DONE]``. The completion is generated whole first, then streamed;
- ``POST /v1/chat/completions/tokens`` (prime-rl's token-in route, unless
  ``token_route=False``): the same, the prompt being the body's ``tokens``;
- ``POST /tokenize``: vLLM's, for ``messages`` (with ``tools`` and
  ``add_generation_prompt``) or a ``prompt`` text → ``tokens``;
- ``POST /v1/completions``: ``prompt`` as text or as a list of token ids, or
  a batch of either (choices prompt-major, ``n`` per prompt); ``text``, and
  with ``return_token_ids`` each choice's ``prompt_token_ids`` and
  ``token_ids``; ``logprobs: k`` answers OpenAI's legacy shape (``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset``). This is the route
  TRL's ``VLLMClient.generate`` uses (a batch of token prompts,
  ``return_tokens_as_token_ids``: tokens shown as ``token_id:N``, in the chat
  route's logprobs too);
- with ``return_routed_experts`` (a mixture-of-experts model: vLLM's
  ``--enable-return-routed-experts``), ``prompt_routed_experts`` and each
  choice's ``routed_experts``, ``[tokens][layers][top_k]``, the router's own
  top-k per token (:func:`routed_experts_of` recomputes them);
- with ``vision``: a Qwen2-VL-shaped prompt: each image becomes
  ``<|image_pad|>`` once per 28x28 block after the processor's resize (in
  ``/tokenize`` too); the tokens route takes ``multi_modal_data.image``;
- ``GET /health``: 200;
- weight updates, each loading a ``save_pretrained`` directory, swapping the
  model and bumping the version: vLLM's ``POST /collective_rpc`` with
  ``{"method": "reload_weights"}`` (from the served path, or from
  ``kwargs.weights_path``/``model_path``) and SGLang's ``POST
  /update_weights_from_disk`` (``{"model_path": ..., "weight_version": ...}``,
  answered ``{"success": true, ...}``); ``GET /get_weight_version`` answers
  SGLang's ``{"weight_version": ...}``; ``POST /reset_prefix_cache`` (vLLM's,
  after a reload) answers 200 (nothing is cached across requests here).

**Forced continuations (tests only).** The random model never writes a tool
call; ``ModelServer(forced=...)`` takes a function of each completion's
:class:`ForcedRequest` (its prompt's ids, on every route, and the request's
body: a chat request's messages) that answers a text (or None: sample as
usual). The completion is then that text's ids and the end of message, cut
at ``max_tokens``, decoded step by step as a sampled one is (so aborts,
updates in flight and routed experts apply to it alike): the tokens are
forced, but each one's logprob (and ``top_logprobs``) is still the real
model's for that token at that position, so logprob checks stay honest.
Every completion, forced or sampled, is logged in
:attr:`ModelServer.generations` with its prompt.

Every answer carries the header ``X-Weight-Version``: for a completion, the
version of the weights that generated all of it (a generation keeps the
weights it started with; an update applies to the next one).

**Weight updates in flight** (``in_flight_updates=True``): an update applies
between two decoding steps of the generations running (the sequence so far is
run again through the new weights, so every later token is exactly the new
weights' own), and each choice says which version produced each token:
``token_versions``, beside ``token_ids`` (the header is then the last
token's version). Every choice carries ``token_versions`` in either mode.

**Aborts**: SGLang's ``POST /abort_request`` (``{"rid": ...}`` or
``{"abort_all": true}``; this server's request ids are the answers' ``id``)
stops the generations running or queued at their next decoding step; each
answers what it generated so far with ``finish_reason: "abort"`` (as vLLM and
SGLang do). A client that disconnects aborts its generation too (vLLM's abort
on disconnect). ``decode_delay_s`` slows every decoding step, so a test can
land an update or an abort in the middle of a generation.

**Logprobs** are by default the raw model's: ``log_softmax(logits)`` of the
sampled token, in float32, on the logits the model gives for that position,
the input of the temperature (before temperature, top-k or top-p: vLLM's
default ``--logprobs-mode raw_logprobs``). A trainer recomputes them with one
forward pass of the model over prompt + completion and ``log_softmax`` of the
logits, no temperature: within 1e-5 for a few dozen tokens (the tests
check), up to ~1e-5 apart after a few hundred (the KV cache's float32 sums).
Sampling draws from ``softmax(logits / temperature)`` with the tokens outside
``top_k`` and
``top_p`` removed (temperature 0: the argmax). With
``logprobs_mode="processed_logprobs"`` the logprobs are those of that
processed distribution, ``log_softmax(logits / temperature)`` after the cuts
(vLLM's ``processed_logprobs``; TRL's ``GRPOTrainer`` computes
``log_softmax(logits / temperature)`` on its side). ``top_logprobs`` are the k
largest of the same distribution as ``logprobs``.

A completion ends at ``<|im_end|>`` or ``<|endoftext|>`` (the tokenizer's and
the generation config's end tokens), which is in ``token_ids`` and has a
logprob (as vLLM), but not in the text; or after ``max_tokens`` tokens
(``finish_reason: "length"``). A prompt that leaves no room for ``max_tokens``
is answered HTTP 400 with vLLM's message. Generation runs one at a time (the
machine has few cores) in a worker thread, incrementally with the KV cache.

Needs the ``train`` extra (torch, transformers).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fleetroll._internal.exit_stack import exit_transparently
from fleetroll._internal.serving import serve_asgi
from fleetroll.policies.images import PreparedImage, decode_data_url, prepare_image

__all__ = [
    "ForcedRequest",
    "Generation",
    "ModelServer",
    "parse_hermes_tool_calls",
    "routed_experts_of",
]

_STARTUP_TIMEOUT_S = 10.0
_SHUTDOWN_TIMEOUT_S = 5.0
#: vLLM's ``max_tokens`` for ``/v1/completions`` when the request sets none.
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Generation:
    """One sampled completion.

    Attributes:
        token_ids: the generated ids, the end token included when it ended on one.
        logprobs: each generated token's raw logprob (see the module's docstring).
        top_logprobs: per token, the ``(id, logprob)`` of the k likeliest tokens.
        finish_reason: ``"stop"`` (an end token), ``"length"`` or ``"abort"``.
        version: the version of the weights that generated its first token
            (the last one's, with updates in flight).
        token_versions: the version of the weights that generated each token.
        prompt_routed_experts, routed_experts: with ``return_routed_experts``
            (a mixture-of-experts model), per prompt / generated token, per MoE
            layer, the ``top_k`` experts its router picked (highest weight first).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finish_reason: str
    version: int
    token_versions: tuple[int, ...] = ()
    prompt_routed_experts: list[list[list[int]]] | None = None
    routed_experts: list[list[list[int]]] | None = None


@dataclass(frozen=True, slots=True)
class ForcedRequest:
    """What a ``forced`` callable is given: one completion's request.

    Attributes:
        prompt_ids: the prompt as the model reads it (the chat template
            applied, images' placeholders expanded; or the ids sent), one
            prompt of a ``/v1/completions`` batch.
        body: the request's JSON body as sent (a chat request's ``messages``
            and ``tools``, a token route's ``tokens``, a completion's ``prompt``).
    """

    prompt_ids: tuple[int, ...]
    body: Mapping[str, Any]


class _BadRequest(Exception):
    """Answered HTTP 400 with this message (vLLM's error shape)."""


class ModelServer:
    """A vLLM-shaped server for the model saved in ``model_path``, on loopback.

    Use it as an async context manager.

    Args:
        model_path: a ``save_pretrained`` directory holding a causal LM and its
            tokenizer (with a chat template).
        model_name: the served model's name (default: the directory's name).
            Requests may name any model.
        token_route: serve ``/v1/chat/completions/tokens`` (False: a plain
            ``vllm serve``, which has no such route).
        seed: seeds the sampling of requests that give no ``seed``.
        default_max_tokens: the chat route's ``max_tokens`` when a request sets
            none (vLLM's is the rest of the context; this keeps tests quick).
        logprobs_mode: vLLM's ``--logprobs-mode``: ``raw_logprobs`` (its
            default) or ``processed_logprobs`` (what TRL's trainer computes).
        in_flight_updates: apply a weight update between decoding steps of the
            generations running (default: a generation keeps its weights).
        decode_delay_s: seconds slept after each decoding step (tests).
        host: the address to bind (a free port is chosen).
        vision: a vision-language-shaped server (Qwen2-VL's prompt; the model
            needs ``TinyModelSpec(vision=True)``'s tokens): each image of a
            message is resized by Qwen2-VL's rule (at most ``image_max_pixels``)
            and becomes ``<|vision_start|>``, ``<|image_pad|>`` once per 28x28
            block, ``<|vision_end|>`` (in ``/tokenize`` too); the tokens route
            takes the ids with those placeholders and the images in
            ``multi_modal_data.image`` (checked against each other). There is no
            vision tower: the model reads the placeholders as tokens.
        forced: tests only: a scripted continuation. Given each completion's
            :class:`ForcedRequest` (its prompt's ids and the request's body),
            it returns a text, or None to sample as usual (see the module's
            docstring).
        return_routed_experts: vLLM's ``--enable-return-routed-experts``: the
            model must be a mixture of experts (``TinyModelSpec(num_experts=...)``);
            every answer carries ``prompt_routed_experts`` (top level; on each
            choice too in ``/v1/completions``) and each choice's ``routed_experts``,
            ``[tokens][layers][top_k]`` as the router computed them.
        stream_hold: tests only: awaited by a streamed answer after its first
            token's chunk, before the rest (a test holds the stream until its
            client saw that chunk: a relay that waits for whole answers deadlocks).
        after_token: tests only: called in the generation's worker thread after
            each token with the number generated so far, before the next step
            (a test lands a weight update between two given tokens:
            ``anyio.from_thread.run(server.update_weights, path)``).

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``, set once started.
        root_url: the same without ``/v1`` (``/tokenize``, weight updates).
        version: the weights' version: 0, then +1 per update.
        requests: ``(path, body)`` of every POST received, in order.
        generations: ``(prompt ids, generation)`` of every completion made, in order.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        model_name: str | None = None,
        token_route: bool = True,
        seed: int = 0,
        default_max_tokens: int = 64,
        logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs",
        in_flight_updates: bool = False,
        decode_delay_s: float = 0.0,
        host: str = "127.0.0.1",
        return_routed_experts: bool = False,
        vision: bool = False,
        image_max_pixels: int = 28 * 28 * 1280,
        forced: Callable[[ForcedRequest], str | None] | None = None,
        stream_hold: Callable[[], Awaitable[None]] | None = None,
        after_token: Callable[[int], None] | None = None,
    ) -> None:
        self.stream_hold = stream_hold
        self.after_token = after_token
        self.model_path = Path(model_path)
        self.model_name = model_name or self.model_path.name
        self.token_route = token_route
        self.default_max_tokens = default_max_tokens
        self.logprobs_mode = logprobs_mode
        self.in_flight_updates = in_flight_updates
        self.decode_delay_s = decode_delay_s
        #: Every model served so far, by version (a test recomputes logprobs with them).
        self.models: dict[int, Any] = {}
        #: Generations aborted so far (``/abort_request`` or a disconnect), and
        #: the tokens they had generated.
        self.aborted = 0
        self.aborted_tokens = 0
        #: Seconds spent generating (the bench's busy share).
        self.busy_s = 0.0
        self._aborts: dict[str, threading.Event] = {}
        self.base_url = ""
        self.root_url = ""
        self.version = 0
        self.weight_version = "0"
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.generations: list[tuple[tuple[int, ...], Generation]] = []
        self._forced = forced
        self._host = host
        self.return_routed_experts = return_routed_experts
        self.vision = vision
        self.image_max_pixels = image_max_pixels
        #: With ``vision``: every image a completion received, as the model saw it
        #: (after this server's resize), in order.
        self.received_images: list[PreparedImage] = []
        self._seed = seed
        self._model: Any = None
        self._tokenizer: Any = None
        self._end_ids: frozenset[int] = frozenset()
        self._max_model_len = 0
        self._sampling_seeds = itertools.count()
        self._generating = anyio.CapacityLimiter(1)  # one generation at a time
        self._loading = anyio.Lock()  # one weight update at a time
        self._swap = threading.Lock()  # the model and its version change together
        self._ids = itertools.count()
        self._stack = contextlib.AsyncExitStack()

    # -- lifecycle

    async def __aenter__(self) -> Self:
        await anyio.to_thread.run_sync(self._load_all)
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
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/chat/completions/tokens", self._chat_tokens, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/collective_rpc", self._collective_rpc, methods=["POST"]),
                Route("/update_weights_from_disk", self._update_from_disk, methods=["POST"]),
                Route("/get_weight_version", self._get_weight_version, methods=["GET"]),
                Route("/reset_prefix_cache", self._reset_prefix_cache, methods=["POST"]),
                Route("/abort_request", self._abort_request, methods=["POST"]),
            ]
        )
        try:
            async with serve_asgi(
                app,
                host=self._host,
                lifespan="off",
                startup_timeout_s=_STARTUP_TIMEOUT_S,
                shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S,
            ) as url:
                self.root_url = url
                self.base_url = f"{url}/v1"
                yield
        except OSError as exc:
            raise RuntimeError(f"the model server could not start: {exc}") from exc

    def _load_all(self) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._model = _load_model(self.model_path)
        self.models[0] = self._model
        config = self._model.config
        self._max_model_len = int(getattr(config, "max_position_embeddings", 4096))
        ends = {self._tokenizer.eos_token_id}
        for source in (config.eos_token_id, self._model.generation_config.eos_token_id):
            ends.update(source if isinstance(source, list) else [source])
        self._end_ids = frozenset(i for i in ends if isinstance(i, int))
        if self.vision and self._tokenizer.convert_tokens_to_ids("<|image_pad|>") is None:
            raise RuntimeError(
                "vision needs a tokenizer with <|image_pad|> (TinyModelSpec(vision=True))"
            )
        if self.return_routed_experts and not getattr(config, "num_experts", 0):
            raise RuntimeError(
                "return_routed_experts needs a mixture-of-experts model"
                " (save_tiny_model(..., TinyModelSpec(num_experts=4)))"
            )

    # -- the model

    @property
    def model(self) -> Any:
        """The model now served (a ``transformers`` causal LM, eval mode)."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The served model's tokenizer."""
        return self._tokenizer

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        top_logprobs: int = 0,
        weights: tuple[Any, int] | None = None,
        abort: threading.Event | None = None,
        forced: Sequence[int] | None = None,
    ) -> Generation:
        """Sample one completion of ``prompt_ids`` (blocking; the routes call it
        in a worker thread, one at a time) with the weights now served, or with
        ``weights`` (a model and its version: a request's completions all use
        the weights it started with, unless ``in_flight_updates``). ``abort``
        set: it stops at the next decoding step (``finish_reason: "abort"``).
        ``forced``: the ids to generate instead of sampled ones (cut at
        ``max_tokens``), each with the model's own logprob."""
        import torch

        began = time.monotonic()
        model, version = weights or self._weights()
        first_version = version
        versions: list[int] = []
        processed_logprobs = self.logprobs_mode == "processed_logprobs"
        if seed is None:
            seed = self._seed * 1_000_003 + next(self._sampling_seeds)
        generator = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        logprobs: list[float] = []
        tops: list[tuple[tuple[int, float], ...]] = []
        finish = "length"
        # transformers 5 names the KV cache ``cache`` (``past_key_values`` before).
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else None
        routing = {"output_router_logits": True} if self.return_routed_experts else {}
        experts_k = int(getattr(model.config, "num_experts_per_tok", 0))
        prompt_routes: list[list[list[int]]] | None = None
        routes: list[list[list[int]]] = []
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(prompt_ids)]), use_cache=True, **routing)
            if routing:
                prompt_routes = _routes(out, experts_k)
            steps = max_tokens if forced is None else min(len(forced), max_tokens)
            for step in range(steps):
                if abort is not None and abort.is_set():
                    finish = "abort"
                    break
                if self.in_flight_updates and (now := self._weights())[1] != version:
                    # The update lands between two steps: the sequence so far runs
                    # through the new weights (no stale KV cache), so each later
                    # token is exactly what they give.
                    model, version = now
                    out = model(input_ids=torch.tensor([[*prompt_ids, *ids]]), use_cache=True)
                logits = out.logits[0, -1].float()
                token, processed = _sample(logits, temperature, top_p, top_k, generator)
                if forced is not None:
                    token = forced[step]
                shown = processed if processed_logprobs else torch.log_softmax(logits, dim=-1)
                ids.append(token)
                versions.append(version)
                logprobs.append(float(shown[token]))
                if top_logprobs:
                    values, indices = torch.topk(shown, top_logprobs)
                    tops.append(tuple(zip(indices.tolist(), values.tolist(), strict=True)))
                if token in self._end_ids:
                    finish = "stop"
                    break
                if self.after_token is not None:
                    self.after_token(len(ids))
                if self.decode_delay_s:
                    time.sleep(self.decode_delay_s)
                cache = out.cache if name else out.past_key_values
                out = model(
                    input_ids=torch.tensor([[token]]),
                    use_cache=True,
                    **{name or "past_key_values": cache},
                    **routing,
                )
                if routing:
                    routes += _routes(out, experts_k)
            if routing and len(routes) < len(ids):  # the last token: routed, as vLLM does
                cache = out.cache if name else out.past_key_values
                out = model(
                    input_ids=torch.tensor([[ids[-1]]]),
                    use_cache=True,
                    **{name or "past_key_values": cache},
                    **routing,
                )
                routes += _routes(out, experts_k)
        self.busy_s += time.monotonic() - began
        if finish == "abort":
            self.aborted += 1
            self.aborted_tokens += len(ids)
        shown_version = version if self.in_flight_updates else first_version
        made = Generation(
            tuple(ids),
            tuple(logprobs),
            tuple(tops),
            finish,
            shown_version,
            tuple(versions),
            prompt_routed_experts=prompt_routes,
            routed_experts=routes if routing else None,
        )
        self.generations.append((tuple(prompt_ids), made))
        return made

    def abort_all(self) -> int:
        """Abort every generation running or queued; return how many were asked."""
        for event in self._aborts.values():
            event.set()
        return len(self._aborts)

    def _weights(self) -> tuple[Any, int]:
        """The model now served and its version, read together."""
        with self._swap:
            return self._model, self.version

    async def update_weights(self, path: str | Path, *, weight_version: str | None = None) -> int:
        """Load the model saved in ``path`` and serve it from the next generation
        on; return the new version."""
        async with self._loading:
            model = await anyio.to_thread.run_sync(_load_model, Path(path))
            with self._swap:
                self._model = model
                self.version += 1
                self.models[self.version] = model
                self.weight_version = weight_version or str(self.version)
            return self.version

    # -- routes

    async def _models(self, request: Request) -> Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fleetroll",
            "root": str(self.model_path),
            "max_model_len": self._max_model_len,
            "version": self.version,
            "weight_version": self.weight_version,
        }
        return self._json({"object": "list", "data": [model]})

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's dev-mode route: nothing is cached across requests here."""
        self.requests.append((request.url.path, {}))
        return Response(status_code=200)

    async def _get_weight_version(self, request: Request) -> Response:
        return self._json({"weight_version": self.weight_version})

    async def _tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if "messages" in body:
                ids = self._chat_prompt(body, generation=body.get("add_generation_prompt", True))
            elif isinstance(body.get("prompt"), str):
                ids = self._encode(body["prompt"])
            else:
                raise _BadRequest("either 'messages' or 'prompt' (a string) is required")
        except _BadRequest as exc:
            return _error(400, str(exc))
        return self._json({"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids})

    async def _chat_tokens(self, request: Request) -> Response:
        if not self.token_route:
            return _error(404, "Not Found")
        return await self._chat(request)

    async def _chat(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if request.url.path.endswith("/tokens"):
                prompt = _token_list(body.get("tokens"), "tokens")
                if self.vision:
                    self._check_images(prompt, body)
            else:
                prompt = self._chat_prompt(
                    body, generation=body.get("add_generation_prompt", True), record=True
                )
            sampling = self._sampling(body, default_max_tokens=self.default_max_tokens)
            self._check_context(len(prompt), sampling["max_tokens"])
            top = _int(body.get("top_logprobs"), "top_logprobs", default=0)
            want_logprobs = body.get("logprobs") is True
            weights = self._weights()
            rid = f"chatcmpl-{next(self._ids)}"
            async with self._abortable(request, rid) as abort:
                generations = await self._generate_n(
                    prompt, body, sampling, top if want_logprobs else 0, weights, (abort, request)
                )
        except _BadRequest as exc:
            return _error(400, str(exc))
        parse_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        wants_ids = body.get("return_token_ids") is True
        as_ids = body.get("return_tokens_as_token_ids") is True
        choices = []
        for index, generation in enumerate(generations):
            text = self._decode(generation.token_ids)
            content: str | None = text
            calls: list[dict[str, Any]] = []
            if parse_tools:
                content, calls = parse_hermes_tool_calls(text)
            finish = generation.finish_reason
            if calls and finish == "stop":
                finish = "tool_calls"
            message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": (
                        {"content": self._chat_logprobs(generation, as_ids)}
                        if want_logprobs
                        else None
                    ),
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": list(generation.token_ids) if wants_ids else None,
                    "token_versions": list(generation.token_versions),
                }
            )
            if generation.routed_experts is not None:
                choices[-1]["routed_experts"] = generation.routed_experts
        completion_tokens = sum(len(g.token_ids) for g in generations)
        answer = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if wants_ids else None,
        }
        if generations[0].prompt_routed_experts is not None:
            answer["prompt_routed_experts"] = generations[0].prompt_routed_experts
        if body.get("stream") is True:
            return StreamingResponse(
                self._chunks(answer, generations, body),
                media_type="text/event-stream",
                headers={"X-Weight-Version": str(generations[-1].version)},
            )
        return self._json(answer, version=generations[-1].version)

    async def _chunks(
        self, answer: dict[str, Any], generations: list[Generation], body: Mapping[str, Any]
    ) -> AsyncIterator[bytes]:
        """``answer`` streamed as vLLM streams it: a first chunk per choice with the
        role (the answer's own fields, ``prompt_token_ids`` among them, on the very
        first), then one chunk per token (its text, its id and version, its logprob),
        the tool calls' deltas (a first with id and name, the arguments in two
        pieces), a last chunk with ``finish_reason``; the usage when asked; ``[DONE]``.
        ``stream_hold`` is awaited after the first token's chunk."""
        base = {k: answer[k] for k in ("id", "created", "model")} | {
            "object": "chat.completion.chunk"
        }
        own = {k: v for k, v in answer.items() if k not in ("id", "created", "model", "object")}
        own = {k: v for k, v in own.items() if k not in ("choices", "usage")}
        wants_ids = body.get("return_token_ids") is True

        def sse(chunk: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()

        def choice(index: int, delta: dict[str, Any], **fields: Any) -> dict[str, Any]:
            return {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": None,
            } | fields

        held = False
        for index, (whole, generation) in enumerate(
            zip(answer["choices"], generations, strict=True)
        ):
            first = choice(index, {"role": "assistant", "content": ""})
            if wants_ids:
                first["token_ids"] = []
            yield sse({**base, **own, "choices": [first]})
            own = {}
            message = whole["message"]
            content = message["content"] or ""
            logprobs = (whole["logprobs"] or {}).get("content")
            sent = 0
            for position, token in enumerate(generation.token_ids):
                text = self._decode(generation.token_ids[: position + 1])
                upto = next(
                    (i for i, (a, b) in enumerate(zip(text, content, strict=False)) if a != b),
                    min(len(text), len(content)),
                )
                delta: dict[str, Any] = {}
                if upto > sent:
                    delta["content"], sent = content[sent:upto], upto
                chunk = choice(index, delta, token_versions=[generation.token_versions[position]])
                if wants_ids:
                    chunk["token_ids"] = [token]
                if logprobs is not None:
                    chunk["logprobs"] = {"content": [logprobs[position]]}
                yield sse({**base, "choices": [chunk]})
                if not held and self.stream_hold is not None:
                    held = True
                    await self.stream_hold()
            if sent < len(content):
                yield sse({**base, "choices": [choice(index, {"content": content[sent:]})]})
            for number, call in enumerate(message["tool_calls"]):
                named = {**call, "index": number, "function": {**call["function"], "arguments": ""}}
                arguments = call["function"]["arguments"]
                half = len(arguments) // 2
                for piece in (
                    named,
                    {"index": number, "function": {"arguments": arguments[:half]}},
                    {"index": number, "function": {"arguments": arguments[half:]}},
                ):
                    yield sse({**base, "choices": [choice(index, {"tool_calls": [piece]})]})
            last = choice(index, {}, finish_reason=whole["finish_reason"], stop_reason=None)
            if "routed_experts" in whole:
                last["routed_experts"] = whole["routed_experts"]
            yield sse({**base, "choices": [last]})
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            yield sse({**base, "choices": [], "usage": answer["usage"]})
        yield b"data: [DONE]\n\n"

    async def _completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            prompts = [
                self._encode(item) if isinstance(item, str) else _token_list(item, "prompt")
                for item in _prompt_batch(body.get("prompt"))
            ]
            sampling = self._sampling(body, default_max_tokens=_COMPLETIONS_DEFAULT_MAX_TOKENS)
            for prompt in prompts:
                self._check_context(len(prompt), sampling["max_tokens"])
            logprobs = body.get("logprobs")
            top = None if logprobs is None else _int(logprobs, "logprobs", default=0)
            weights = self._weights()
            rid = f"cmpl-{next(self._ids)}"
            async with self._abortable(request, rid) as abort:
                batches = [
                    await self._generate_n(
                        prompt, body, sampling, top or 0, weights, (abort, request)
                    )
                    for prompt in prompts
                ]
        except _BadRequest as exc:
            return _error(400, str(exc))
        wants_ids = body.get("return_token_ids") is True
        as_ids = body.get("return_tokens_as_token_ids") is True
        choices: list[dict[str, Any]] = []
        for prompt, generations in zip(prompts, batches, strict=True):  # prompt-major, as vLLM
            for generation in generations:
                choices.append(
                    {
                        "index": len(choices),
                        "text": self._decode(generation.token_ids),
                        "logprobs": (
                            None if top is None else self._legacy_logprobs(generation, as_ids)
                        ),
                        "finish_reason": generation.finish_reason,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt if wants_ids else None,
                        "token_ids": list(generation.token_ids) if wants_ids else None,
                        "token_versions": list(generation.token_versions),
                    }
                )
                if generation.routed_experts is not None:
                    choices[-1]["prompt_routed_experts"] = generation.prompt_routed_experts
                    choices[-1]["routed_experts"] = generation.routed_experts
        prompt_tokens = sum(
            len(prompt) * len(g) for prompt, g in zip(prompts, batches, strict=True)
        )
        completion_tokens = sum(len(g.token_ids) for batch in batches for g in batch)
        answer = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return self._json(answer, version=batches[-1][-1].version)

    async def _abort_request(self, request: Request) -> Response:
        """SGLang's ``/abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}``."""
        try:
            body = await self._body(request)
        except _BadRequest as exc:
            return _error(400, str(exc))
        if body.get("abort_all") is True:
            self.abort_all()
        elif isinstance(rid := body.get("rid"), str):
            if (event := self._aborts.get(rid)) is not None:
                event.set()
        else:
            return _error(400, "give 'rid' (a request id) or 'abort_all': true")
        return Response(status_code=200)

    @contextlib.asynccontextmanager
    async def _abortable(self, request: Request, rid: str) -> AsyncIterator[threading.Event]:
        """An abort flag for the request ``rid``, set by ``/abort_request`` or by the
        client's disconnect (vLLM aborts a request whose client went away)."""
        event = threading.Event()
        self._aborts[rid] = event
        try:
            yield event
        finally:
            del self._aborts[rid]

    async def _collective_rpc(self, request: Request) -> Response:
        """vLLM's dev-mode ``/collective_rpc``: only ``reload_weights`` is known."""
        try:
            body = await self._body(request)
        except _BadRequest as exc:
            return _error(400, str(exc))
        if body.get("method") != "reload_weights":
            return _error(
                400, f"unknown method {body.get('method')!r} (this server: reload_weights)"
            )
        kwargs = body.get("kwargs") or {}
        args = body.get("args") or []
        path = kwargs.get("weights_path") or kwargs.get("model_path") or (args[0] if args else None)
        await self.update_weights(path or self.model_path)
        return self._json({"results": [None]})

    async def _update_from_disk(self, request: Request) -> Response:
        """SGLang's ``/update_weights_from_disk``."""
        try:
            body = await self._body(request)
        except _BadRequest as exc:
            return _error(400, str(exc))
        path = body.get("model_path")
        if not isinstance(path, str):
            return self._json({"success": False, "message": "'model_path' is required"}, 400)
        try:
            await self.update_weights(path, weight_version=body.get("weight_version"))
        except (OSError, ValueError) as exc:
            message = f"Failed to update weights: {exc}"
            return self._json({"success": False, "message": message}, 400)
        message = "Succeeded to update model weights."
        return self._json({"success": True, "message": message, "num_paused_requests": 0})

    # -- helpers

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError as exc:
            raise _BadRequest(f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest("the request body is not a JSON object")
        self.requests.append((request.url.path, body))
        return body

    def _json(
        self, body: Mapping[str, Any], status: int = 200, *, version: int | None = None
    ) -> Response:
        shown = self.weight_version if version is None else str(version)
        return JSONResponse(dict(body), status_code=status, headers={"X-Weight-Version": shown})

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def _image(self, url: object) -> PreparedImage:
        try:
            return prepare_image(decode_data_url(str(url)), max_pixels=self.image_max_pixels)
        except ValueError as exc:
            raise _BadRequest(f"an image could not be read: {exc}") from None

    def _images_of(self, messages: list[Any]) -> list[PreparedImage]:
        return [
            self._image((part.get("image_url") or {}).get("url"))
            for message in messages
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image_url"
        ]

    def _pad_runs(self, ids: Sequence[int]) -> list[int]:
        pad = self._tokenizer.convert_tokens_to_ids("<|image_pad|>")
        runs: list[int] = []
        previous = None
        for token in ids:
            if token == pad:
                if previous == pad:
                    runs[-1] += 1
                else:
                    runs.append(1)
            previous = token
        return runs

    def _check_images(self, prompt: list[int], body: Mapping[str, Any]) -> None:
        """The tokens route's multimodal prompt: one placeholder run per image,
        as long as the image's 28x28 blocks after this server's resize."""
        data = body.get("multi_modal_data") or {}
        urls = data.get("image") if isinstance(data, dict) else None
        images = [self._image(url) for url in urls or ()]
        runs = self._pad_runs(prompt)
        if runs != [image.placeholders for image in images]:
            raise _BadRequest(
                f"the prompt's image placeholders ({runs}) do not match the images'"
                f" ({[image.placeholders for image in images]})"
            )
        self.received_images += images

    def _chat_prompt(
        self, body: Mapping[str, Any], *, generation: bool, record: bool = False
    ) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' (a non-empty list) is required")
        tools = body.get("tools") or None
        try:
            text = self._tokenizer.apply_chat_template(
                _template_messages(
                    messages,
                    image_text="<|vision_start|><|image_pad|><|vision_end|>"
                    if self.vision
                    else None,
                ),
                tools=tools,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except Exception as exc:  # a template error: the request's fault, as in vLLM
            raise _BadRequest(f"the chat template failed: {exc}") from None
        ids = self._encode(str(text))
        if not self.vision:
            return ids
        images = self._images_of(messages)
        pad = self._tokenizer.convert_tokens_to_ids("<|image_pad|>")
        counts = iter(image.placeholders for image in images)
        expanded: list[int] = []
        for token in ids:
            expanded += [pad] * next(counts) if token == pad else [token]
        if record:
            self.received_images += images
        return expanded

    def _sampling(self, body: Mapping[str, Any], *, default_max_tokens: int) -> dict[str, Any]:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        return {
            "max_tokens": _int(max_tokens, "max_tokens", default=default_max_tokens),
            "temperature": _float(body.get("temperature"), "temperature", default=1.0),
            "top_p": _float(body.get("top_p"), "top_p", default=1.0),
            "top_k": _int(body.get("top_k"), "top_k", default=-1),
        }

    def _check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        if max_tokens < 1:
            raise _BadRequest("max_tokens must be at least 1")
        if prompt_tokens + max_tokens > self._max_model_len:
            raise _BadRequest(
                f"This model's maximum context length is {self._max_model_len} tokens. However,"
                f" you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the"
                f" messages, {max_tokens} in the completion). Please reduce the length of the"
                " messages or completion."
            )

    async def _generate_n(
        self,
        prompt: list[int],
        body: Mapping[str, Any],
        sampling: dict[str, Any],
        top: int,
        weights: tuple[Any, int],
        abort: tuple[threading.Event, Request] | None = None,
    ) -> list[Generation]:
        n = _int(body.get("n"), "n", default=1)
        seed = body.get("seed")
        if seed is not None:
            seed = _int(seed, "seed", default=0)
        forced = None
        if self._forced is not None:
            forced = await anyio.to_thread.run_sync(
                self._forced_ids, ForcedRequest(tuple(prompt), body), limiter=self._generating
            )
        if abort is None:
            return await self._generate_each(prompt, n, seed, sampling, top, weights, None, forced)
        event, request = abort

        async def watch() -> None:  # a client that went away: its generation stops
            while not event.is_set():
                if await request.is_disconnected():
                    event.set()
                    return
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch)
            try:
                generations = await self._generate_each(
                    prompt, n, seed, sampling, top, weights, event, forced
                )
            finally:
                tasks.cancel_scope.cancel()
        return generations

    async def _generate_each(
        self,
        prompt: list[int],
        n: int,
        seed: int | None,
        sampling: dict[str, Any],
        top: int,
        weights: tuple[Any, int],
        abort: threading.Event | None,
        forced: Sequence[int] | None,
    ) -> list[Generation]:
        generations = []
        for index in range(n):
            choice_seed = None if seed is None else seed + index
            generations.append(
                await anyio.to_thread.run_sync(
                    functools.partial(
                        self.generate,
                        prompt,
                        seed=choice_seed,
                        top_logprobs=top,
                        weights=weights,
                        abort=abort,
                        forced=forced,
                        **sampling,
                    ),
                    limiter=self._generating,
                )
            )
        return generations

    def _forced_ids(self, request: ForcedRequest) -> list[int] | None:
        """The ids a completion is forced to (the text the ``forced`` callable
        answers, then ``<|im_end|>``), or None to sample."""
        assert self._forced is not None
        text = self._forced(request)
        if text is None:
            return None
        return [*self._encode(text), self._tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def _token_text(self, token_id: int, as_ids: bool = False) -> str:
        """A token as vLLM shows it in logprobs (``token_id:N`` with
        ``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if as_ids else str(self._tokenizer.decode([token_id]))

    def _chat_logprobs(self, generation: Generation, as_ids: bool) -> list[dict[str, Any]]:
        entries = []
        for position, (token_id, logprob) in enumerate(
            zip(generation.token_ids, generation.logprobs, strict=True)
        ):
            text = self._token_text(token_id, as_ids)
            alternatives = generation.top_logprobs[position] if generation.top_logprobs else ()
            entries.append(
                {
                    "token": text,
                    "logprob": logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (alt := self._token_text(i, as_ids)),
                            "logprob": value,
                            "bytes": list(alt.encode()),
                        }
                        for i, value in alternatives
                    ],
                }
            )
        return entries

    def _legacy_logprobs(self, generation: Generation, as_ids: bool) -> dict[str, Any]:
        """OpenAI's legacy completion logprobs; each position's ``top_logprobs``
        holds the k likeliest tokens and the sampled one (k + 1 at most, as vLLM)."""
        tokens = [self._token_text(i, as_ids) for i in generation.token_ids]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        for position, (token, logprob) in enumerate(zip(tokens, generation.logprobs, strict=True)):
            alternatives = generation.top_logprobs[position] if generation.top_logprobs else ()
            entry = {self._token_text(i, as_ids): value for i, value in alternatives}
            entry.setdefault(token, logprob)
            top.append(entry)
        return {
            "text_offset": offsets,
            "token_logprobs": list(generation.logprobs),
            "tokens": tokens,
            "top_logprobs": top,
        }


def parse_hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """vLLM's hermes tool parser: the text before the first ``<tool_call>`` (None
    when empty) and OpenAI ``tool_calls`` for each ``<tool_call>{json}</tool_call>``
    (an unclosed last one included). Any call that is not a JSON object with a
    ``name`` leaves the whole text as content and no calls, as vLLM does."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    try:
        for closed, unclosed in _TOOL_CALL.findall(text):
            parsed = json.loads(closed or unclosed)
            if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
                return text, []
            arguments = parsed.get("arguments", {})
            calls.append(
                {
                    "id": f"chatcmpl-tool-{len(calls)}",
                    "type": "function",
                    "function": {
                        "name": parsed["name"],
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
    except ValueError:
        return text, []
    content = text[: text.find("<tool_call>")]
    return (content or None), calls


def _template_messages(messages: list[Any], image_text: str | None = None) -> list[dict[str, Any]]:
    """Messages as a Hugging Face template takes them (as vLLM prepares them): tool
    calls' JSON ``arguments`` decoded to objects, content parts joined into text."""
    prepared = []
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequest("each message must be a JSON object")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = "\n".join(
                image_text
                if image_text is not None and part.get("type") == "image_url"
                else str(part.get("text", ""))
                for part in content
                if isinstance(part, dict)
            )
        calls = []
        for call in message.get("tool_calls") or ():
            call = json.loads(json.dumps(call))
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):  # else rendered as the string it is
                    function["arguments"] = json.loads(function["arguments"])
            calls.append(call)
        if calls:
            message["tool_calls"] = calls
        prepared.append(message)
    return prepared


def _routes(out: Any, top_k: int) -> list[list[list[int]]]:
    """Per position of a forward pass, per MoE layer, the ``top_k`` experts its
    router picked (Qwen2-MoE: the top k of ``softmax(router_logits)``, highest first)."""
    import torch

    per_layer = [torch.topk(logits.float(), top_k, dim=-1).indices for logits in out.router_logits]
    stacked = torch.stack(per_layer, dim=1)  # [positions, layers, top_k]
    return [[list(map(int, layer)) for layer in position] for position in stacked.tolist()]


def routed_experts_of(model: Any, ids: Sequence[int]) -> list[list[list[int]]]:
    """What ``model``'s routers pick for each of ``ids`` in one forward pass (no
    cache): per token, per MoE layer, the top ``num_experts_per_tok`` experts."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]), output_router_logits=True)
    return _routes(out, int(model.config.num_experts_per_tok))


def _sample(
    logits: Any, temperature: float, top_p: float, top_k: int, generator: Any
) -> tuple[int, Any]:
    """A token drawn from the processed distribution, and that distribution's
    log-probabilities: ``log_softmax(logits / temperature)`` with the tokens
    outside ``top_k`` and ``top_p`` at -inf (temperature 0: the argmax, and the
    raw log-softmax, as vLLM's processed logprobs for greedy sampling)."""
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits)), torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        removed = torch.zeros_like(scaled, dtype=torch.bool).scatter(0, order, before >= top_p)
        scaled = scaled.masked_fill(removed, float("-inf"))
    processed = torch.log_softmax(scaled, dim=-1)
    token = int(torch.multinomial(processed.exp(), 1, generator=generator))
    return token, processed


#: One ``from_pretrained`` at a time in this process: two servers loading at once
#: (a weight sync pushes to both together) served logprobs no forward pass of the
#: saved weights gives, different at every run; loaded one after the other, exact.
_LOADING = threading.Lock()


def _load_model(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with _LOADING:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def _prompt_batch(value: object) -> list[object]:
    """``/v1/completions``' ``prompt``: one (a text, a list of ids) or a batch of them."""
    if isinstance(value, list) and value and all(isinstance(i, str | list) for i in value):
        return list(value)
    return [value]


def _token_list(value: object, name: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise _BadRequest(f"'{name}' must be a non-empty list of token ids")
    return list(value)


def _int(value: object, name: str, *, default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise _BadRequest(f"'{name}' must be an integer")
    return value


def _float(value: object, name: str, *, default: float) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _BadRequest(f"'{name}' must be a number")
    return float(value)


def _error(status: int, message: str) -> Response:
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)
