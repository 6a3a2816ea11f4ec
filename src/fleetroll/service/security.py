"""The service's token: ``fleetroll serve`` without ``FLEETROLL_SERVICE_TOKEN``
takes it from a file only its user can read, made on first use: no caller that
has not authenticated ever gets a task's code (a verifier, a command) run.

The front door every server of ours shares (bind check, bearer token, Host
check, body limit) is :mod:`fleetroll._internal.guard`.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from pydantic import SecretStr

from fleetroll._internal.guard import MIN_TOKEN_CHARS
from fleetroll.errors import ConfigError

__all__ = ["token_from_file"]


def token_from_file(path: Path) -> tuple[SecretStr, bool]:
    """The service's token kept in ``path``, made now if there is none; and whether it was.

    A new token (32 random bytes, URL-safe) appears whole or not at all: it is
    written to a private temporary file first, then linked into place, so two
    services starting at once read the same one. The file must be a regular
    file of this user that nobody else can read. Blocking file I/O: call it
    before the event loop runs.

    Raises:
        ConfigError: the file or its folder cannot be made, it is not a private
            regular file of this user, or its token is under 16 characters.
    """
    path = path.expanduser()
    made = False
    try:
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            made = _make_token_file(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(
            f"cannot use {path} for the service token ({exc.strerror}): set"
            " FLEETROLL_SERVICE_TOKEN, or service.token_file to a place of yours"
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"{path} must be a regular file of yours that only you can read and write"
                f" (chmod 600 {path}), or set FLEETROLL_SERVICE_TOKEN"
            )
        token = f.read(4096).decode("utf-8", "replace").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{path} holds a blank or short token: delete it (serve makes a new one)"
            f" or write one of at least {MIN_TOKEN_CHARS} characters"
        )
    return SecretStr(token), made


def _make_token_file(path: Path) -> bool:
    """Put a new token at ``path`` unless one is there already; whether this one is."""
    draft = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        os.link(draft, path)
    except FileExistsError:
        return False  # another service made it meanwhile: that one is the token
    finally:
        draft.unlink(missing_ok=True)
    return True
