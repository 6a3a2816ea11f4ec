"""What a request to the service asks for, checked: its tasks (a list of
records, one record, or a task file under ``service.tasks_root``), the policy
it names, and the fingerprint that says whether two submissions are the same
batch.

Every problem is an :class:`~fleetroll.service.errors.ApiError` (422) naming
the field, as a task file's loader names the line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from fleetroll.errors import TaskFileError
from fleetroll.service.errors import ApiError, loc_of
from fleetroll.service.models import PolicyConfig
from fleetroll.settings import PolicySettings
from fleetroll.tasks import TaskLimits, TaskSpec, parse_task

__all__ = [
    "batch_fingerprint",
    "parse_one",
    "parse_records",
    "policy_endpoint",
    "request_policy",
    "task_path",
]

_SOURCE = "request body"


def parse_records(
    records: Sequence[Mapping[str, Any]], modalities: Any, limits: TaskLimits
) -> list[TaskSpec]:
    """Tasks of a request's ``tasks`` list, checked as a task file is.

    Blocking (each verifier is compiled): the service runs it in a worker thread.

    Raises:
        ApiError: 422 naming the item and field (``["body", "tasks", 2, "env_key"]``).
    """
    if not records:
        raise ApiError(422, "no tasks", loc=["body", "tasks"])
    if limits.max_tasks is not None and len(records) > limits.max_tasks:
        reason = f"{len(records)} tasks, over this service's limit of {limits.max_tasks}"
        raise ApiError(422, reason, loc=["body", "tasks"])
    tasks: list[TaskSpec] = []
    first_use: dict[str, int] = {}
    for i, record in enumerate(records):
        try:
            task = parse_task(
                record,
                source=_SOURCE,
                modalities=modalities,
                max_verifier_bytes=limits.max_verifier_bytes,
            )
        except TaskFileError as exc:
            reason = f"{exc.reason} (the {_nth(i + 1)} task in the list)"
            loc = ["body", "tasks", i, *loc_of(exc.field)]
            raise ApiError(422, reason, loc=loc, type="task_error") from None
        first = first_use.setdefault(task.key, i)
        if first != i:
            reason = f"duplicate key {task.key!r}, first used by the {_nth(first + 1)} task"
            raise ApiError(422, reason, loc=["body", "tasks", i, "key"], type="task_error")
        tasks.append(task)
    return tasks


def parse_one(
    record: Mapping[str, Any],
    modalities: Any,
    *,
    loc: Sequence[str],
    max_verifier_bytes: int | None = None,
) -> TaskSpec:
    """One task of a request (a session's, an MCP tool's), its verifier's size checked first.

    Raises:
        ApiError: 422 naming the field.
    """
    try:
        return parse_task(
            record, source=_SOURCE, modalities=modalities, max_verifier_bytes=max_verifier_bytes
        )
    except TaskFileError as exc:
        raise ApiError(422, exc.reason, loc=[*loc, *loc_of(exc.field)], type="task_error") from None


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def task_path(given: str, root: Path) -> Path:
    base = root.resolve()
    try:
        path = (base / given).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, NUL bytes
        raise ApiError(422, f"not a usable path: {exc}", loc=["body", "tasks_file"]) from None
    if not path.is_relative_to(base):
        raise ApiError(
            422,
            "is outside the folder this service reads task files from (service.tasks_root)",
            loc=["body", "tasks_file"],
        )
    return path


def batch_fingerprint(
    tasks: Sequence[TaskSpec],
    policy: PolicyConfig | None,
    samples_per_task: int,
    deadline_s: float | None,
    oversample: int = 0,
    agent_command: Sequence[str] | None = None,
    groups_target: int | None = None,
    *,
    max_in_flight: int | None = None,
    policy_version: int | None = None,
) -> str:
    """What makes two submissions "the same batch" (a policy's api_key does not)."""
    identity: dict[str, Any] = {
        "tasks": [t.model_dump(mode="json") for t in tasks],
        "samples_per_task": samples_per_task,
        "policy": _identity(policy) if policy else None,
        "deadline_s": deadline_s,
    }
    if oversample:  # absent when 0: fingerprints of earlier batches stay the same
        identity["oversample"] = oversample
    if agent_command is not None:  # absent when unset, likewise
        identity["agent_command"] = list(agent_command)
    if groups_target is not None:
        identity["groups_target"] = groups_target
    if max_in_flight is not None:
        identity["max_in_flight"] = max_in_flight
    if policy_version is not None:
        identity["policy_version"] = policy_version
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _identity(policy: PolicyConfig) -> dict[str, Any]:
    # base_urls absent when unset: fingerprints of earlier batches stay the same
    unset = {"base_urls"} if policy.base_urls is None else set()
    return policy.model_dump(mode="json", exclude={"api_key", *unset})


def policy_endpoint(
    config: PolicyConfig | None, policy: PolicySettings, openai_api_key: SecretStr | None
) -> tuple[list[str], SecretStr | None] | None:
    """The servers (API roots) and key a request's policy calls (None: scripted).

    The request's ``base_urls``, else its ``base_url``, else the server's
    ``policy.servers`` (``policy.base_urls``, or else ``policy.base_url``).
    The server's own ``OPENAI_API_KEY`` (``openai_api_key``) goes only to the
    server's configured servers: a request naming any other must bring its own key.
    """
    cfg = config or PolicyConfig()
    if (cfg.kind or policy.kind) == "scripted":
        return None
    servers = list(cfg.base_urls or ([cfg.base_url] if cfg.base_url else policy.servers))
    api_key = cfg.api_key
    own = {url.rstrip("/") for url in policy.servers}
    if api_key is None and all(url.rstrip("/") in own for url in servers):
        api_key = openai_api_key
    return servers, api_key


def request_policy(
    config: PolicyConfig | None, policy: PolicySettings, openai_api_key: SecretStr | None
) -> tuple[PolicySettings, SecretStr | None]:
    """The server's ``[policy]`` and key with a request's policy in their place.

    The request's fields that are set replace the server's of the same name;
    its servers and key are :func:`policy_endpoint`'s. Everything else
    (``trajectory``, ``token_in``, the retries' backoff, ``max_calls_per_server``...)
    is the server's, so a batch's policy is built exactly as ``fleetroll run``
    builds its own (:func:`fleetroll.service.app.build_policy`).
    """
    cfg = config or PolicyConfig()
    update = cfg.model_dump(exclude_none=True, exclude={"api_key", "base_url", "base_urls"})
    endpoint = policy_endpoint(config, policy, openai_api_key)
    if endpoint is not None:
        servers, openai_api_key = endpoint
        update |= {"base_url": servers[0], "base_urls": servers}
    return policy.model_copy(update=update), openai_api_key
