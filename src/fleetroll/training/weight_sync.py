"""Weight sync: the trainer's new weights onto every policy server, between policy calls.

After an optimizer step a trainer saves its model (``save_pretrained``) and
has every inference server load it; fleetroll must not start a policy call
while the servers swap, and must record the new version on every turn after::

    sync = SGLangDiskSync(settings.policy.servers, api_key=settings.openai_api_key)
    model.save_pretrained(path)
    version = await sync_weights(pool, sync, path)   # paused, pushed, version bumped

:func:`sync_weights` holds new policy calls (``pool.policy_paused()``) for the
push, pushes through a :class:`WeightSync`, sets ``pool.policy_version`` to the
new version before the pause ends, and returns it. Calls already running when
the pause begins finish on the server; SGLang's ``/update_weights_from_disk``
waits for its running requests before it swaps (unless
``abort_all_requests``), and :class:`fleetroll.testing.model_server.ModelServer`
finishes a generation on the weights it started with, so no call's tokens
mix two versions there.

Implementations, each pushing to every server it was given, concurrently,
each server's update retried on transient failures (connection errors,
408/425/429/5xx: :mod:`fleetroll._internal.retrying`, ``retries.weight_sync_*``),
all within ``timeouts.weight_sync_s``:

- :class:`SGLangDiskSync`: SGLang's ``POST /update_weights_from_disk``
  ``{"model_path": ..., "weight_version": "<version>"}``, answered
  ``{"success": bool, "message": ...}``;
- :class:`VLLMReloadSync`: vLLM's ``POST /collective_rpc``
  ``{"method": "reload_weights", "kwargs": {"weights_path": ...}}`` (a route
  of ``VLLM_SERVER_DEV_MODE=1`` only), answered ``{"results": [...]}`` or an
  empty 200, then ``POST /reset_prefix_cache``;
- :class:`CallableSync`: the user's own function (sync or async), called once
  per sync with the source and the new version.

A server that reports its weight version (SGLang's ``GET /get_weight_version``,
the ``X-Weight-Version`` header of the test server) is checked after the push:
SGLang must report the version sent, any other server a version other than
the one it had. A server that refuses, does not answer in time or still
reports its old version fails the sync with one
:class:`~fleetroll.errors.WeightSyncError` naming every such server (never a
credential: the API key travels only in the ``Authorization`` header).

The routes are the servers' roots: a base URL's trailing ``/v1`` (how
``policy.base_urls`` name the OpenAI API) is dropped. ``source`` is a path the
*servers* read: on another machine it must be on a shared file system.

From synchronous code (TRL's ``rollout_func``), call it through the loop that
runs the pool, e.g. ``portal.call(sync_weights, pool, sync, path)`` with the
``anyio.from_thread.BlockingPortal`` that hosts it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import anyio
import anyio.to_thread
import httpx

from fleetroll._internal import retrying
from fleetroll._internal.deadlines import fail_after, now
from fleetroll._internal.excerpts import error_excerpt, shorten
from fleetroll.errors import WeightSyncError
from fleetroll.settings.sections import Budget, PolicySettings, RetrySettings, TimeoutSettings

__all__ = [
    "CallableSync",
    "SGLangDiskSync",
    "SupportsPolicyUpdate",
    "SupportsRemotePolicyUpdate",
    "VLLMReloadSync",
    "WeightSync",
    "abort_generations",
    "sync_weights",
]

_T = TypeVar("_T")


@runtime_checkable
class WeightSync(Protocol):
    """Pushes new weights to the policy servers."""

    async def push(self, source: Any, *, version: int) -> None:
        """Have every server serve the weights in ``source`` from its next
        generation on; ``version`` is the policy version they will carry.

        Raises:
            WeightSyncError: a server did not take them.
        """
        ...


class SupportsPolicyUpdate(Protocol):
    """What :func:`sync_weights` needs of a pool (:class:`fleetroll.RolloutPool`)."""

    @property
    def policy_version(self) -> int: ...

    async def set_policy_version(self, value: int, /) -> None: ...

    def policy_paused(self) -> AbstractAsyncContextManager[None]: ...


class SupportsRemotePolicyUpdate(Protocol):
    """The same, over HTTP (:class:`fleetroll.FleetrollClient` of ``fleetroll serve``)."""

    async def policy_version(self) -> int: ...

    async def set_policy_version(self, value: int, /) -> None: ...

    def policy_paused(self) -> AbstractAsyncContextManager[None]: ...


async def sync_weights(
    pool: SupportsPolicyUpdate | SupportsRemotePolicyUpdate,
    sync: WeightSync,
    source: Any,
    *,
    version: int | None = None,
) -> int:
    """Push new weights with ``sync`` while ``pool`` holds new policy calls,
    then set its policy version; return that version.

    Every policy call that starts after this returns records the new version
    and is answered by the new weights; none starts during the push. When the
    push fails the version stays, the pause ends, and the error is raised.

    Args:
        pool: the pool whose policy calls go to the servers (a ``RolloutPool``),
            or a ``FleetrollClient`` of the service that runs them.
        sync: how to push (:class:`SGLangDiskSync`, :class:`VLLMReloadSync`,
            :class:`CallableSync` or your own :class:`WeightSync`).
        source: where the weights are (a ``save_pretrained`` directory the
            servers can read, for the HTTP syncs).
        version: the new policy version (default: the pool's + 1); must be
            greater than the pool's.

    Raises:
        WeightSyncError: a server did not take the weights.
        ValueError: ``version`` is not greater than the pool's.
        TypeError: ``version`` is not an int.
    """
    reading = pool.policy_version
    current = await reading() if callable(reading) else reading
    new = current + 1 if version is None else version
    if isinstance(new, bool) or not isinstance(new, int):
        raise TypeError(f"a policy version is an int, not {type(new).__name__}")
    if new <= current:
        raise ValueError(f"the new policy version {new} is not after the pool's ({current})")
    async with pool.policy_paused():
        await sync.push(source, version=new)
        await pool.set_policy_version(new)
    return new


async def abort_generations(
    base_urls: str | Sequence[str],
    *,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Abort every generation running on each policy server: SGLang's ``POST
    /abort_request {"abort_all": true}`` (the test server's too). Each aborted
    request answers what it generated so far with ``finish_reason: "abort"``
    (``policy.weight_update = "abort"`` resumes it from there).

    Raises:
        WeightSyncError: a server refused, has no such route or did not answer
            within ``timeout_s`` (every such server named, never a credential).
    """
    urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    failed: dict[str, str] = {}

    async def one(client: httpx.AsyncClient, root: str) -> None:
        try:
            with fail_after(timeout_s):
                answer = await client.post(
                    f"{root}/abort_request", json={"abort_all": True}, headers=headers
                )
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the boundary: one line per server
            failed[_shown(root)] = _why(exc, timeout_s)
            return
        if answer.status_code == 404:
            failed[_shown(root)] = (
                "no /abort_request route (SGLang's; policy.weight_update = 'abort' needs it)"
            )
        elif not answer.is_success:
            failed[_shown(root)] = (
                f"abort refused: HTTP {answer.status_code}: {error_excerpt(answer.content)}"
            )

    client = httpx.AsyncClient(transport=transport, timeout=timeout_s)
    async with client, anyio.create_task_group() as tasks:
        for root in dict.fromkeys(_root(url) for url in urls):
            tasks.start_soon(one, client, root)
    if failed:
        raise WeightSyncError(failed)


# ---------------------------------------------------------------- HTTP syncs


class _Refused(Exception):
    """A server's answer other than success; transient as its status says."""

    def __init__(self, status_code: int, message: str, *, transient: bool | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        if transient is not None:
            self.transient = transient


class _NotTaken(Exception):
    """The server answered success but still reports its old weights."""


def _root(url: str) -> str:
    """The server's root: ``url`` without a trailing ``/v1``, query or fragment."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"a policy server's base URL is invalid: {_shown(url)}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"a policy server's base URL is not http(s)://host...: {_shown(url)}")
    path = parsed.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return str(parsed.copy_with(path=path or "/", query=None, fragment=None)).rstrip("/")


def _shown(url: str) -> str:
    """``url`` without credentials, query or fragment, for messages."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an invalid URL)"
    return str(parsed.copy_with(userinfo=b"", query=None, fragment=None)).rstrip("/")


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, _Refused):
        return f"refused the weights (HTTP {exc.status_code}): {exc.message}"
    if isinstance(exc, _NotTaken):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return f"did not take the weights within timeouts.weight_sync_s = {timeout_s:g} s"
    if isinstance(exc, httpx.TransportError):
        detail = shorten(str(exc), 200)
        return f"could not be reached ({type(exc).__name__}{': ' + detail if detail else ''})"
    return f"{type(exc).__name__}: {shorten(str(exc), 200)}"


class _HttpSync:
    """A push to every server's root, concurrently: one route, one body."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
        budget: Budget | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("a weight sync needs at least one policy server's base URL")
        self.servers = [_root(url) for url in urls]
        self._api_key = api_key
        self.timeout_s = TimeoutSettings().weight_sync_s if timeout_s is None else timeout_s
        self.budget = budget or RetrySettings().weight_sync_budget
        self._transport = transport

    @classmethod
    def from_settings(
        cls,
        policy: PolicySettings,
        timeouts: TimeoutSettings,
        retries: RetrySettings,
        *,
        api_key: str | None = None,
    ) -> Self:
        """A sync to every server of ``policy.servers`` (``base_urls``, or
        ``base_url``), with ``timeouts.weight_sync_s`` and ``retries.weight_sync_*``.
        ``api_key``: the policy servers' (``settings.openai_api_key``), if they want one."""
        return cls(
            policy.servers,
            api_key=api_key,
            timeout_s=timeouts.weight_sync_s,
            budget=retries.weight_sync_budget,
        )

    def __repr__(self) -> str:
        servers = ", ".join(_shown(s) for s in self.servers)
        return f"{type(self).__name__}([{servers}])"

    # What the subclasses say.

    def request(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        """The route (from the root) and the JSON body of one server's update."""
        raise NotImplementedError

    def refusal(self, answer: httpx.Response) -> str | None:
        """Why a 2xx answer still refuses (SGLang's ``success: false``), or None."""
        return None

    def expected_version(self, version: int) -> str | None:
        """The weight version a server reports once it took them; None: any
        other than before."""
        return None

    def followups(self) -> tuple[str, ...]:
        """Routes POSTed (no body) after a server took the weights."""
        return ()

    # The push.

    async def push(self, source: Any, *, version: int) -> None:
        """Have every server load the weights saved in ``source`` (a directory).

        Raises:
            WeightSyncError: a server refused them, did not answer within
                ``timeout_s`` or still reports its old weight version.
        """
        path = str(await anyio.Path(os.fspath(source)).absolute())
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        failed: dict[str, str] = {}
        synced: list[str] = []

        async def one(client: httpx.AsyncClient, root: str) -> None:
            try:
                with fail_after(self.timeout_s):
                    await self._push_to(client, root, path, version, now() + self.timeout_s)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # the boundary: one line per server
                failed[_shown(root)] = _why(exc, self.timeout_s)
            else:
                synced.append(_shown(root))

        async with (
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(None),
                follow_redirects=False,
                transport=self._transport,
            ) as client,
            anyio.create_task_group() as tg,
        ):
            for root in self.servers:
                tg.start_soon(one, client, root)
        if failed:
            raise WeightSyncError(failed, synced)

    async def _push_to(
        self, client: httpx.AsyncClient, root: str, path: str, version: int, deadline: float
    ) -> None:
        before = await self._retried(lambda: self._version_of(client, root), deadline)
        route, body = self.request(path, version)

        async def post() -> httpx.Response:
            answer = await client.post(f"{root}{route}", json=body)
            if not answer.is_success:
                message = error_excerpt(answer.content)
                try:  # FastAPI's {"detail": ...}, SGLang's {"message": ...}
                    data = answer.json()
                    message = shorten(str(data.get("detail") or data.get("message") or message))
                except (ValueError, AttributeError):
                    pass
                raise _Refused(answer.status_code, message)
            why = self.refusal(answer)
            if why is not None:
                raise _Refused(answer.status_code, why, transient=False)
            return answer

        answer = await self._retried(post, deadline)
        for followup in self.followups():

            async def after_update(route: str = followup) -> None:
                done = await client.post(f"{root}{route}")
                if not done.is_success:
                    why = f"{route} after the update: {error_excerpt(done.content)}"
                    raise _Refused(done.status_code, why)

            await self._retried(after_update, deadline)
        after = await self._retried(lambda: self._version_of(client, root), deadline)
        if after is None:
            after = answer.headers.get("x-weight-version")
        expected = self.expected_version(version)
        if after is None:
            return  # the server does not say which weights it serves
        if expected is not None and after != expected:
            raise _NotTaken(
                f"answered the update but reports weight version {after!r}, not {expected!r}"
            )
        if expected is None and before is not None and after == before:
            raise _NotTaken(f"answered the update but still reports weight version {after!r}")

    async def _retried(self, call: Callable[[], Awaitable[_T]], deadline: float) -> _T:
        async for attempt in retrying.attempts("weight_sync", self.budget, deadline=deadline):
            with attempt:
                return await call()
        raise AssertionError("unreachable: attempts end in a result or an exception")

    async def _version_of(self, client: httpx.AsyncClient, root: str) -> str | None:
        """The weight version ``root`` reports, or None if it reports none."""
        answer = await client.get(f"{root}/get_weight_version")
        if answer.status_code in (404, 405):  # not SGLang (vLLM: no such route)
            return None
        if not answer.is_success:
            raise _Refused(answer.status_code, error_excerpt(answer.content))
        try:
            value = answer.json().get("weight_version")
        except (ValueError, AttributeError):
            return None
        return None if value is None else str(value)


class SGLangDiskSync(_HttpSync):
    """SGLang's ``POST /update_weights_from_disk`` on every server.

    The body is ``{"model_path": <source>, "weight_version": "<version>"}``
    (and ``abort_all_requests`` when asked: running generations are cut
    instead of waited for); the servers then report ``<version>`` on
    ``GET /get_weight_version``, which is checked.

    Args:
        base_urls: the servers (``policy.servers``; a trailing ``/v1`` is dropped).
        api_key: sent as ``Authorization: Bearer``, if the servers want one.
        timeout_s: the whole push (default ``timeouts.weight_sync_s``).
        budget: each server's tries (default ``retries.weight_sync_*``).
        abort_all_requests: SGLang's flag of the same name.
        load_format: SGLang's ``load_format`` (None: the server's).
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
        budget: Budget | None = None,
        abort_all_requests: bool = False,
        load_format: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_urls, api_key=api_key, timeout_s=timeout_s, budget=budget, transport=transport
        )
        self.abort_all_requests = abort_all_requests
        self.load_format = load_format

    def request(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model_path": path, "weight_version": str(version)}
        if self.abort_all_requests:
            body["abort_all_requests"] = True
        if self.load_format is not None:
            body["load_format"] = self.load_format
        return "/update_weights_from_disk", body

    def refusal(self, answer: httpx.Response) -> str | None:
        try:
            data = answer.json()
        except ValueError:
            return None
        if isinstance(data, dict) and data.get("success") is False:
            return shorten(str(data.get("message") or "success: false"))
        return None

    def expected_version(self, version: int) -> str | None:
        return str(version)


class VLLMReloadSync(_HttpSync):
    """vLLM's ``POST /collective_rpc`` calling ``reload_weights`` on every server.

    The body is ``{"method": "reload_weights", "kwargs": {"weights_path":
    <source>}}``: each worker reloads the checkpoint in that directory (vLLM's
    ``LLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})``).
    Then ``POST /reset_prefix_cache``: the cached prefixes were computed with
    the old weights. Both routes exist only on a server started with
    ``VLLM_SERVER_DEV_MODE=1`` (a 404 says it was not). vLLM reports no weight
    version; a server that does (``/get_weight_version``, ``X-Weight-Version``)
    must report a new one.

    Args:
        base_urls: the servers (``policy.servers``; a trailing ``/v1`` is dropped).
        api_key: sent as ``Authorization: Bearer``, if the servers want one.
        timeout_s: the whole push (default ``timeouts.weight_sync_s``).
        budget: each server's tries (default ``retries.weight_sync_*``).
        path_kwarg: the name of ``reload_weights``' path argument.
        reset_prefix_cache: POST ``/reset_prefix_cache`` after the reload.
        transport: an httpx transport (tests).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
        budget: Budget | None = None,
        path_kwarg: str = "weights_path",
        reset_prefix_cache: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            base_urls, api_key=api_key, timeout_s=timeout_s, budget=budget, transport=transport
        )
        self.path_kwarg = path_kwarg
        self.reset_prefix_cache = reset_prefix_cache

    def request(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        return "/collective_rpc", {"method": "reload_weights", "kwargs": {self.path_kwarg: path}}

    def followups(self) -> tuple[str, ...]:
        return ("/reset_prefix_cache",) if self.reset_prefix_cache else ()


# ---------------------------------------------------------------- a callable


class CallableSync:
    """Your own push: ``fn(source, version)``, a function or a coroutine function.

    Called once per sync (it reaches the servers itself), retried when it
    raises a transient error (a timeout, a connection error, an exception with
    a 408/425/429/5xx ``status_code``), within ``timeout_s``. A synchronous
    ``fn`` runs in a worker thread; past the deadline it is left to finish
    there and the sync fails.

    Args:
        fn: ``fn(source, version)``; its return value is ignored.
        timeout_s: the whole push (default ``timeouts.weight_sync_s``).
        budget: the tries (default ``retries.weight_sync_*``).
    """

    def __init__(
        self,
        fn: Callable[[Any, int], Any],
        *,
        timeout_s: float | None = None,
        budget: Budget | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallableSync takes a function, not {type(fn).__name__}")
        self.fn = fn
        self.timeout_s = TimeoutSettings().weight_sync_s if timeout_s is None else timeout_s
        self.budget = budget or RetrySettings().weight_sync_budget
        self._one_push = anyio.CapacityLimiter(1)  # a sync fn's worker thread

    def __repr__(self) -> str:
        return f"CallableSync({getattr(self.fn, '__qualname__', self.fn)!r})"

    async def push(self, source: Any, *, version: int) -> None:
        """Call ``fn(source, version)``.

        Raises:
            WeightSyncError: it raised (after its retries) or passed ``timeout_s``.
        """
        name = str(getattr(self.fn, "__qualname__", type(self.fn).__name__))
        try:
            with fail_after(self.timeout_s):
                deadline = now() + self.timeout_s
                async for attempt in retrying.attempts(
                    "weight_sync", self.budget, deadline=deadline
                ):
                    with attempt:
                        await self._call(source, version)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # the boundary: the user's function failed
            raise WeightSyncError({name: _why(exc, self.timeout_s)}) from exc

    async def _call(self, source: Any, version: int) -> None:
        if inspect.iscoroutinefunction(self.fn):
            await self.fn(source, version)
            return
        result = await anyio.to_thread.run_sync(
            self.fn, source, version, limiter=self._one_push, abandon_on_cancel=True
        )
        if inspect.isawaitable(result):  # a callable object whose __call__ is async
            await result
