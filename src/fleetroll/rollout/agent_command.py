"""Bring your own agent: a command that acts for each rollout (``--agent-command``).

Per rollout, once its instance is ready, :class:`CommandAgent` starts the
command contained (:mod:`fleetroll.rollout.agent_process`: a PID namespace of
its own, or a subreaper) in its own working directory, with an environment
that holds only ``PATH``, ``HOME``, ``LANG`` and:

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: the rollout's root on the
  :mod:`fleetroll.policies.gateway` and its key (never the real server's): every call
  goes to the policy servers, held while the policy is paused, recorded as
  one of the rollout's ``turns`` (token ids and logprobs asked for as
  ``policy.*`` says), refused once the rollout has ended; its ``/responses``
  (OpenAI's Responses API) is translated to the chat route and recorded alike;
- ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``: the same rollout's root and
  key for a Claude-style agent (the ``anthropic`` SDK reads both): its
  ``/v1/messages`` calls are translated to the policy server's chat route and
  recorded alike;
- ``FLEETROLL_MCP_URL``: the instance's MCP endpoint for the task's modality,
  through the rollout's relay (:mod:`fleetroll.rollout.agent_link`);
- ``FLEETROLL_TASK_FILE``: a JSON file with the task's key, prompt, modality
  and metadata;
- ``FLEETROLL_ANSWER_FILE``: where the agent may write its final answer,
  read (``policy.agent_max_answer_file_bytes``) for the verifier once it exits.

The process's exit ends the acting phase (and every process it left); the
rollout's deadline ends them all (SIGTERM, then SIGKILL
``policy.agent_kill_grace_s`` later), and so does the rollout's end for any
other reason (its step budget spent, a cancel). Its output goes to a log capped
at ``policy.agent_max_log_bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self

import anyio

from fleetroll.errors import PolicyError
from fleetroll.policies.gateway import Gateway
from fleetroll.policies.openai import ChatPolicyConfig, OpenAIChatPolicy
from fleetroll.policies.servers import current_affinity
from fleetroll.policies.turns import AssistantTurn, Message, ToolSpec
from fleetroll.rollout.agent_link import AgentLink
from fleetroll.rollout.agent_process import (
    AgentLimits,
    AgentRecords,
    Sandbox,
    containment,
    start_agent,
)
from fleetroll.rollout.machine import Rollout
from fleetroll.tasks import TaskSpec

__all__ = ["AgentHost", "AgentRecipe", "CommandAgent"]

_log = logging.getLogger(__name__)
#: The variables of fleetroll's own environment an agent gets (nothing secret).
_PASSED = ("PATH", "HOME", "LANG")
#: How much of the end of an agent's output a warning about its exit quotes.
_TAIL_CHARS = 600
#: Closing an agent's policy (an HTTP client): bounded, shielded. Not a setting:
#: closing a client does no I/O worth waiting for longer.
_CLOSE_S = 5.0


class CommandAgent:
    """Runs ``command`` as the agent of each rollout (see the module's docstring).

    Give it to a pool's ``run_batch`` (or :meth:`Rollout.run`) in place of a
    policy, inside ``async with`` (which serves its gateway)::

        async with CommandAgent("python my_agent.py", OpenAIChatPolicy(...)) as agent:
            batch = pool.run_batch(tasks, agent)

    Args:
        command: a shell-like string (split as a shell would, not run by one)
            or an argv.
        policy: where the agent's calls go, and how token data is asked for.
        kill_grace_s, max_request_bytes, max_answer_file_bytes, max_log_bytes,
            sandbox: ``policy.agent_*``.
        owns_policy: close ``policy`` when the agent is closed.
        gateway: a gateway someone else serves (one for many agents, as the
            HTTP service's); by default the agent serves its own.
        records: where the agents' inits are noted, so that the next start on
            the same folder ends any a killed fleetroll left (opened by whoever
            made them: :class:`fleetroll.rollout.agent_process.AgentRecords`).
    """

    def __init__(
        self,
        command: str | Sequence[str],
        policy: OpenAIChatPolicy,
        *,
        kill_grace_s: float = 2.0,
        max_request_bytes: int = 64 * 1024 * 1024,
        max_answer_file_bytes: int = 1024 * 1024,
        max_log_bytes: int = 16 * 1024 * 1024,
        sandbox: Sandbox = "auto",
        owns_policy: bool = False,
        gateway: Gateway | None = None,
        records: AgentRecords | None = None,
    ) -> None:
        self.argv = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.argv:
            raise ValueError("the agent command is empty")
        self.policy = policy
        self.kill_grace_s = kill_grace_s
        self.max_answer_file_bytes = max_answer_file_bytes
        self.limits = AgentLimits(kill_grace_s, max_log_bytes, sandbox)
        self.records = records
        self._owns_policy = owns_policy
        self._owns_gateway = gateway is None
        self._gateway = gateway or Gateway(max_request_bytes=max_request_bytes)
        #: What makes this agent in another process (:class:`AgentRecipe`): set by
        #: :meth:`from_config`, and one key per agent, so a process makes it once.
        self._recipe: AgentRecipe | None = None

    @classmethod
    def from_config(
        cls,
        command: str | Sequence[str],
        config: ChatPolicyConfig,
        *,
        gateway: Gateway | None = None,
        records: AgentRecords | None = None,
    ) -> Self:
        """An agent whose calls go to ``config.policy``'s servers (it owns that
        policy), with ``config.policy``'s ``agent_*`` limits."""
        p = config.policy
        agent = cls(
            command,
            OpenAIChatPolicy.from_config(config),
            kill_grace_s=p.agent_kill_grace_s,
            max_request_bytes=p.agent_max_request_bytes,
            max_answer_file_bytes=p.agent_max_answer_file_bytes,
            max_log_bytes=p.agent_max_log_bytes,
            sandbox=p.agent_sandbox,
            owns_policy=True,
            gateway=gateway,
            records=records,
        )
        agent._recipe = AgentRecipe(uuid.uuid4().hex, tuple(agent.argv), config)
        return agent

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to a Ray actor), an agent travels as its :class:`AgentRecipe`.

        Raises:
            TypeError: the agent was not made with :meth:`from_config`.
        """
        if self._recipe is None:
            raise TypeError(
                "a CommandAgent runs in another process (Ray) only when made with"
                " CommandAgent.from_config: its policy is rebuilt there from its configuration"
            )
        return (AgentRecipe, tuple(self._recipe))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({shlex.join(self.argv)!r}, {self.policy!r})"

    async def __aenter__(self) -> Self:
        # How agents are contained here, found now: a sandbox that cannot be had
        # fails the start, not each rollout.
        await anyio.to_thread.run_sync(containment, self.limits.sandbox)
        if self._owns_gateway:
            await self._gateway.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._owns_gateway:
                await self._gateway.__aexit__(exc_type, exc, tb)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the policy, if the agent owns it."""
        if self._owns_policy:
            await self.policy.aclose()

    async def act(
        self, task: TaskSpec, messages: Sequence[Message], tools: Sequence[ToolSpec]
    ) -> AssistantTurn:
        """Not a turn-by-turn policy: it acts for whole rollouts (:meth:`drive`)."""
        raise PolicyError(
            "an agent command acts for whole rollouts; it cannot answer one turn"
            " (use it with run_batch or fleetroll run, not an env session)",
            operation="policy",
            transient=False,
        )

    async def drive(self, rollout: Rollout) -> None:
        """Run the command for ``rollout`` until it exits (or the rollout ends)."""
        if rollout.route is None:
            raise RuntimeError("the rollout has no MCP route: drive it once it is ready")
        root = Path(await anyio.to_thread.run_sync(tempfile.mkdtemp, None, "fleetroll-agent-"))
        try:
            await self._drive_in(rollout, root, rollout.route.url)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(shutil.rmtree, root, True)

    async def _drive_in(self, rollout: Rollout, root: Path, mcp_url: str) -> None:
        task = rollout.task
        workdir, task_file, answer_file, log_file = (
            root / "work",
            root / "task.json",
            root / "answer.txt",
            root / "agent.log",
        )
        await anyio.Path(workdir).mkdir()
        about = {
            "key": task.key,
            "prompt": task.prompt,
            "modality": task.modality,
            "metadata": task.metadata,
        }
        await anyio.Path(task_file).write_text(json.dumps(about, ensure_ascii=False))
        link = AgentLink(
            rollout,
            self.policy,
            current_affinity(),
            mcp_url=mcp_url,
            max_request_bytes=self._gateway.max_request_bytes,
        )
        with self._gateway.open(link) as opened:
            base_url, key, relay_url = opened
            env = {name: os.environ[name] for name in _PASSED if name in os.environ}
            env |= {
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": key,
                "ANTHROPIC_BASE_URL": opened.anthropic_base_url,
                "ANTHROPIC_API_KEY": key,
                "FLEETROLL_MCP_URL": relay_url,  # the instance's, through the rollout's relay
                "FLEETROLL_TASK_FILE": str(task_file),
                "FLEETROLL_ANSWER_FILE": str(answer_file),
            }
            log = await anyio.to_thread.run_sync(log_file.open, "wb")
            with log:  # the process has its own copy of the descriptor
                process = await start_agent(
                    self.argv,
                    cwd=workdir,
                    env=env,
                    log=log,
                    limits=self.limits,
                    records=self.records,
                )
            try:
                async with anyio.create_task_group() as tg:

                    async def ended() -> None:
                        await link.ended.wait()  # the rollout ended: stop its agent
                        tg.cancel_scope.cancel()

                    tg.start_soon(ended)
                    await process.wait()
                    tg.cancel_scope.cancel()
            finally:
                link.end()
                await process.stop(grace_s=self.kill_grace_s, wait_s=self.kill_grace_s)
        progress = rollout.progress
        if progress.reason is None:
            answer = await _read_capped(answer_file, self.max_answer_file_bytes)
            if answer is not None:
                progress.final_answer = answer
            progress.finished = True
        if process.returncode:
            tail = await _read_tail(log_file)
            _log.warning(
                "the agent command of rollout %s exited with %s; its output ends: %s",
                rollout.ids.rollout_id,
                process.returncode,
                rollout.engine.redactor(tail),
            )


class AgentRecipe(NamedTuple):
    """What makes a :class:`CommandAgent` in another process (a Ray actor): pickled
    in its place. ``key`` is the agent's own, so a process makes each agent once
    (:class:`AgentHost`), with its own gateway on that process's loopback."""

    key: str
    argv: tuple[str, ...]
    config: ChatPolicyConfig


class AgentHost:
    """The agents of one process made from recipes, and the one gateway they share.

    An agent lives while rollouts use it (:meth:`agent`): the last to end closes
    it (its HTTP client), and the next rollout of its batch makes it again. The
    gateway is kept for the process's life: a Ray actor holds one and is killed,
    never closed, so the gateway goes with the process.
    """

    def __init__(self) -> None:
        self._agents: dict[str, tuple[CommandAgent, int]] = {}
        self._gateway: Gateway | None = None
        self._stack = AsyncExitStack()
        self._making = anyio.Lock()

    async def aclose(self) -> None:
        """Stop the gateway, from the task (and cancel scope) that made the first agent."""
        await self._stack.aclose()

    @asynccontextmanager
    async def agent(self, recipe: AgentRecipe) -> AsyncIterator[CommandAgent]:
        """The agent ``recipe`` makes (the same one for the same key while in use)."""
        async with self._making:
            agent, users = self._agents.get(recipe.key, (None, 0))
            if agent is None:
                if self._gateway is None:
                    limit = recipe.config.policy.agent_max_request_bytes
                    self._gateway = await self._stack.enter_async_context(
                        Gateway(max_request_bytes=limit)
                    )
                agent = CommandAgent.from_config(recipe.argv, recipe.config, gateway=self._gateway)
            self._agents[recipe.key] = (agent, users + 1)
        try:
            yield agent
        finally:
            agent, users = self._agents[recipe.key]
            if users > 1:
                self._agents[recipe.key] = (agent, users - 1)
            else:
                del self._agents[recipe.key]
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_S):
                    await agent.aclose()


async def _read_capped(path: Path, limit: int) -> str | None:
    """The first ``limit`` bytes of ``path`` as text, or None when there is no such file."""

    def read() -> str | None:
        try:
            with open(path, "rb") as f:
                return f.read(limit).decode("utf-8", "replace")
        except FileNotFoundError:
            return None

    return await anyio.to_thread.run_sync(read)


async def _read_tail(path: Path) -> str:
    def read() -> str:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_CHARS))
            return f.read().decode("utf-8", "replace").strip()

    return await anyio.to_thread.run_sync(read)
