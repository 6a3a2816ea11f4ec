"""Any MCP server as an environment: the ``mcp`` provider (docs/tasks.md).

:class:`McpProvider` implements :class:`fleetroll.environments.provider.Provider` for
tasks that give ``environment`` instead of a Fleet ``env_key``:

* ``environment.command``: per rollout a fresh working directory
  (``tempfile.mkdtemp`` with the prefix ``fleetroll-mcp-`` under
  ``mcp.workdir_root``), ``files`` written into it, ``setup`` run there under
  ``mcp.setup_s``, then the stdio server started in its own process group
  with only the task's ``env`` and a minimal ``PATH``/``HOME`` (never
  fleetroll's environment, which holds its keys). Provisioning ends with an
  MCP handshake, so a server that cannot start is ``init_error`` with the
  last lines of its stderr. Each MCP session (the rollout's tools, a
  ``verifier.tool``) is a client over the running process's pipes.
* ``environment.url``: a streamable-HTTP server already running, connected
  with retries (:func:`fleetroll.tools.session.open_tool_session`), reset before
  each rollout when the task says how. Its state is shared, so provisioning
  waits for a lease on the URL (:mod:`fleetroll.environments.mcp.leases`, at most
  ``environment.max_concurrent_rollouts`` at once), held until release; and
  its instance is fresh only once reset (``Instance.reset_required``): a
  failed reset ends the rollout as ``reset_failed``.
* ``verifier.command`` runs in the working directory under
  ``timeouts.verifier_s`` in its own process group (killed on timeout), with
  the same minimal environment; ``verifier.tool`` is a call on the server.

Release kills the process group (SIGTERM, SIGKILL after ``mcp.kill_grace_s``)
and removes the working directory (unless ``mcp.keep_workdirs``); it is
shielded and bounded, and deletes only folders this provider made.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from subprocess import PIPE
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import httpx2
from anyio.abc import Process

import fleetroll.examples_mcp
from fleetroll._internal.deadlines import fail_after
from fleetroll._internal.proxies import Proxies
from fleetroll._internal.pydantic_plugins import skip_unused_pydantic_plugins
from fleetroll._internal.wire import Wire
from fleetroll.environments.mcp.leases import ServerLeases
from fleetroll.environments.mcp.process import (
    OUTPUT_KEPT,
    WORKDIR_PREFIX,
    Ran,
    make_workdir,
    no_reward,
    open_program,
    process_transport,
    remove_workdir,
    reward_number,
    run_command,
    stop_process,
    tool_reward,
)
from fleetroll.environments.provider import Instance, Verdict
from fleetroll.errors import ConfigError, OperationTimeout, ProvisionError, ToolsError
from fleetroll.results import VerifierOutcome
from fleetroll.settings import (
    McpSettings,
    ModalitySettings,
    PoolSettings,
    RetrySettings,
    TimeoutSettings,
)
from fleetroll.tasks import TaskSpec
from fleetroll.tasks.mcp import McpEnvironment, McpVerifier, ToolCallSpec
from fleetroll.tasks.verifier_results import verifier_reward_text
from fleetroll.telemetry.events import Events, Redactor
from fleetroll.telemetry.retries import retry_emitter
from fleetroll.tools.mcp_client import SdkClient
from fleetroll.tools.mcp_common import unfollowed
from fleetroll.tools.routing import Route, route
from fleetroll.tools.session import (
    AnswerLimits,
    BoundedAnswers,
    ToolSession,
    describe,
    open_tool_session,
)

if TYPE_CHECKING:
    from mcp import Client

__all__ = ["WORKDIR_PREFIX", "McpConfig", "McpHandle", "McpProvider", "public_url"]


@dataclass(eq=False)
class McpHandle:
    """One rollout's MCP environment (an :class:`Instance`'s handle)."""

    instance_id: str
    environment: McpEnvironment
    folder: Path  # made by mkdtemp (WORKDIR_PREFIX); the workdir and server.stderr live inside
    env: dict[str, str]  # the server's (and verifier's) whole environment
    run_id: str | None = None
    process: Process | None = None
    stdout_closed: anyio.Event = field(default_factory=anyio.Event)
    released: bool = False
    leased: bool = False  # holds a lease on its url server (ServerLeases)

    @property
    def workdir(self) -> Path:
        return self.folder / "work"

    @property
    def stderr_path(self) -> Path:
        return self.folder / "server.stderr"

    @property
    def label(self) -> str:
        """Where the tools are, for messages."""
        return self.environment.url or f"stdio://{self.instance_id}"


@dataclass(frozen=True, slots=True)
class McpConfig:
    """What :class:`McpProvider` reads of the settings, split out of them where
    the provider is built (:func:`fleetroll.pool.assembly.mcp_config`)."""

    timeouts: TimeoutSettings
    retries: RetrySettings
    mcp: McpSettings
    #: ``mcp_client`` and the MCP answers' caps (``max_tool_*_bytes``).
    pool: PoolSettings
    modalities: dict[str, ModalitySettings]


class McpProvider:
    """Environments that are MCP servers: a command started per rollout, or a URL."""

    def __init__(self, config: McpConfig, events: Events) -> None:
        self._config = config
        self._events = events
        self._live: dict[str, McpHandle] = {}
        #: Who may use each url server now (its rollouts' states must not mix).
        self.leases = ServerLeases()
        self._examples = str(Path(fleetroll.examples_mcp.__file__).resolve().parent)
        t = config.timeouts
        #: How many bytes of an MCP answer are read (``pool.max_tool_*_bytes``).
        self._limits = AnswerLimits.from_pool(config.pool)
        try:
            self._proxies = Proxies.from_environment()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        #: The thin MCP client's connections to url servers (pool.mcp_client).
        self._wire = (
            Wire(keepalive_s=t.http_keepalive_s, connect_timeout_s=t.mcp_connect_s)
            if config.pool.mcp_client == "thin"
            else None
        )

    # -- pre-flight -----------------------------------------------------------

    async def preflight(self, tasks: Sequence[TaskSpec]) -> list[str]:
        """Each command's executable is on PATH (or a file); each URL answers HTTP.

        What only exists once the working directory is made (a relative path,
        ``{workdir}``) is not checked. A URL answers when any HTTP status comes
        back within ``timeouts.preflight_s`` (only the status and headers are
        read), unless it redirects where no MCP client follows (another origin).
        """
        problems: list[str] = []
        urls: dict[str, int] = {}
        seen: set[str] = set()
        for task in tasks:
            environment = task.environment
            if environment is None:
                continue
            if environment.url is not None:
                urls[environment.url] = urls.get(environment.url, 0) + 1
            for what, argv in (("command", environment.command), ("setup", environment.setup)):
                if not argv or "{workdir}" in argv[0]:
                    continue
                exe = self._fill(argv[0], Path())
                if exe in seen:
                    continue
                seen.add(exe)
                if os.sep in exe:
                    found = not os.path.isabs(exe) or os.access(exe, os.X_OK)
                else:
                    found = shutil.which(exe, path=os.environ.get("PATH", os.defpath)) is not None
                if not found:
                    problems.append(
                        f"environment.{what} of task {task.key}: {exe!r} is not an executable"
                        " on PATH"
                    )
        for url, count in urls.items():
            problems += await self._url_answers(url, count)
        return problems

    async def _url_answers(self, url: str, count: int) -> list[str]:
        """One problem line when ``url`` gives no HTTP answer, or redirects where no
        MCP client follows (another host: every session would fail the same way)."""
        timeout = self._config.timeouts.preflight_s
        try:
            with fail_after(timeout):
                async with (
                    httpx.AsyncClient(timeout=timeout) as http,
                    http.stream("GET", url) as response,
                ):
                    # The status and headers are the answer; the body is never read
                    # (a stateless MCP server answers a GET with an SSE stream that
                    # does not end). Leaving closes the connection.
                    location = response.headers.get("location") if response.is_redirect else None
        except TimeoutError:
            return [f"MCP server {url} ({count} task(s)) did not answer within {timeout:g} s"]
        except httpx.HTTPError as exc:
            return [f"MCP server {url} ({count} task(s)) does not answer: {type(exc).__name__}"]
        why = None if location is None else unfollowed(url, location)
        if why is not None:
            return [f"MCP server {url} ({count} task(s)): {why}"]
        return []

    # -- provisioning ---------------------------------------------------------

    async def provision(self, task: TaskSpec, *, run_id: str | None = None) -> Instance:
        """A working directory and, for a ``command`` server, the server answering MCP;
        for a ``url`` server, a lease on it (waiting, cancellably, while
        ``environment.max_concurrent_rollouts`` rollouts hold one).

        Raises:
            ProvisionError: setup failed, the server did not start or answer
                the handshake within ``timeouts.mcp_connect_s`` (not transient:
                the same command fails the same way), or the folder cannot be made.
        """
        environment = _environment(task)
        began = time.monotonic()
        handle: McpHandle | None = None
        made: list[Path] = []  # the folder, as soon as it exists (a cancelled thread's too)
        ready = False
        try:
            folder = await anyio.to_thread.run_sync(
                make_workdir, self._config.mcp.workdir_root, environment.files, made
            )
            handle = McpHandle(
                instance_id=f"mcp-{uuid.uuid4().hex[:12]}",
                environment=environment,
                folder=folder,
                env=self._minimal_env(environment.env, folder / "work"),
                run_id=run_id,
            )
            self._live[handle.instance_id] = handle
            if environment.command is not None:
                await self._setup(handle, task)
                await self._start(handle)
            else:
                assert environment.url is not None
                limit = environment.max_concurrent_rollouts
                await self.leases.acquire(environment.url, limit, handle)
                handle.leased = True  # given back by _release, on every path
            ready = True
        except (ProvisionError, OSError, TimeoutError, ToolsError) as exc:
            error = exc if isinstance(exc, ProvisionError) else self._provision_error(exc, handle)
            self._events.emit(
                "fleet_make_failed",
                level="error",
                attempt=1,
                error_type=type(exc).__name__,
                error_message=str(error)[:500],
                status_code=None,
            )
            raise error from exc
        finally:
            if not ready and handle is not None:
                await self._release(handle)  # shielded and bounded, even when cancelled
            elif not ready and made and not self._config.mcp.keep_workdirs:
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(self._config.timeouts.release_s),
                    suppress(OSError),  # best effort: the original error is the news
                ):
                    await anyio.to_thread.run_sync(self._remove, made[0])
        elapsed = time.monotonic() - began
        self._events.emit(
            "fleet_provisioning_completed",
            provisioning_time_s=round(elapsed, 4),
            attempts=1,
            instance_id=handle.instance_id,
        )
        return Instance(
            handle.instance_id,
            1,
            elapsed,
            time.monotonic(),
            handle=handle,
            # A url server keeps the last rollout's state: fresh only once reset.
            reset_required=environment.url is not None,
            placeholders=self._placeholders(handle.workdir),
        )

    def _provision_error(self, exc: BaseException, handle: McpHandle | None) -> ProvisionError:
        what = "starting the MCP server" if handle and handle.process else "setting up the server"
        if isinstance(exc, TimeoutError):
            why = f"no MCP handshake within {self._config.timeouts.mcp_connect_s:g} s"
        else:
            why = f"{type(exc).__name__}: {exc}"
        return ProvisionError(f"{what} failed: {why}{self._stderr_tail(handle)}", transient=False)

    def _minimal_env(self, given: Mapping[str, str], workdir: Path) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": os.environ.get("HOME", "/")}
        env.update({k: self._fill(v, workdir) for k, v in given.items()})
        skip_unused_pydantic_plugins(env)  # a server per rollout: its start-up counts
        return env

    def _placeholders(self, workdir: Path) -> dict[str, str]:
        """What each of :data:`~fleetroll.tasks.mcp.PLACEHOLDERS` stands for in a rollout."""
        return {"{workdir}": str(workdir), "{python}": sys.executable, "{examples}": self._examples}

    def _fill(self, text: str, workdir: Path) -> str:
        for placeholder, value in self._placeholders(workdir).items():
            text = text.replace(placeholder, value)
        return text

    def _argv(self, command: Sequence[str], handle: McpHandle) -> list[str]:
        return [self._fill(part, handle.workdir) for part in command]

    async def _setup(self, handle: McpHandle, task: TaskSpec) -> None:
        setup = handle.environment.setup
        if setup is None:
            return
        timeout = self._config.mcp.setup_s
        ran = await self._run(self._argv(setup, handle), handle, timeout)
        if ran.timed_out or ran.returncode != 0:
            why = (
                f"took over {timeout:g} s (mcp.setup_s)"
                if ran.timed_out
                else f"exited with status {ran.returncode}"
            )
            tail = self._tail(ran.stderr or ran.stdout, self._redactor(handle))
            raise ProvisionError(f"environment.setup of {task.key} {why}{tail}", transient=False)

    async def _start(self, handle: McpHandle) -> None:
        assert handle.environment.command is not None
        argv = self._argv(handle.environment.command, handle)
        stderr = await anyio.to_thread.run_sync(handle.stderr_path.open, "wb")
        try:
            handle.process = await open_program(
                argv,
                cwd=handle.workdir,
                env=handle.env,
                stdin=PIPE,
                stdout=PIPE,
                stderr=stderr,
                start_new_session=True,  # its own process group, killed whole on release
            )
        finally:
            stderr.close()  # the child holds its own descriptor
        try:
            with fail_after(self._config.timeouts.mcp_connect_s):
                async with self._stdio_client(handle):
                    pass
        except Exception as exc:  # whatever the handshake raised (MCPError...): it cannot start
            raise self._provision_error(exc, handle) from exc

    # -- the rollout -----------------------------------------------------------

    async def reset(self, instance: Instance, task: TaskSpec) -> None:
        """Run a ``url`` server's ``environment.reset`` (``timeouts.reset_s``).

        A ``command`` server starts fresh: nothing to do. Errors name the
        server by :func:`public_url` (never its credentials or query).

        Raises:
            OperationTimeout: the reset passed its deadline.
            ToolsError: the reset request or tool call failed.
        """
        handle = _handle(instance)
        reset = handle.environment.reset
        if reset is None:
            return
        timeout = self._config.timeouts.reset_s
        url = reset.http.url if reset.http is not None else handle.label
        if reset.http is not None:
            target = f"{reset.http.method} {public_url(url)}"
        else:
            assert reset.tool is not None
            target = f"the tool {reset.tool.name} of {public_url(url)}"

        def failed(exc: Exception) -> ToolsError:
            # The text may quote the URL whole (with a token in it): named as above.
            why = describe(exc).replace(url, public_url(url))
            return ToolsError(f"reset ({target}) failed: {why}", operation="reset")

        try:
            with fail_after(timeout):
                if reset.http is not None:
                    async with self._http() as http:
                        response = await http.request(reset.http.method, reset.http.url)
                    said = f"HTTP {response.status_code}" if response.is_error else None
                else:
                    assert reset.tool is not None
                    async with self._session(handle) as session:
                        answer = await session.call(reset.tool.name, reset.tool.arguments)
                    said = answer.text[:300] if answer.is_error else None
        except TimeoutError:
            raise OperationTimeout(
                f"reset ({target}) took over {timeout:g} s (timeouts.reset_s)",
                operation="reset",
                timeout_s=timeout,
            ) from None
        except (httpx2.HTTPError, ToolsError, OperationTimeout) as exc:  # its request or session
            raise failed(exc) from exc
        if said is not None:
            raise ToolsError(f"reset ({target}) answered an error: {said}", operation="reset")

    def route(self, instance: Instance, task: TaskSpec) -> Route:
        """The task's modality's tool filter, on the server itself."""
        handle = _handle(instance)
        row = route(
            task.modality, self._config.modalities, "", final_answer=task.requires_final_answer
        )
        return replace(row, url=handle.label)

    def open_tools(
        self, instance: Instance, route: Route
    ) -> AbstractAsyncContextManager[ToolSession]:
        """An MCP session on the server for the rollout's life.

        Raises:
            OperationTimeout: no session within ``timeouts.mcp_connect_s``.
            ToolsError: the server refused or dropped the connection.
        """
        return self._session(_handle(instance))

    @asynccontextmanager
    async def _session(self, handle: McpHandle) -> AsyncIterator[ToolSession]:
        t = self._config.timeouts
        if handle.environment.url is not None:
            async with open_tool_session(
                handle.environment.url,
                self._http,
                connect_timeout_s=t.mcp_connect_s,
                call_timeout_s=t.call_tool_s,
                list_timeout_s=t.list_tools_s,
                budget=self._config.retries.mcp_connect_budget,
                report=retry_emitter(self._events),
                limits=self._limits,
                wire=self._wire,
                request_budget=self._config.retries.mcp_request_budget,
            ) as session:
                yield session
            return
        connected = False
        with anyio.CancelScope(deadline=anyio.current_time() + t.mcp_connect_s) as scope:
            try:
                async with self._stdio_client(handle) as client:
                    connected = True
                    scope.deadline = math.inf
                    yield ToolSession(
                        SdkClient(client),
                        handle.label,
                        call_timeout_s=t.call_tool_s,
                        list_timeout_s=t.list_tools_s,
                    )
            except Exception as exc:
                if connected:
                    raise
                raise ToolsError(
                    f"cannot open an MCP session with {handle.label}: {describe(exc)}",
                    operation="connect",
                ) from exc
        if not connected:
            raise OperationTimeout(
                f"the MCP handshake with {handle.label} took over {t.mcp_connect_s:g} s",
                operation="connect",
                timeout_s=t.mcp_connect_s,
            )

    def _stdio_client(self, handle: McpHandle) -> Client:
        from mcp import Client  # on first use: ``mcp`` loads starlette and uvicorn

        if handle.process is None or handle.process.returncode is not None:
            raise ToolsError(f"the server of {handle.label} is not running", operation="connect")
        return Client(
            process_transport(
                handle.process,
                handle.stdout_closed,
                self._limits,
            ),
            read_timeout_seconds=self._config.timeouts.call_tool_s,
        )

    def _http(self) -> httpx2.AsyncClient:
        t = self._config.timeouts
        limits = self._limits
        return httpx2.AsyncClient(
            timeout=httpx2.Timeout(
                max(t.call_tool_s, t.list_tools_s) + t.mcp_connect_s, connect=t.mcp_connect_s
            ),
            # Answers are read up to pool.max_tool_*_bytes, counted while read.
            transport=BoundedAnswers(httpx2.AsyncHTTPTransport(), limits),
            # A transport of our own switches off httpx's proxies from the
            # environment: the same rules, mounted as httpx would mount them.
            mounts=self._proxies.mounts(
                lambda proxy: BoundedAnswers(httpx2.AsyncHTTPTransport(proxy=proxy), limits)
            ),
        )

    # -- verification ----------------------------------------------------------

    async def verify(self, instance: Instance, task: TaskSpec, final_answer: str | None) -> Verdict:
        """The task's ``verifier``: a command in the workdir or a tool on the server.

        Never raises for the verifier's problems: a crash, a timeout or no
        number is a verdict without a reward.
        """
        handle = _handle(instance)
        verifier = task.verifier
        assert verifier is not None  # checked when the task was loaded
        redact = self._redactor(handle)
        try:
            if verifier.tool is not None:
                return await self._verify_tool(handle, verifier.tool, redact)
            return await self._verify_command(handle, verifier, final_answer, redact)
        except (ToolsError, OperationTimeout, OSError) as exc:
            error = redact(f"the verifier could not run: {describe(exc)}")
            return Verdict(None, VerifierOutcome(success=False, error=error), type(exc).__name__)

    async def _verify_command(
        self,
        handle: McpHandle,
        verifier: McpVerifier,
        final_answer: str | None,
        redact: Redactor,
    ) -> Verdict:
        assert verifier.command is not None
        timeout = self._config.timeouts.verifier_s
        env = None if final_answer is None else {**handle.env, "FINAL_ANSWER": final_answer}
        ran = await self._run(self._argv(verifier.command, handle), handle, timeout, env=env)
        stdout = redact(ran.stdout[-OUTPUT_KEPT:])
        if ran.timed_out:
            error = f"the verifier took over {timeout:g} s (timeouts.verifier_s) and was killed"
            return no_reward(error, stdout, "TimeoutError")
        if verifier.reward_file is not None:
            path = handle.workdir / verifier.reward_file
            try:
                text = await anyio.Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                why = f"exited with status {ran.returncode}; " if ran.returncode else ""
                error = f"the verifier {why}wrote no {verifier.reward_file}: {exc}"
                return no_reward(redact(error + self._tail(ran.stderr, redact)), stdout)
            try:
                reward = verifier_reward_text(text)
            except ValueError as exc:
                return no_reward(redact(f"{verifier.reward_file}: {exc}"), stdout)
            return Verdict(reward, VerifierOutcome(success=True, stdout=stdout))
        if ran.returncode != 0:
            error = f"the verifier exited with status {ran.returncode}" + self._tail(
                ran.stderr, redact
            )
            return no_reward(error, stdout, "VerifierCrashed")
        printed = next(
            (
                n
                for line in reversed(ran.stdout.splitlines())
                if (n := reward_number(line)) is not None
            ),
            None,
        )
        if printed is None:
            return no_reward(
                "the verifier printed no reward (a number, true/false, or a JSON object"
                " with 'score', 'reward' or 'value')",
                stdout,
            )
        return Verdict(printed, VerifierOutcome(success=True, stdout=stdout))

    async def _verify_tool(
        self, handle: McpHandle, tool: ToolCallSpec, redact: Redactor
    ) -> Verdict:
        timeout = self._config.timeouts.verifier_s
        try:
            with fail_after(timeout):
                async with self._session(handle) as session:
                    answer = await session.call(tool.name, tool.arguments)
        except TimeoutError:
            error = f"the verifier tool {tool.name} took over {timeout:g} s (timeouts.verifier_s)"
            return no_reward(error, "", "TimeoutError")
        text = redact(answer.text[-OUTPUT_KEPT:])
        if answer.is_error:
            return no_reward(f"the verifier tool {tool.name} failed: {text[:300]}", text)
        try:
            reward = tool_reward(answer)
        except ValueError as exc:
            return no_reward(redact(f"the verifier tool {tool.name}: {exc}"), text)
        return Verdict(reward, VerifierOutcome(success=True, stdout=text))

    async def _run(
        self,
        argv: list[str],
        handle: McpHandle,
        limit_s: float,
        *,
        env: dict[str, str] | None = None,
    ) -> Ran:
        """:func:`run_command` in the workdir, with the handle's environment by default."""
        grace, wait = self._config.mcp.kill_grace_s, self._config.timeouts.release_s
        return await run_command(
            argv, handle.workdir, env or handle.env, limit_s, grace_s=grace, wait_s=wait
        )

    # -- liveness and release ----------------------------------------------------

    async def is_alive(self, instance: Instance) -> bool:
        """Whether a ``command`` server still runs (a ``url`` server is presumed alive)."""
        handle = _handle(instance)
        process = handle.process
        if process is None:
            return handle.environment.url is not None and not handle.released
        if process.returncode is None and handle.stdout_closed.is_set():
            # Its stdout ended: it is exiting; give the loop the time to see it.
            with anyio.move_on_after(self._config.mcp.kill_grace_s):
                await process.wait()
        return process.returncode is None

    async def release(self, instance: Instance, *, reuse: bool = False) -> bool:
        """Kill the server's process group and remove the working directory. Never raises.

        (Its instances are never reused: ``reuse`` changes nothing.)
        """
        return await self._release(_handle(instance))

    async def _release(self, handle: McpHandle) -> bool:
        if handle.released:
            return True
        handle.released = True
        self._live.pop(handle.instance_id, None)
        if handle.leased and handle.environment.url is not None:
            handle.leased = False
            self.leases.release(handle.environment.url, handle)  # the next in line may go
        timeout, grace = self._config.timeouts.release_s, self._config.mcp.kill_grace_s
        error: str | None = None
        began = time.monotonic()
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout) as scope:
            try:
                if handle.process is not None:
                    await stop_process(handle.process, grace_s=grace, wait_s=timeout)
                if not self._config.mcp.keep_workdirs:
                    await anyio.to_thread.run_sync(self._remove, handle.folder)
            except Exception as exc:  # a failed release is reported, never raised
                error = f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            error = f"release timed out after {timeout:g} s"
        attributes: dict[str, Any] = {
            "instance_id": handle.instance_id,
            "lifetime_s": round(time.monotonic() - began, 3),
        }
        if error is None:
            self._events.emit("fleet_instance_released", **attributes)
            return True
        self._events.emit(
            "fleet_instance_release_failed", level="error", error_message=error[:500], **attributes
        )
        return False

    def _remove(self, folder: Path) -> None:
        remove_workdir(folder, self._config.mcp.workdir_root)

    async def sweep(self, run_id: str) -> int:
        """Release every environment of ``run_id`` still held; never raises."""
        handles = [h for h in list(self._live.values()) if h.run_id == run_id]
        released = 0
        for handle in handles:
            released += await self._release(handle)
        return released

    async def aclose(self) -> None:
        """Release whatever is still held (each release is shielded and bounded)."""
        for handle in list(self._live.values()):
            await self._release(handle)
        if self._wire is not None:
            await self._wire.aclose()

    # -- helpers -----------------------------------------------------------------

    def _redactor(self, handle: McpHandle) -> Redactor:
        return self._events.redactor.extended(handle.environment.env.values())

    def _stderr_tail(self, handle: McpHandle | None) -> str:
        if handle is None or handle.process is None:
            return ""
        try:
            text = handle.stderr_path.read_bytes()[-OUTPUT_KEPT:].decode("utf-8", "replace")
        except OSError:
            return ""
        return self._tail(text, self._redactor(handle))

    def _tail(self, text: str, redact: Redactor) -> str:
        keep = self._config.mcp.stderr_lines
        lines = deque((line for line in text.splitlines() if line.strip()), maxlen=keep or 1)
        if not keep or not lines:
            return ""
        return "; stderr: " + redact(" | ".join(lines))


def public_url(url: str) -> str:
    """``url`` without what may be secret (user and password, query, fragment)."""
    parts = httpx.URL(url)
    return str(parts.copy_with(userinfo=b"", query=None, fragment=None))


def _environment(task: TaskSpec) -> McpEnvironment:
    if task.environment is None:
        reason = f"task {task.key} has no 'environment' (a Fleet task)"
        raise ProvisionError(reason, transient=False)
    return task.environment


def _handle(instance: Instance) -> McpHandle:
    handle = instance.handle
    assert isinstance(handle, McpHandle), "an instance of another provider"
    return handle
