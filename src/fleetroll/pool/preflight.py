"""Checks before a batch provisions anything: a typo should cost seconds, not a batch.

``fleetroll run`` calls :func:`preflight` once the Fleet it runs on is known
and before the pool makes its first instance:

* the environment provider's own checks (:meth:`Provider.preflight
  <fleetroll.environments.provider.Provider.preflight>`): for Fleet, the control plane
  answers, the key is accepted, and every distinct ``env_key:version`` of the
  batch is in its environment listing;
* for ``policy.kind = "openai"``, the policy endpoint answers ``GET /models``;
  with ``policy.token_in``, it also serves token-in's two routes (with
  ``token_in = "completions"``: ``/v1/completions``, and ``policy.tokenizer``
  loads here).

Every problem found is one line of one :class:`~fleetroll.errors.PreflightError`;
no line holds a key. ``fleetroll run --no-preflight`` skips all of this.

``fleetroll serve`` runs the same checks on every batch it is sent
(:mod:`fleetroll.service.preflight`), reusing the answers that are cheap to
keep (:class:`~fleetroll._internal.preflight_cache.PreflightCache`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import httpx
from pydantic import SecretStr

from fleetroll._internal.preflight_cache import PreflightCache
from fleetroll.errors import PreflightError
from fleetroll.tasks.names import missing_environments

if TYPE_CHECKING:
    from fleetroll.environments.provider import Provider
    from fleetroll.settings.sections import PolicySettings
    from fleetroll.tasks import TaskSpec

__all__ = [
    "PreflightCache",
    "check_completions",
    "check_endpoint",
    "check_policy",
    "check_token_in",
    "check_tokenizer",
    "missing_environments",
    "preflight",
]


def _shown(url: str) -> str:
    """``url`` without any user or password in it."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return "(an invalid URL)"
    return str(parsed.copy_with(userinfo=b"")) if parsed.userinfo else url


async def check_policy(
    policy: PolicySettings, *, api_key: SecretStr | None, timeout_s: float
) -> list[str]:
    """For ``policy.kind = "openai"``: every server answers ``GET {base_url}/models``
    (with ``api_key``), each check bounded by ``timeout_s`` (``timeouts.preflight_s``).

    One problem line per server that does not (no answer, a refused key, an
    error status: likely a wrong ``--base-url``); empty otherwise, and always
    for the scripted policy. With many servers (``policy.base_urls``) one dead
    server at the start fails the pre-flight too: a batch starts on the
    servers it was given; a server that dies later is ejected instead.
    """
    if policy.kind != "openai":
        return []
    problems: dict[int, list[str]] = {}

    async def check(index: int, base_url: str) -> None:
        found = await check_endpoint(base_url, api_key, timeout_s)
        if not found and policy.token_in == "completions":
            found = await check_completions(base_url, api_key, timeout_s)
        elif not found and policy.token_in:
            found = await check_token_in(base_url, policy.model, api_key, timeout_s)
        problems[index] = found

    async with anyio.create_task_group() as tg:
        for index, base_url in enumerate(policy.servers):
            tg.start_soon(check, index, base_url)
    lines = [line for index in sorted(problems) for line in problems[index]]
    if policy.token_in == "completions":
        lines += await check_tokenizer(policy.tokenizer or policy.model)
    return lines


async def check_tokenizer(name: str) -> list[str]:
    """With ``policy.token_in = "completions"``: the tokenizer ``name`` loads
    (in this process, once: the policy reuses it) and has a chat template."""
    from fleetroll.errors import PolicyError
    from fleetroll.policies.chat_template import load_template

    try:
        await load_template(name)
    except PolicyError as exc:
        return [str(exc)]
    return []


async def check_completions(
    base_url: str, api_key: SecretStr | None, timeout_s: float
) -> list[str]:
    """With ``policy.token_in = "completions"``: the endpoint serves ``POST
    {base_url}/completions``. Nothing is generated: an empty body, which a
    server with the route refuses as invalid (400/422) and one without it
    answers 404 or 405."""
    url = f"{base_url.rstrip('/')}/completions"
    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    try:
        with anyio.fail_after(timeout_s):
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                status = (await http.post(url, json={}, headers=headers)).status_code
    except TimeoutError:
        return [f"the policy endpoint's POST {_shown(url)} did not answer within {timeout_s:g} s"]
    except (httpx.HTTPError, ValueError) as exc:
        return [f"the policy endpoint's POST {_shown(url)} failed with {type(exc).__name__}"]
    if status in (404, 405):
        return [
            f'policy.token_in = "completions" needs POST {_shown(url)}, which answered'
            f" {status}: serve the model with an OpenAI-compatible server that has"
            " /v1/completions (vLLM, SGLang) or set policy.token_in = false"
        ]
    return []


async def check_token_in(
    base_url: str, model: str, api_key: SecretStr | None, timeout_s: float
) -> list[str]:
    """With ``policy.token_in``: the endpoint serves ``POST {root}/tokenize`` and
    ``POST {base_url}/chat/completions/tokens`` (docs/configuration.md).

    Nothing is generated: the tokens route is sent an empty body, which a
    server that has it refuses as invalid (400/422) and one without it answers
    404 or 405. One problem line per missing route.
    """
    base = base_url.rstrip("/")
    tokenize = base.removesuffix("/v1") + "/tokenize"
    tokens = f"{base}/chat/completions/tokens"
    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    probes: tuple[tuple[str, dict[str, Any]], ...] = (
        (tokenize, {"model": model, "messages": [{"role": "user", "content": "ping"}]}),
        (tokens, {}),
    )
    problems = []
    try:
        with anyio.fail_after(timeout_s):
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                for url, body in probes:
                    status = (await http.post(url, json=body, headers=headers)).status_code
                    if status in (404, 405) or (url == tokenize and status >= 400):
                        problems.append(
                            f"policy.token_in needs POST {_shown(url)}, which answered {status}:"
                            " serve the model with a server that has token-in's routes"
                            " (prime-rl's vLLM server; see docs/configuration.md) or set"
                            " policy.token_in = false"
                        )
    except TimeoutError:
        return [f"the policy endpoint's token-in routes did not answer within {timeout_s:g} s"]
    except (httpx.HTTPError, ValueError) as exc:
        return [f"the policy endpoint's token-in routes failed with {type(exc).__name__}"]
    return problems


async def check_endpoint(
    base_url: str,
    api_key: SecretStr | None,
    timeout_s: float,
    *,
    cache: PreflightCache[bool] | None = None,
) -> list[str]:
    """An OpenAI-compatible endpoint answers ``GET {base_url}/models`` within ``timeout_s``.

    One problem line when it does not; with a ``cache``, an endpoint (and
    key) that answered within its time to live is not asked again.
    """
    base = base_url.rstrip("/")
    if cache is None:
        return await _models_answer(base, api_key, timeout_s)
    # The key is part of what answered, but never kept: only a digest of it.
    secret = api_key.get_secret_value() if api_key else ""
    key = "policy " + hashlib.sha256(f"{base}\n{secret}".encode()).hexdigest()
    async with cache.lock(key):
        if cache.get(key):
            return []
        problems = await _models_answer(base, api_key, timeout_s)
        if not problems:
            cache.put(key, True)
    return problems


async def _models_answer(base: str, key: SecretStr | None, timeout_s: float) -> list[str]:
    timeout = timeout_s
    url = f"{base}/models"
    shown = _shown(url)
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
    try:
        with anyio.fail_after(timeout):
            async with httpx.AsyncClient(timeout=timeout) as http:
                response = await http.get(url, headers=headers)
    except TimeoutError:
        return [f"the policy endpoint did not answer GET {shown} within {timeout:g} s"]
    except (httpx.HTTPError, ValueError) as exc:
        return [
            f"the policy endpoint does not answer: GET {shown} failed with {type(exc).__name__}"
            " (is --base-url / policy.base_url right?)"
        ]
    status = response.status_code
    if status in (401, 403):
        return [f"the policy endpoint refused OPENAI_API_KEY: GET {shown} answered {status}"]
    if status >= 400:
        return [
            f"the policy endpoint answered {status} to GET {shown}"
            " (is --base-url / policy.base_url right? it usually ends in /v1)"
        ]
    return []


async def preflight(
    provider: Provider,
    tasks: Sequence[TaskSpec],
    policy: Callable[[], Awaitable[list[str]]],
    *,
    skip: str = "--no-preflight",
) -> None:
    """Run the provider's checks and the policy endpoint's (``policy``), together.

    ``policy`` is :func:`check_policy` of the settings for a run, the check of
    the policy a request names for the service; ``skip`` is what the error
    says turns it off.

    Raises:
        PreflightError: any check found a problem (all of them are in it).
    """
    found: dict[str, list[str]] = {}

    async def collect(name: str, check: Callable[[], Awaitable[list[str]]]) -> None:
        found[name] = await check()

    async with anyio.create_task_group() as tg:
        tg.start_soon(collect, "provider", lambda: provider.preflight(tasks))
        tg.start_soon(collect, "policy", policy)
    problems = found["provider"] + found["policy"]
    if problems:
        raise PreflightError(problems, skip=skip)
