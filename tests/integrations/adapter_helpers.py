"""What the adapters' tests share: the tiny model served, fleetroll's settings for it,
and each completion token's logprob recomputed by the model itself."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.from_thread

from fleetroll.settings import config_dir
from fleetroll.testing.model_server import ModelServer
from fleetroll.testing.tiny_model import save_tiny_model

TASKS = config_dir() / "tasks" / "ledger.jsonl"


@contextmanager
def served_model(root: Path) -> Iterator[tuple[Path, ModelServer]]:
    """The tiny random model saved under ``root``, served by the vLLM-shaped test server."""
    path = save_tiny_model(root / "tiny", seed=0)
    with anyio.from_thread.start_blocking_portal() as portal:
        server = ModelServer(path, default_max_tokens=8)
        with portal.wrap_async_context_manager(server):
            yield path, server


def settings_overrides(server: ModelServer) -> dict[str, Any]:
    """fleetroll's settings (``load_settings(**...)``) for the test server."""
    return {
        "policy": {
            "kind": "openai",
            "base_url": server.base_url,
            "model": server.model_name,
            "temperature": 1.0,
            "max_tokens": 8,
        },
        "telemetry": {"db_path": os.devnull},
    }


def assert_logprobs_are_the_models(
    model: Any,
    prompt: Sequence[int],
    completion: Sequence[int],
    mask: Sequence[int],
    logprobs: Sequence[float],
) -> None:
    """Each masked token's logprob, recomputed with one forward pass of ``model``, is
    the one answered (within 1e-4): the ids are exactly what the server generated."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prompt, *completion]])).logits[0].float()
    start = len(prompt) - 1
    ours = torch.log_softmax(logits[start : start + len(completion)], dim=-1)
    ours = ours.gather(1, torch.tensor(list(completion)).unsqueeze(1)).squeeze(1)
    on = torch.tensor(list(mask), dtype=torch.bool)
    assert bool(on.any())
    assert torch.allclose(ours[on], torch.tensor(list(logprobs))[on], atol=1e-4)


def failing_for(prompt: str) -> Any:
    """A fake chat server's script: ``prompt``'s rollouts fail (the server errs:
    no reward, an infrastructure failure); the others answer "done"."""
    from fleetroll.testing.fake_openai import completion

    def script(body: dict[str, Any]) -> Any:
        asked = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if asked == prompt:
            raise RuntimeError("the policy server fails for this task")
        return completion("done")

    return script
