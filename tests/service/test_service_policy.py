"""The policy a batch over HTTP plays: its servers and who gets the server's key."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from fleetroll.policies.openai import OpenAIChatPolicy
from fleetroll.pool.assembly import chat_policy_config
from fleetroll.service.app import build_policy
from fleetroll.service.models import BatchRequest, PolicyConfig
from fleetroll.service.requests import batch_fingerprint, policy_endpoint
from fleetroll.settings import load_settings

A, B, C = "http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1", "http://127.0.0.1:8003/v1"


def urls(policy: object) -> list[str]:
    assert isinstance(policy, OpenAIChatPolicy)
    return [server.url for server in policy.servers.servers]


async def test_a_request_with_base_urls_builds_a_policy_routed_over_those_servers() -> None:
    settings = load_settings(policy={"kind": "openai", "base_url": A, "max_calls_per_server": 3})
    policy = build_policy(PolicyConfig(base_urls=[B, C]), settings)
    try:
        assert urls(policy) == [B, C]
        assert isinstance(policy, OpenAIChatPolicy)
        assert policy.servers.limits.max_calls == 3
    finally:
        await policy.aclose()


async def test_a_batch_without_servers_of_its_own_uses_the_services_base_urls() -> None:
    settings = load_settings(policy={"kind": "openai", "base_urls": [A, B]})
    by_default = build_policy(None, settings)
    one = build_policy(PolicyConfig(base_url=C), settings)
    try:
        assert urls(by_default) == [A, B]
        assert urls(one) == [C]  # a request's base_url still names one server
    finally:
        await by_default.aclose()
        await one.aclose()


def test_the_services_key_goes_only_to_requests_naming_its_own_servers() -> None:
    settings = load_settings(
        policy={"kind": "openai", "base_urls": [A, B]}, openai_api_key="sk-server"
    )
    own = policy_endpoint(
        PolicyConfig(base_urls=[B, A + "/"]), settings.policy, settings.openai_api_key
    )
    mixed = policy_endpoint(
        PolicyConfig(base_urls=[A, C]), settings.policy, settings.openai_api_key
    )
    brought = policy_endpoint(
        PolicyConfig(base_urls=[C], api_key=SecretStr("sk-mine")),
        settings.policy,
        settings.openai_api_key,
    )
    assert own is not None and own[1] is not None
    assert own[1].get_secret_value() == "sk-server"
    assert mixed == ([A, C], None)
    assert brought is not None and brought[1] is not None
    assert brought[1].get_secret_value() == "sk-mine"


def test_a_request_listing_a_policy_server_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="listed twice"):
        BatchRequest.model_validate(
            {"tasks_file": "t.jsonl", "policy": {"base_urls": [A, A + "/"]}}
        )


def test_a_request_without_base_urls_keeps_the_fingerprint_it_had() -> None:
    plain = batch_fingerprint([], PolicyConfig(model="m"), 1, None)
    many = batch_fingerprint([], PolicyConfig(model="m", base_urls=[A, B]), 1, None)
    # computed before base_urls existed
    assert plain == "cab47060af0f5b61163e3615be6719d11a662bdc268346fe459320f6a66751ee"
    assert many != plain


async def test_a_batch_s_policy_takes_every_other_policy_setting_from_the_server_as_the_cli() -> (
    None
):
    settings = load_settings(
        policy={"kind": "openai", "base_url": A, "trajectory": True, "token_in": True},
        retries={"policy_backoff_initial_s": 0.25, "policy_backoff_max_s": 3.0},
    )
    policy = build_policy(PolicyConfig(model="mine", logprobs=True), settings)
    cli = OpenAIChatPolicy.from_config(
        chat_policy_config(
            settings.model_copy(
                update={
                    "policy": settings.policy.model_copy(update={"model": "mine", "logprobs": True})
                }
            )
        )
    )
    try:
        assert isinstance(policy, OpenAIChatPolicy)
        assert policy.token_in and policy.model == "mine"
        assert policy._training == cli._training == {"return_token_ids": True, "logprobs": True}
        budget = policy._http.budget
        assert (budget.backoff_initial_s, budget.backoff_max_s) == (0.25, 3.0)
    finally:
        await policy.aclose()
        await cli.aclose()


def test_an_agent_command_given_as_a_string_is_split_and_is_part_of_the_batch_s_identity() -> None:
    request = BatchRequest.model_validate(
        {"tasks_file": "t.jsonl", "agent_command": "python 'my agent.py' --fast"}
    )
    assert request.agent_command == ["python", "my agent.py", "--fast"]
    plain = batch_fingerprint([], None, 1, None)
    with_agent = batch_fingerprint([], None, 1, None, agent_command=request.agent_command)
    assert with_agent != plain
    assert plain == batch_fingerprint([], None, 1, None, agent_command=None)
    for bad in ("", "python 'unclosed", []):
        with pytest.raises(ValidationError, match="agent_command"):
            BatchRequest.model_validate({"tasks_file": "t.jsonl", "agent_command": bad})
