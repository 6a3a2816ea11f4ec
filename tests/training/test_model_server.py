"""The tiny model and its vLLM-shaped server: a real model's ids and logprobs over HTTP.

The model is built here from a config and a seed (no download); the server
samples from it on the CPU. The tests recompute the server's logprobs with one
forward pass of the same model, as a trainer would. Skipped without the
``train`` extra (torch, transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fleetroll.testing.model_server import ModelServer, parse_hermes_tool_calls  # noqa: E402
from fleetroll.testing.tiny_model import (  # noqa: E402
    TinyModelSpec,
    build_tiny_model,
    load_tiny_model,
    save_tiny_model,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_balance",
            "description": "Read an account's balance",
            "parameters": {
                "type": "object",
                "properties": {"account": {"type": "string"}},
                "required": ["account"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the balance of account acme-001?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_balance", "arguments": '{"account": "acme-001"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"balance": 1250.0}'},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen2-seed1", seed=1)


def recomputed_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Each completion token's raw logprob from one forward pass over prompt + completion."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    raw = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [float(raw[start + i, token]) for i, token in enumerate(completion)]


def test_the_tiny_model_and_tokenizer_build_the_same_from_the_same_seed(tmp_path: Path) -> None:
    model_a, tokenizer_a = build_tiny_model(seed=3)
    model_b, tokenizer_b = build_tiny_model(seed=3)
    model_c, _ = build_tiny_model(seed=4)
    a, b, c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], c[name]) for name in a)
    assert tokenizer_a.get_vocab() == tokenizer_b.get_vocab()
    assert tokenizer_a.backend_tokenizer.to_str() == tokenizer_b.backend_tokenizer.to_str()
    assert model_a.config.vocab_size == len(tokenizer_a)
    assert model_a.config.num_hidden_layers == TinyModelSpec().num_hidden_layers

    # Saved and loaded back: the same weights, tokenizer and chat template.
    loaded, tokenizer = load_tiny_model(save_tiny_model(tmp_path / "m", seed=3))
    assert all(torch.equal(a[name], loaded.state_dict()[name]) for name in a)
    assert tokenizer.get_vocab() == tokenizer_a.get_vocab()
    assert tokenizer.chat_template == tokenizer_a.chat_template


def test_the_chat_template_renders_tools_calls_and_answers_qwen_style() -> None:
    _, tokenizer = build_tiny_model(seed=0)
    messages = json.loads(json.dumps(MESSAGES))
    call = messages[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_balance", "arguments":'
        ' {"account": "acme-001"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"balance": 1250.0}\n</tool_response><|im_end|>\n'
        in text
    )
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level: any text round-trips
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1


def test_hermes_tool_calls_are_parsed_as_vllm_does() -> None:
    content, calls = parse_hermes_tool_calls(
        'Let me look.<tool_call>\n{"name": "get_balance", "arguments": {"account": "x"}}\n'
        '</tool_call><tool_call>{"name": "noop"}'
    )
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_balance", {"account": "x"}),
        ("noop", {}),
    ]
    assert parse_hermes_tool_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    assert parse_hermes_tool_calls("plain") == ("plain", [])


async def test_a_chat_completion_returns_the_models_own_ids_and_logprobs(
    model_dir: Path,
) -> None:
    async with ModelServer(model_dir) as server, httpx.AsyncClient(timeout=30) as client:
        models = (await client.get(f"{server.base_url}/models")).json()
        assert models["data"][0]["id"] == "tiny-qwen2"
        assert models["data"][0]["version"] == 0
        body = {
            "model": "tiny-qwen2",
            "messages": MESSAGES,
            "tools": TOOLS,
            "temperature": 0.7,
            "top_p": 0.95,
            "max_tokens": 24,
            "seed": 11,
            "logprobs": True,
            "top_logprobs": 3,
            "return_token_ids": True,
        }
        answer = (await client.post(f"{server.base_url}/chat/completions", json=body)).json()
        again = (await client.post(f"{server.base_url}/chat/completions", json=body)).json()
        tokenized = (await client.post(f"{server.root_url}/tokenize", json=body)).json()
        model = server.model
    prompt, choice = answer["prompt_token_ids"], answer["choices"][0]
    completion = choice["token_ids"]
    assert prompt == tokenized["tokens"]
    assert 0 < len(completion) <= 24
    assert choice["finish_reason"] in {"stop", "length", "tool_calls"}
    assert again["choices"][0]["token_ids"] == completion  # the same seed, the same sample
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert served == pytest.approx(recomputed_logprobs(model, prompt, completion), abs=1e-5)
    for entry in choice["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + 1e-6
    assert answer["usage"]["completion_tokens"] == len(completion)


async def test_a_token_prompt_on_v1_completions_answers_ids_that_decode_to_its_text(
    model_dir: Path,
) -> None:
    async with ModelServer(model_dir, token_route=False) as server:
        tokenizer = server.tokenizer
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        body = {
            "model": "tiny-qwen2",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": 5,
            "logprobs": 2,
            "return_token_ids": True,
        }
        async with httpx.AsyncClient(timeout=30) as client:
            answer = (await client.post(f"{server.base_url}/completions", json=body)).json()
            as_text = {**body, "prompt": tokenizer.decode(prompt)}
            from_text = (await client.post(f"{server.base_url}/completions", json=as_text)).json()
            no_route = await client.post(
                f"{server.base_url}/chat/completions/tokens", json={**body, "tokens": prompt}
            )
        model = server.model
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    ids = choice["token_ids"]
    assert 0 < len(ids) <= 16
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["text"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        recomputed_logprobs(model, prompt, ids), abs=1e-5
    )
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    # The same prompt as text tokenizes to the same ids: the same sample.
    assert from_text["choices"][0]["prompt_token_ids"] == prompt
    assert from_text["choices"][0]["token_ids"] == ids
    assert no_route.status_code == 404  # a plain vllm serve has no token route


@pytest.mark.parametrize("route", ["collective_rpc", "update_weights_from_disk"])
async def test_a_weight_update_changes_the_logprobs_and_the_version(
    model_dir: Path, other_weights: Path, route: str
) -> None:
    body = {
        "model": "tiny-qwen2",
        "messages": MESSAGES[:2],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    async with ModelServer(model_dir) as server, httpx.AsyncClient(timeout=30) as client:
        before = await client.post(f"{server.base_url}/chat/completions", json=body)
        if route == "collective_rpc":
            update = {"method": "reload_weights", "kwargs": {"weights_path": str(other_weights)}}
        else:
            update = {"model_path": str(other_weights), "weight_version": "step-1"}
        answer = await client.post(f"{server.root_url}/{route}", json=update)
        assert answer.status_code == 200, answer.text
        after = await client.post(f"{server.base_url}/chat/completions", json=body)
        models = (await client.get(f"{server.base_url}/models")).json()
        version = (await client.get(f"{server.root_url}/get_weight_version")).json()
        model = server.model
    assert before.headers["x-weight-version"] == "0"
    assert after.headers["x-weight-version"] == "1"
    assert models["data"][0]["version"] == 1
    assert version["weight_version"] == ("1" if route == "collective_rpc" else "step-1")
    old = [e["logprob"] for e in before.json()["choices"][0]["logprobs"]["content"]]
    new_choice = after.json()["choices"][0]
    new = [e["logprob"] for e in new_choice["logprobs"]["content"]]
    assert old != new
    prompt = after.json()["prompt_token_ids"]
    assert new == pytest.approx(
        recomputed_logprobs(model, prompt, new_choice["token_ids"]), abs=1e-5
    )


async def test_fleetrolls_policy_reads_the_servers_ids_and_logprobs(model_dir: Path) -> None:
    from fleetroll.policies import OpenAIChatPolicy, ToolSpec
    from fleetroll.tasks import TaskSpec

    task = TaskSpec(key="t", prompt="What is the balance of account acme-001?", env_key="ledger")
    tools = (ToolSpec(name="get_balance", description="Read.", input_schema={"type": "object"}),)
    messages = [{"role": "user", "content": task.prompt}]
    async with (
        ModelServer(model_dir, default_max_tokens=12) as server,
        OpenAIChatPolicy(
            base_url=server.base_url,
            model=server.model_name,
            return_token_ids=True,
            logprobs=True,
            temperature=1.0,
            timeout_s=30,
        ) as policy,
    ):
        turn = await policy.act(task, messages, tools)
        (path, body), model = server.requests[-1], server.model
    assert path == "/v1/chat/completions"
    data = turn.data
    assert data is not None and data.training_data_error is None
    assert data.prompt_token_ids is not None and data.completion_token_ids is not None
    assert data.logprobs is not None
    assert list(data.prompt_token_ids) == server.tokenizer.encode(
        server.tokenizer.apply_chat_template(
            body["messages"], tools=body["tools"], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    recomputed = recomputed_logprobs(
        model, list(data.prompt_token_ids), list(data.completion_token_ids)
    )
    assert list(data.logprobs) == pytest.approx(recomputed, abs=1e-5)


async def test_processed_logprobs_are_those_of_the_temperature_scaled_distribution(
    model_dir: Path,
) -> None:
    body = {
        "model": "tiny-qwen2",
        "messages": MESSAGES[:2],
        "max_tokens": 12,
        "temperature": 0.5,
        "seed": 2,
        "logprobs": True,
        "return_token_ids": True,
    }
    async with (
        ModelServer(model_dir, logprobs_mode="processed_logprobs") as server,
        httpx.AsyncClient(timeout=30) as client,
    ):
        answer = (await client.post(f"{server.base_url}/chat/completions", json=body)).json()
        model = server.model
    prompt, ids = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float() / 0.5
    scaled = torch.log_softmax(logits, dim=-1)
    expected = [float(scaled[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]
    served = [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]
    assert served == pytest.approx(expected, abs=1e-5)


async def test_trls_vllm_client_generates_through_v1_completions(model_dir: Path) -> None:
    """TRL's own client (its parsing of a batch of token prompts, ``n`` completions
    each, tokens as ``token_id:N``) reads the server's ids and logprobs."""
    import anyio
    import requests

    vllm_client = pytest.importorskip("trl.generation.vllm_client")

    async with ModelServer(model_dir, token_route=False) as server:
        client = object.__new__(vllm_client.VLLMClient)  # its __init__ wants vLLM installed
        client.session, client.base_url, client.model = requests.Session(), server.root_url, "m"
        tokenizer = server.tokenizer
        prompts = [
            tokenizer.encode(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for text in ("Pay the rent.", "What is the balance?")
        ]
        out = await anyio.to_thread.run_sync(
            lambda: client.generate(prompts, n=2, max_tokens=6, generation_kwargs={"seed": 1})
        )
        model = server.model
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4  # prompt-major: 2 per prompt
    for row, completion in enumerate(out["completion_ids"]):
        assert [ids[0] for ids in out["logprob_token_ids"][row]] == completion
        served = [lp[0] for lp in out["logprobs"][row]]
        expected = recomputed_logprobs(model, prompts[row // 2], completion)
        assert served == pytest.approx(expected, abs=1e-5)


async def test_a_generation_keeps_the_weights_it_started_with_across_an_update(
    model_dir: Path, other_weights: Path
) -> None:
    import anyio

    body = {
        "model": "tiny-qwen2",
        "prompt": "The quick brown fox",
        "max_tokens": 300,  # long enough for the update to land mid-generation
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 0,
        "return_token_ids": True,
    }
    answers: list[httpx.Response] = []
    order: list[str] = []
    async with ModelServer(model_dir) as server, httpx.AsyncClient(timeout=30) as client:
        old_model = server.model

        async def complete() -> None:
            answers.append(await client.post(f"{server.base_url}/completions", json=body))
            order.append("answered")

        async with anyio.create_task_group() as tg:
            tg.start_soon(complete)
            while not server.requests:  # the generation has begun
                await anyio.sleep(0.001)
            update = {"model_path": str(other_weights)}
            await client.post(f"{server.root_url}/update_weights_from_disk", json=update)
            order.append("updated")
        assert server.version == 1 and server.model is not old_model
    (answer,) = answers
    choice = answer.json()["choices"][0]
    assert order == ["updated", "answered"]  # the update landed mid-generation
    assert answer.headers["x-weight-version"] == "0"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        # 300 tokens: the KV cache's float32 sums drift from one full pass by ~1e-5
        recomputed_logprobs(old_model, choice["prompt_token_ids"], choice["token_ids"]),
        abs=1e-4,
    )
