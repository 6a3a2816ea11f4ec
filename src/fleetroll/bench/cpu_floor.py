"""The ``cpu-floor`` baseline: fleetroll's requests, hand-written over one connection.

A rollout makes the requests a fleetroll rollout makes (read off the
emulator's request log), in the same order, with the same bodies:

1. ``POST /v1/env/instances`` (the create answers once the instance runs:
   fleetroll asks nothing else to wait for it), with fleetroll's heartbeat
   interval (``provisioning.heartbeat_s``);
2. a heartbeat at once (``POST /v1/env/instances/{id}/heartbeat``), then one
   each half interval while the rollout holds its instance (the beats after
   the first go over one connection of their own, in turn, as fleetroll's
   beat over its shared pool); then ``POST {instance}/api/v1/env/reset``;
3. MCP over streamable HTTP: ``server/discover``, ``tools/list``, then one
   ``tools/call`` per call the scripted policy makes (the same policy, with
   the same think time, as every system);
4. ``GET /v1/verifiers/check?sha256=``, then ``POST /v1/verifiers/execute``
   (with the bundle when the check says it is not known yet);
5. ``DELETE /v1/env/instances/{id}``.

Every request goes over ONE keep-alive HTTP/1.1 connection per rollout
(anyio byte streams, JSON bodies, a response parser that knows
``Content-Length``, chunked bodies and server-sent events): no connection
pool, no models, no retries. Its CPU per rollout is the floor the other
systems are compared to. Each step has fleetroll's deadline; the instance
is deleted shielded and bounded, as everywhere else.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import pickle
import time
import uuid
import zipfile
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from fleetroll.bench.records import Sample
from fleetroll.bench.systems import Outcome, RunContext
from fleetroll.policies import ToolSpec
from fleetroll.results import Timings
from fleetroll.tasks import TaskSpec

__all__ = ["run_cpu_floor"]

#: The MCP protocol revision the mcp client speaks (its ``server/discover`` flow).
_MCP_VERSION = "2026-07-28"
_MCP_META = {
    "io.modelcontextprotocol/protocolVersion": _MCP_VERSION,
    "io.modelcontextprotocol/clientInfo": {"name": "cpu-floor", "version": "0.1.0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}
_MAX_HEAD = 64 * 1024
_MAX_BODY = 64 * 1024 * 1024


class HttpStatusError(Exception):
    """A response with a status other than 2xx."""

    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:200]!r}")
        self.status = status


class Connection:
    """One keep-alive HTTP/1.1 connection: a request, then its response, in turn.

    A request that did not complete (a deadline, a broken socket) leaves the
    connection in an unknown state: it is closed, and the next request opens
    a new one, as any HTTP client does.
    """

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._host = parts.netloc
        self._stream: ByteStream | None = None
        self._reader: BufferedByteReceiveStream | None = None

    async def aclose(self) -> None:
        stream, self._stream, self._reader = self._stream, None, None
        if stream is not None:
            with contextlib.suppress(OSError, anyio.BrokenResourceError):
                await stream.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        """Send one request, read its response; the JSON it holds (None when empty).

        Raises:
            HttpStatusError: the status is not 2xx.
            anyio.EndOfStream, anyio.IncompleteRead, OSError: the connection broke.
            ValueError: the response is not HTTP/1.1 as this parser knows it.
        """
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        lines = [f"{method} {path} HTTP/1.1", f"host: {self._host}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body is not None:
            lines.append("content-type: application/json")
        lines.append(f"content-length: {len(payload)}")
        completed = False
        try:
            if self._stream is None:
                self._stream = await anyio.connect_tcp(*self._address)
                self._reader = BufferedByteReceiveStream(self._stream)
            await self._stream.send(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
            status, kind, data = await self._response()
            completed = True
        finally:
            if not completed:
                with anyio.CancelScope(shield=True):
                    await self.aclose()
        if not 200 <= status < 300:
            raise HttpStatusError(method, path, status, data)
        if not data:
            return None
        if kind.startswith("text/event-stream"):
            data = _last_event(data)
        return json.loads(data)

    async def _response(self) -> tuple[int, str, bytes]:
        assert self._reader is not None
        head = await self._reader.receive_until(b"\r\n\r\n", _MAX_HEAD)
        status_line, *fields = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        found: dict[str, str] = {}
        for field in fields:
            name, _, value = field.partition(":")
            found[name.strip().lower()] = value.strip()
        if found.get("transfer-encoding", "").lower() == "chunked":
            data = await self._chunked()
        else:
            length = int(found.get("content-length", "0"))
            if length > _MAX_BODY:
                raise ValueError(f"a response body of {length} bytes")
            data = await self._reader.receive_exactly(length) if length else b""
        return status, found.get("content-type", ""), data

    async def _chunked(self) -> bytes:
        assert self._reader is not None
        chunks: list[bytes] = []
        while True:
            size = int((await self._reader.receive_until(b"\r\n", 1024)).split(b";")[0], 16)
            if size == 0:
                await self._reader.receive_until(b"\r\n", _MAX_HEAD)  # no trailers expected
                return b"".join(chunks)
            chunks.append(await self._reader.receive_exactly(size))
            await self._reader.receive_exactly(2)


def _last_event(stream: bytes) -> bytes:
    """The data of the last server-sent event that carries any (the JSON-RPC answer)."""
    found = b""
    for event in stream.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = b"\n".join(
            line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if data:
            found = data
    return found


def _bundle(code: str) -> tuple[str, str]:
    """The verifier's bundle as the SDK uploads it: (sha256, base64 zip)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("requirements.txt", "fleet-python\n")
        zf.writestr("verifier.py", code)
    data = buffer.getvalue()
    return hashlib.sha256(data).hexdigest(), base64.b64encode(data).decode()


class _Mcp:
    """JSON-RPC over streamable HTTP on the rollout's connection."""

    def __init__(self, conn: Connection, path: str) -> None:
        self._conn = conn
        self._path = path
        self._next_id = 0

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        self._next_id += 1
        headers = {
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": _MCP_VERSION,
            "mcp-method": method,
        }
        if method == "tools/call" and params is not None:
            headers["mcp-name"] = str(params["name"])
        message = {
            "jsonrpc": "2.0",
            "id": self._next_id,
            "method": method,
            "params": {**(params or {}), "_meta": _MCP_META},
        }
        answer = await self._conn.request("POST", self._path, message, headers)
        if not isinstance(answer, dict) or "error" in answer:
            raise RuntimeError(f"MCP {method} failed: {str(answer)[:200]}")
        return answer["result"]


async def run_cpu_floor(ctx: RunContext) -> Outcome:
    """fleetroll's requests per rollout, over one keep-alive connection each."""
    run = _Rollouts(ctx)
    with anyio.move_on_after(ctx.scenario.wall_limit_s) as scope:
        async with anyio.create_task_group() as beats:
            if run.interval is not None:
                beats.start_soon(run.beat_held, run.interval / 2)
            async with anyio.create_task_group() as tg:
                for task in ctx.tasks:
                    for _ in range(ctx.samples_per_task):
                        tg.start_soon(run.one, task)
            beats.cancel_scope.cancel()
    return Outcome(
        samples=run.samples,
        returned=len(run.samples),
        finished_on_its_own=not scope.cancelled_caught,
        notes=["one keep-alive HTTP/1.1 connection per rollout, hand-written requests"],
    )


class _Rollouts:
    """One run's rollouts and what they share: the deadlines, the credentials, the
    verifier bundles, the instances holding heartbeats, the samples."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.t = ctx.settings.timeouts
        self.limiter = anyio.CapacityLimiter(ctx.concurrency)
        self.policy = ctx.policy()
        self.auth = {"authorization": f"Bearer {ctx.api_key}"}
        self.run_id = uuid.uuid4().hex[:12]
        self.bundles = {task.key: _bundle(task.verifier_func or "") for task in ctx.tasks}
        self.samples: list[Sample] = []
        self.interval = ctx.settings.provisioning.heartbeat_s
        self.held: dict[str, str | None] = {}  # instance id -> its heartbeat region

    async def beat(self, conn: Connection, instance_id: str) -> None:
        assert self.interval is not None
        region = self.held.get(instance_id)
        body = {"region": region} if region else {}
        # fleetroll's deadline of one beat (FleetProvider's Heartbeats).
        with anyio.fail_after(min(self.t.release_s, self.interval / 2)):
            await conn.request(
                "POST", f"/v1/env/instances/{instance_id}/heartbeat", body, self.auth
            )

    async def beat_held(self, period: float) -> None:
        conn = Connection(self.ctx.base_url)
        try:
            while True:
                await anyio.sleep(period)
                for instance_id in list(self.held):
                    if instance_id in self.held:  # not released meanwhile
                        with contextlib.suppress(Exception):
                            await self.beat(conn, instance_id)
        finally:
            with anyio.CancelScope(shield=True):
                await conn.aclose()

    async def create(self, conn: Connection, task: TaskSpec) -> Any:
        ttl = task.ttl_seconds or self.ctx.settings.modalities[task.modality].ttl_s
        body = {
            "env_key": task.env_key,
            "env_version": task.env_version,
            "data_key": task.data_key,
            "data_version": task.data_version,
            "run_id": self.run_id,
            "created_from": "sdk",
            "ttl_seconds": ttl,
            "heartbeat_interval": self.interval,
            "max_wait_seconds": max(0, int(self.t.provision_create_s) - 30),
        }
        with anyio.fail_after(self.t.provision_create_s):
            return await conn.request("POST", "/v1/env/instances", body, self.auth)

    async def play(self, conn: Connection, task: TaskSpec, root: str, timings: Timings) -> None:
        mcp = _Mcp(conn, f"{root}mcp")
        with anyio.fail_after(self.t.mcp_connect_s):
            await mcp.call("server/discover")
        with anyio.fail_after(self.t.list_tools_s):
            listed = await mcp.call("tools/list")
        tools = [
            ToolSpec(
                name=x["name"],
                description=x.get("description") or "",
                input_schema=x.get("inputSchema") or {},
            )
            for x in listed["tools"]
        ]
        messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
        for _ in range((task.max_steps or 30) + 1):
            began = time.perf_counter()
            with anyio.fail_after(self.t.policy_s):
                turn = await self.policy.act(task, messages, tools)
            timings.policy_s += time.perf_counter() - began
            messages.append({"role": "assistant", "content": turn.content})
            if not turn.tool_calls:
                return
            for call in turn.tool_calls:
                began = time.perf_counter()
                try:
                    with anyio.fail_after(self.t.call_tool_s):
                        params = {"name": call.name, "arguments": dict(call.arguments)}
                        result = await mcp.call("tools/call", params)
                    text = "Error" if result.get("isError") else "ok"
                except Exception as exc:  # a failed call is an observation, as elsewhere
                    text = f"Error: {type(exc).__name__}"
                timings.tools_s += time.perf_counter() - began
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})

    async def verify(self, conn: Connection, task: TaskSpec, instance_id: str) -> float | None:
        sha, bundle = self.bundles[task.key]
        with anyio.fail_after(self.t.verifier_s):
            known = await conn.request("GET", f"/v1/verifiers/check?sha256={sha}", None, self.auth)
            args = {"args": (None, {"env": instance_id}), "kwargs": {"final_answer": None}}
            body: dict[str, Any] = {
                "key": task.key,
                "sha256": sha,
                "args": base64.b64encode(pickle.dumps(args)).decode(),
                "args_array": [{"env": instance_id}],
                "function_name": "verify",
                "timeout": int(self.t.verifier_s),
                "region": self.ctx.settings.provisioning.region or "us-west-1",
            }
            if not (known or {}).get("success"):
                body["bundle"] = bundle
            answer = await conn.request("POST", "/v1/verifiers/execute", body, self.auth)
        result = answer.get("result") if answer.get("success") else None
        return float(result) if isinstance(result, int | float) else None

    async def one(self, task: TaskSpec) -> None:
        async with self.limiter:
            began = time.perf_counter()
            timings = Timings()
            reward: float | None = None
            failure: str | None = None
            instance_id: str | None = None
            conn = Connection(self.ctx.base_url)
            try:
                instance = await self.create(conn, task)
                timings.provision_s = time.perf_counter() - began
                instance_id = str(instance["instance_id"])
                root = urlsplit(instance["urls"]["root"]).path
                if instance.get("heartbeat_interval"):
                    self.held[instance_id] = instance.get("heartbeat_region")
                    with contextlib.suppress(Exception):  # as fleetroll: a lost beat is no failure
                        await self.beat(conn, instance_id)
                mark = time.perf_counter()
                with anyio.fail_after(self.t.reset_s):
                    await conn.request(
                        "POST", f"{root}api/v1/env/reset", {"timestamp": None, "seed": None}
                    )
                timings.reset_s = time.perf_counter() - mark
                with anyio.fail_after(self.t.rollout_s):
                    await self.play(conn, task, root, timings)
                mark = time.perf_counter()
                reward = await self.verify(conn, task, instance_id)
                timings.verify_s = time.perf_counter() - mark
                if reward is None:
                    failure = "verifier_error"
            except Exception as exc:  # one rollout's boundary: recorded, not raised
                failure = type(exc).__name__
            finally:
                if instance_id is not None:
                    self.held.pop(instance_id, None)
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.t.release_s):
                    await _release(conn, instance_id, self.auth)
                timings.total_s = time.perf_counter() - began
                self.samples.append(Sample(reward=reward, failure=failure, timings=timings))


async def _release(conn: Connection, instance_id: str | None, auth: Mapping[str, str]) -> None:
    """Delete the instance (on a new connection if the rollout's broke), then close."""
    try:
        if instance_id is not None:
            # A failed delete shows in the ledger's leak count.
            with contextlib.suppress(Exception):
                await conn.request("DELETE", f"/v1/env/instances/{instance_id}", None, auth)
    finally:
        await conn.aclose()
