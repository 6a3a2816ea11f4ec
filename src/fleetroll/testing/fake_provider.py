"""A provider double for unit tests: no sockets, no subprocesses.

:class:`FakeProvider` implements :class:`fleetroll.environments.provider.Provider`
(mypy checks it against the protocol) over an in-memory MCP server, so the
rollout state machine runs for real in milliseconds: provisioning, reset,
tool calls over a real MCP session, verification and release.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
from mcp import Client
from mcp.server.mcpserver import MCPServer

from fleetroll.environments.provider import Instance, Provider, Verdict
from fleetroll.errors import ProvisionError
from fleetroll.policies import ToolSpec
from fleetroll.results import VerifierOutcome
from fleetroll.settings import ModalitySettings, TimeoutSettings
from fleetroll.tasks import TaskSpec
from fleetroll.tools.mcp_client import SdkClient
from fleetroll.tools.routing import Route, route, wants_final_answer
from fleetroll.tools.session import ToolSession

__all__ = ["FakeProvider", "FakeState", "Operation"]

#: The operations a :class:`FakeProvider` can be told never to finish (``hangs``).
Operation = Literal["reset", "open_tools", "list_tools"]


@dataclass
class FakeState:
    """One fake instance: what its tools did, for the verifier to read."""

    instance_id: str
    calls: list[str] = field(default_factory=list)
    alive: bool = True


class FakeProvider:
    """Instances that live in a dict; tools ``note`` (records a word) and ``hang``.

    The verifier's reward is 1.0 when a ``note`` call recorded the word
    ``"done"``, else 0.0. Knobs make each operation fail the way a real
    environment can; ``hangs`` names operations that never finish (a hung
    reset, an MCP service that never answers, a listing that never ends).

    ``modalities`` is the routing table (``Settings.modalities``); ``timeouts``
    bound its tool sessions' calls and listings (``call_tool_s``, ``list_tools_s``).
    """

    def __init__(
        self,
        modalities: dict[str, ModalitySettings],
        *,
        timeouts: TimeoutSettings | None = None,
        provision_error: ProvisionError | None = None,
        verify_error: str | None = None,
        preflight_problems: Sequence[str] = (),
        reset_error: Exception | None = None,
        reset_required: bool = False,
        hangs: Collection[Operation] = (),
    ) -> None:
        self.modalities = modalities
        self.timeouts = timeouts or TimeoutSettings()
        self.hangs = frozenset(hangs)
        self.preflight_problems = list(preflight_problems)
        self.preflights = 0
        self.provision_error = provision_error
        self.verify_error = verify_error
        self.reset_error = reset_error
        #: Its instances are fresh only once reset (as a shared server's are).
        self.reset_required = reset_required
        self.states: dict[str, FakeState] = {}
        self.released: list[str] = []
        self.resets = 0
        #: Each reset's (seed, timestamp), in order.
        self.reset_points: list[tuple[int | None, int | None]] = []
        self._ids = itertools.count(1)

    @staticmethod
    def _server(state: FakeState) -> MCPServer:
        server = MCPServer("fake")

        @server.tool(description="Write a word into the instance's notes.")
        def note(word: str) -> str:
            state.calls.append(word)
            return f"noted {word}"

        @server.tool(description="Never answers.")
        async def hang() -> str:
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        return server

    @property
    def running(self) -> int:
        return sum(1 for s in self.states.values() if s.alive)

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        await anyio.lowlevel.checkpoint()
        self.preflights += 1
        return list(self.preflight_problems)

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        await anyio.lowlevel.checkpoint()
        if self.provision_error is not None:
            raise self.provision_error
        state = FakeState(f"fake-{next(self._ids)}")
        self.states[state.instance_id] = state
        return Instance(
            state.instance_id,
            1,
            0.0,
            time.monotonic(),
            handle=state,
            reset_required=self.reset_required,
        )

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        await anyio.lowlevel.checkpoint()
        self.resets += 1
        self.reset_points.append((task.seed, task.timestamp))
        if self.reset_error is not None:
            raise self.reset_error
        await self._maybe_hang("reset")
        assert isinstance(instance.handle, FakeState)
        instance.handle.calls.clear()  # back to its seed: no notes

    async def _maybe_hang(self, operation: Operation) -> None:
        if operation in self.hangs:
            await anyio.sleep_forever()

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        return route(
            task.modality,
            self.modalities,
            f"memory://{instance.instance_id}/",
            final_answer=wants_final_answer(
                requires=task.requires_final_answer, verifier=task.verifier_func, prompt=task.prompt
            ),
        )

    @asynccontextmanager
    async def open_tools(self, instance: Instance, route: Route) -> AsyncIterator[ToolSession]:
        assert isinstance(instance.handle, FakeState)
        t = self.timeouts
        await self._maybe_hang("open_tools")
        async with Client(self._server(instance.handle)) as client:
            session = _HangingListing if "list_tools" in self.hangs else ToolSession
            yield session(
                SdkClient(client),
                route.url,
                call_timeout_s=t.call_tool_s,
                list_timeout_s=t.list_tools_s,
            )

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        assert isinstance(instance.handle, FakeState)
        if self.verify_error is not None:
            return Verdict(None, VerifierOutcome(success=False, error=self.verify_error), "Boom")
        reward = 1.0 if "done" in instance.handle.calls else 0.0
        return Verdict(reward, VerifierOutcome(success=True, stdout=""))

    async def is_alive(self, instance: Instance) -> bool:
        return self.states[instance.instance_id].alive

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        self.states[instance.instance_id].alive = False
        self.released.append(instance.instance_id)
        return True

    async def sweep(self, run_id: str) -> int:
        return 0

    async def aclose(self) -> None:
        pass


class _HangingListing(ToolSession):
    """A session whose tool listing never ends (``hangs={"list_tools"}``)."""

    async def list_tools(self) -> list[ToolSpec]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def _type_check(modalities: dict[str, ModalitySettings]) -> Provider:
    return FakeProvider(modalities)  # mypy: the double satisfies the protocol
