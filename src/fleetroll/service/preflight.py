"""The service's pre-flight: a batch is checked as ``fleetroll run`` checks one.

``POST /v1/batches`` and the MCP tools' rollouts are checked here before the
batch reaches the pool that runs it (with ``serve --ray``: in the service's
process, before it is sharded over the actors): every distinct
``env_key:version`` exists, Fleet's control plane answers and accepts the key,
mcp servers can start or answer, the policy the request names answers. A
problem is a 422 with the pre-flight's one line (``type`` ``preflight_error``)
and nothing is provisioned.

A trainer posts a batch every few seconds, so the answers that are cheap to
keep are reused for ``service.preflight_cache_s``: Fleet's environment listing
(kept by the pool's Fleet provider) and each policy endpoint that answered
(kept here). ``service.preflight = false`` turns all of it off.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from pydantic import SecretStr

from fleetroll._internal.preflight_cache import PreflightCache
from fleetroll.errors import PreflightError
from fleetroll.pool.preflight import check_endpoint, preflight
from fleetroll.pool.rollout_pool import RolloutPool
from fleetroll.scoring.judge import missing_judge
from fleetroll.service.errors import ApiError
from fleetroll.service.models import PolicyConfig
from fleetroll.service.requests import policy_endpoint
from fleetroll.settings import JudgeSettings, PolicySettings, ServiceSettings, TimeoutSettings
from fleetroll.tasks import TaskSpec

__all__ = ["BatchPreflight"]

#: What a refused client is told turns the checks off.
_SKIP = "service.preflight = false on the server"


class BatchPreflight:
    """Checks batches before they are accepted, with ``pool``'s environment provider.

    Args:
        pool: the pool in this process (its provider makes the checks; on
            ``serve --ray`` batches run elsewhere, but are checked here).
    """

    def __init__(
        self,
        pool: RolloutPool,
        *,
        service: ServiceSettings,
        timeouts: TimeoutSettings,
        judge: JudgeSettings,
        policy: PolicySettings,
        openai_api_key: SecretStr | None,
    ) -> None:
        self._pool = pool
        self._service = service
        self._timeouts = timeouts
        self._judge = judge
        self._policy = policy
        self._openai_api_key = openai_api_key
        self._policies = PreflightCache[bool](service.preflight_cache_s)

    async def check(
        self, tasks: Sequence[TaskSpec], policy: PolicyConfig | None, *, loc: Sequence[str]
    ) -> None:
        """Pass, or refuse the batch (unless ``service.preflight`` is off).

        Raises:
            ApiError: 422 with the pre-flight's message, at ``loc``.
        """
        # Not a remote check: a judged task here would never get a reward.
        problem = missing_judge(tasks, self._judge)
        if problem is not None:
            raise ApiError(422, problem, loc=loc, type="preflight_error")
        if not self._service.preflight:
            return
        endpoint = policy_endpoint(policy, self._policy, self._openai_api_key)
        timeout = self._timeouts.preflight_s

        async def policy_problems() -> list[str]:
            if endpoint is None:  # scripted: nothing to ask
                return []
            servers, api_key = endpoint
            problems: dict[int, list[str]] = {}

            async def check_one(index: int, base_url: str) -> None:
                problems[index] = await check_endpoint(
                    base_url, api_key, timeout, cache=self._policies
                )

            # Each check is bounded by timeouts.preflight_s.
            async with anyio.create_task_group() as tg:
                for index, base_url in enumerate(servers):
                    tg.start_soon(check_one, index, base_url)
            return [line for index in sorted(problems) for line in problems[index]]

        try:
            await preflight(self._pool.engine.provider, tasks, policy_problems, skip=_SKIP)
        except PreflightError as exc:
            raise ApiError(422, str(exc), loc=loc, type="preflight_error") from None
