"""Real infrastructure for the wire tests: a forward proxy, a TLS front end, a test CA.

* :func:`forward_proxy`: Debian's squid on a free loopback port, every
  request it handles logged to the test as it ends (squid's ``tcp://`` access
  log, one line per request: who asked, what, the answer's status, the
  address squid left from). Squid leaves from ``127.0.0.2`` (loopback too), so
  a server behind it can tell a proxied connection from a direct one.
* :func:`tls_front_end`: Debian's nginx terminating TLS for a plain HTTP
  upstream, with a certificate of the test CA for ``127.0.0.1`` and
  ``localhost``; its access log (who connected, the request, the status) is
  read off its stderr as it comes.
* :func:`make_ca`: a CA made at test time (``trustme``), its PEM file for
  ``SSL_CERT_FILE``, and a client context that trusts it.

Each starts its program with a config written to the test's own folder, waits
for the program's own "listening" line (bounded), and stops exactly the
process it started (SIGTERM, then SIGKILL after a bound), shielded.

squid and nginx are system packages: ``.ci/run`` installs them. Without them,
a developer's run skips these tests with the reason; with ``FLEETROLL_CI`` set
(``.ci/run`` sets it) their absence fails the run instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import anyio
import pytest
import trustme
from anyio.abc import Process, SocketStream

__all__ = [
    "PROXY_SOURCE",
    "AccessLog",
    "ForwardProxy",
    "LoopbackCA",
    "ProxyEntry",
    "TlsFrontEnd",
    "forward_proxy",
    "free_port",
    "make_ca",
    "need",
    "tls_front_end",
]

#: The loopback address the forward proxy connects out from (servers see it as the peer).
PROXY_SOURCE = "127.0.0.2"
#: Set in CI (.ci/run): a missing squid or nginx fails the run instead of skipping.
CI_FLAG = "FLEETROLL_CI"
#: Bound of a program's start (its "listening" line) and of its stop.
START_S = 30.0
STOP_S = 10.0
_names = count()


def need(program: str) -> str:
    """The path of a system program the test needs; skips without it, fails in CI."""
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if found is None:
        why = f"{program} is not installed (Debian: apt-get install squid nginx; .ci/run does)"
        if os.environ.get(CI_FLAG):
            pytest.fail(f"{why}, and {CI_FLAG} is set: CI must run these tests")
        pytest.skip(why)
    return found


def free_port() -> int:
    """A loopback port free now (for programs that cannot listen on port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- a test CA -------------------------------------------------------------------


@dataclass(frozen=True)
class LoopbackCA:
    """A CA made for one test run, and a server certificate for loopback."""

    ca_file: Path  # the CA's certificate (PEM): what SSL_CERT_FILE points at
    server_pem: Path  # the server's key and certificate chain (PEM)

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this CA only."""
        return ssl.create_default_context(cafile=str(self.ca_file))


def make_ca(folder: Path) -> LoopbackCA:
    """A new CA, with a certificate for ``127.0.0.1`` and ``localhost``, written to ``folder``."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    folder.mkdir(parents=True, exist_ok=True)
    made = LoopbackCA(ca_file=folder / "ca.pem", server_pem=folder / "server.pem")
    ca.cert_pem.write_to_path(str(made.ca_file))
    server.private_key_and_cert_chain_pem.write_to_path(str(made.server_pem))
    return made


# -- logs read as they come --------------------------------------------------------


@dataclass
class AccessLog:
    """A server's access-log lines, in order, with a wait for the next ones."""

    lines: list[str] = field(default_factory=list)
    _changed: anyio.Event = field(default_factory=anyio.Event)

    def add(self, line: str) -> None:
        self.lines.append(line)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, condition: Callable[[list[str]], bool]) -> None:
        """Return once ``condition(lines)`` holds (bounded by :data:`START_S`)."""
        with anyio.fail_after(START_S):
            while not condition(self.lines):
                await self._changed.wait()


async def _pipe_chunks(fd: int) -> AsyncIterator[bytes]:
    """The bytes of a pipe's read end, as they come, to its end (read in a thread)."""
    while chunk := await anyio.to_thread.run_sync(os.read, fd, 65536, abandon_on_cancel=True):
        yield chunk


async def _read_lines(stream: AsyncIterator[bytes], each: Callable[[str], None]) -> None:
    tail = ""
    async for chunk in stream:
        *lines, tail = (tail + chunk.decode("utf-8", "replace")).split("\n")
        for line in lines:
            each(line)
    if tail:
        each(tail)


@dataclass
class _Started:
    """A program started by this module, its stderr lines, and whether it said it is up."""

    process: Process
    said: list[str] = field(default_factory=list)
    up: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)


class NotUp(Exception):
    """A program ended, or said nothing of being up, within :data:`START_S`."""


@asynccontextmanager
async def _program(
    argv: list[str], ready: str, on_line: Callable[[str], None] | None = None
) -> AsyncIterator[_Started]:
    """``argv`` running until the end of the block, once its stderr said ``ready``.

    Raises :class:`NotUp` with its last lines if it ended first (e.g. its port was
    taken) or was not up in time.
    """
    # A real pipe, not the event loop's: uvloop's subprocess pipes are socket pairs,
    # and nginx cannot open /dev/stderr on a socket (its access log goes there).
    read_fd, write_fd = os.pipe()
    try:
        process = await anyio.open_process(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=write_fd
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    started = _Started(process)

    def line(text: str) -> None:
        started.said.append(text)
        if ready in text:
            started.up.set()
        if on_line is not None:
            on_line(text)

    async def read() -> None:
        await _read_lines(_pipe_chunks(read_fd), line)
        started.ended.set()
        started.up.set()  # whoever waits sees it ended

    up = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            with anyio.move_on_after(START_S):
                await started.up.wait()
            up = started.up.is_set() and not started.ended.is_set()
            up = up and process.returncode is None
            if up:
                try:
                    yield started
                finally:
                    with anyio.CancelScope(shield=True):
                        await _stop(process)
                        with anyio.move_on_after(STOP_S):
                            await started.ended.wait()  # its last lines are in
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(process)
            await process.aclose()
        if started.ended.is_set():  # else a reading thread may still hold it
            os.close(read_fd)
    if not up:
        said = "\n".join(started.said[-20:])
        raise NotUp(f"{argv[0]} was not up within {START_S:g} s:\n{said}")


async def _stop(process: Process) -> None:
    """SIGTERM the process this module started, SIGKILL it after :data:`STOP_S`."""
    if process.returncode is None:
        process.terminate()
        with anyio.move_on_after(STOP_S):
            await process.wait()
    if process.returncode is None:
        process.kill()
        with anyio.fail_after(STOP_S):
            await process.wait()


# -- squid: the forward proxy --------------------------------------------------------


@dataclass(frozen=True)
class ProxyEntry:
    """One request squid handled: who asked, the method, the target, the status, and
    the local address squid connected out from (``-:0`` when it never connected)."""

    client: str
    method: str
    target: str
    status: int
    outgoing: str

    @classmethod
    def parse(cls, line: str) -> ProxyEntry:
        client, method, target, status, outgoing = line.split(" ")
        return cls(client, method, target, int(status), outgoing)


@dataclass
class ForwardProxy:
    url: str  # http://127.0.0.1:PORT, for HTTP_PROXY / HTTPS_PROXY
    log: AccessLog

    @property
    def entries(self) -> list[ProxyEntry]:
        return [ProxyEntry.parse(line) for line in self.log.lines]


_SQUID_CONF = """\
http_port 127.0.0.1:{port}
visible_hostname fleetroll-test
pid_filename none
# No name is looked up (every target is an address), and none leaves loopback.
dns_nameservers 127.0.0.1
cache_effective_user nobody
cache deny all
cache_store_log none
cache_log /dev/null
pinger_enable off
shutdown_lifetime 0 seconds
# Every request, as it ends, to the test's listener: one line each.
logformat fleetroll %>a:%>p %rm %ru %>Hs %<la:%<lp
access_log tcp://127.0.0.1:{log_port} fleetroll
buffered_logs off
# Out from another loopback address: a server behind it sees who came through it.
tcp_outgoing_address {source}
http_access allow localhost
http_access deny all
"""


@asynccontextmanager
async def forward_proxy(folder: Path) -> AsyncIterator[ForwardProxy]:
    """squid on a free loopback port, configured in ``folder``, until the block ends."""
    squid = need("squid")
    folder.mkdir(parents=True, exist_ok=True)
    log = AccessLog()

    def entry(line: str) -> None:
        if line:
            log.add(line)

    async def take(stream: SocketStream) -> None:
        async with stream:
            await _read_lines(_received(stream), entry)

    async with (
        await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(listener.serve, take)
        log_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        # Shared-memory segments are named by the service name: one per squid.
        name = f"fleetroll{os.getpid()}x{next(_names)}"
        for attempt in range(3):
            port = free_port()
            conf = folder / f"squid-{attempt}.conf"
            conf.write_text(_SQUID_CONF.format(port=port, log_port=log_port, source=PROXY_SOURCE))
            argv = [squid, "-n", name, "-N", "-d", "1", "-f", str(conf)]
            try:
                async with _program(argv, ready="Accepting HTTP Socket connections"):
                    yield ForwardProxy(url=f"http://127.0.0.1:{port}", log=log)
                break
            except NotUp as exc:
                if attempt == 2 or "in use" not in str(exc):
                    raise
            finally:
                for leftover in Path("/dev/shm").glob(f"{name}-*"):
                    leftover.unlink(missing_ok=True)
        tg.cancel_scope.cancel()


async def _received(stream: SocketStream) -> AsyncIterator[bytes]:
    while True:
        try:
            yield await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return


# -- nginx: the TLS front end -----------------------------------------------------------


@dataclass(frozen=True)
class FrontEntry:
    """One request nginx answered: the peer's address, the request line, the status."""

    peer: str
    request: str
    status: int


@dataclass
class TlsFrontEnd:
    url: str  # https://127.0.0.1:PORT
    port: int
    log: AccessLog

    @property
    def entries(self) -> list[FrontEntry]:
        found = []
        for line in self.log.lines:
            peer, request, status = line.split("|")
            found.append(FrontEntry(peer, request, int(status)))
        return found


_NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log stderr notice;
events {{ worker_connections 1024; }}
http {{
    log_format fleetroll 'ACCESS $remote_addr|$request|$status';
    access_log /dev/stderr fleetroll;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    client_body_buffer_size 1m;
    client_max_body_size 64m;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {cert};
        location / {{
            proxy_pass http://{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $remote_addr;
            # Streamed answers (MCP's SSE) pass as they come, requests too.
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


@asynccontextmanager
async def tls_front_end(
    folder: Path, upstream: str, ca: LoopbackCA, *, port: int | None = None
) -> AsyncIterator[TlsFrontEnd]:
    """nginx terminating TLS on a free loopback port (or ``port``), proxying to
    ``upstream`` (``host:port``, plain HTTP), until the block ends."""
    nginx = need("nginx")
    folder.mkdir(parents=True, exist_ok=True)
    log = AccessLog()

    def line(text: str) -> None:
        if text.startswith("ACCESS "):
            log.add(text.removeprefix("ACCESS "))

    for attempt in range(1 if port is not None else 3):
        chosen = port if port is not None else free_port()
        conf = folder / f"nginx-{attempt}.conf"
        conf.write_text(
            _NGINX_CONF.format(folder=folder, port=chosen, cert=ca.server_pem, upstream=upstream)
        )
        argv = [nginx, "-c", str(conf), "-p", str(folder), "-e", "stderr"]
        try:
            async with _program(argv, ready="start worker process", on_line=line):
                yield TlsFrontEnd(url=f"https://127.0.0.1:{chosen}", port=chosen, log=log)
            return
        except NotUp as exc:
            if port is not None or attempt == 2 or "in use" not in str(exc):
                raise


if sys.platform == "win32":  # pragma: no cover
    raise ImportError("the wire infrastructure runs on POSIX only")
