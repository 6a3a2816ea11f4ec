"""A tiny Qwen2-shaped causal language model and its tokenizer, built here, for tests.

Everything is made on this machine, from a seed: no download, no hub. The
model is a :class:`transformers.Qwen2ForCausalLM` built from a config (a few
layers, hidden size 64; with ``TinyModelSpec(num_experts=...)`` a
:class:`transformers.Qwen2MoeForCausalLM`, a mixture of experts) with random
weights drawn from a seeded generator;
the tokenizer is a byte-level BPE trained with the ``tokenizers`` library on
a small built-in corpus (agent and tool-calling text), so any text encodes
and decodes back exactly. It carries Qwen2.5's chat tokens and a Qwen2.5-style
chat template: a system prompt, tools rendered hermes-style inside
``<tools></tools>``, the assistant's tool calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, tool answers as
``<tool_response>`` blocks in a user turn, and the generation prompt::

    model, tokenizer = build_tiny_model(seed=0)
    path = save_tiny_model(tmp_path / "tiny", seed=0)   # save_pretrained of both
    model, tokenizer = load_tiny_model(path)

Same seed, same weights and same tokenizer (the tests check both). Building
takes well under a second on a CPU.

Needs the ``train`` extra (torch, transformers, tokenizers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "VISION_TOKENS",
    "TinyModelSpec",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "load_tiny_model",
    "save_tiny_model",
]

#: Control tokens (special: decoding with ``skip_special_tokens`` drops them).
#: ``<|endoftext|>`` pads; ``<|im_end|>`` ends a message (the end of a completion).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen2-VL's vision tokens (special), added with ``TinyModelSpec(vision=True)``:
#: a prompt holds ``<|vision_start|>``, ``<|image_pad|>`` once per 28x28 block
#: of the resized image, ``<|vision_end|>``.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
#: Tool markup: added tokens (one id each) that stay in decoded text, as in
#: Qwen2.5's tokenizer, so a hermes parser finds them in a completion's text.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: Qwen2.5-Instruct's chat template, with a shorter default system prompt.
#: Tool calls' ``arguments`` must be objects (the server decodes OpenAI's JSON
#: strings first, as vLLM does).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM_PROMPT + "' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name'
    " and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first)'
    ' or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}"
    '{%- elif message.role == "assistant" %}'
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    '{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    '{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}'
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: What the tokenizer learns its merges from: the shapes of text an agent sees
#: and writes (prompts, tool schemas, calls and answers). Byte-level, so text
#: outside it still encodes (in more tokens).
_CORPUS = (
    "You are a helpful assistant. Use the tools to answer the user's question.",
    "What is the balance of account acme-001? Please check and report back.",
    "Find the customer named Ada Lovelace and update her email address.",
    "Create a ticket titled 'Printer jammed' with priority high, then close it.",
    "List the open invoices for the last 30 days and sum their totals in USD.",
    "Click the Submit button, then take a screenshot of the confirmation page.",
    "The account balance is 1,250.00 USD. The transfer was completed successfully.",
    "Error: the record was not found. Try a different identifier or search again.",
    "I called the tool and the result shows three matching rows in the table.",
    "Done. The task is complete: the ticket is closed and the customer notified.",
    'SELECT id, name, email FROM customers WHERE name LIKE "%Ada%" ORDER BY id;',
    '{"type": "function", "function": {"name": "get_balance", "description": '
    '"Read an account\'s balance", "parameters": {"type": "object", "properties": '
    '{"account": {"type": "string"}}, "required": ["account"]}}}',
    '{"name": "search", "arguments": {"query": "open invoices", "limit": 10}}',
    '{"name": "update_record", "arguments": {"id": 42, "fields": {"status": "closed"}}}',
    '{"result": {"rows": [{"id": 1, "total": 99.5}, {"id": 2, "total": 12}]}, "ok": true}',
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' \" _ # @ & % $ ~ ^ | \\",
    "The quick brown fox jumps over the lazy dog. Numbers: 3.14, 2.71, 42, 1000.",
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of the tiny model (Qwen2's config names).

    Args:
        seed: draws the weights (the tokenizer's training is deterministic).
        num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
        num_key_value_heads: Qwen2's; grouped-query attention by default.
        vocab_merges: how many BPE merges the tokenizer learns (its vocabulary
            is the 256 bytes, the merges and the added tokens).
        initializer_range: the standard deviation of the random weights;
            larger than Qwen's 0.02, so the next-token distributions are not
            all nearly uniform.
        max_position_embeddings: the context length.
    """

    seed: int = 0
    num_hidden_layers: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_merges: int = 256
    initializer_range: float = 0.2
    max_position_embeddings: int = 4096
    #: A mixture of experts when > 0 (:class:`transformers.Qwen2MoeForCausalLM`:
    #: every layer's MLP is this many experts of ``intermediate_size``, of which
    #: the router picks ``num_experts_per_tok`` per token); 0: dense Qwen2.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    #: The tokenizer also carries :data:`VISION_TOKENS` (a vision-language-shaped
    #: model's prompt; there is no vision tower: the test server expands the
    #: placeholders and the model reads them as tokens).
    vision: bool = False


def build_tiny_tokenizer(
    corpus: Iterable[str] = (), *, vocab_merges: int = 256, vision: bool = False
) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained here on the built-in corpus plus ``corpus``.

    Carries :data:`SPECIAL_TOKENS`, :data:`TOOL_TOKENS` and :data:`CHAT_TEMPLATE`;
    ``eos_token`` is ``<|im_end|>``, ``pad_token`` ``<|endoftext|>``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + vocab_merges,
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=False,
    )
    texts = [*_CORPUS, *corpus]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    special = SPECIAL_TOKENS + (VISION_TOKENS if vision else ())
    tokenizer.add_special_tokens([AddedToken(token, normalized=False) for token in special])
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in TOOL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(
    spec: TinyModelSpec | None = None, *, seed: int | None = None, corpus: Iterable[str] = ()
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The tiny model (random weights from ``spec.seed``, in eval mode, float32) and
    its tokenizer. ``seed`` overrides ``spec.seed``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    if seed is not None:
        spec = TinyModelSpec(**{**_fields(spec), "seed": seed})
    tokenizer = build_tiny_tokenizer(corpus, vocab_merges=spec.vocab_merges, vision=spec.vision)
    ids = tokenizer.convert_tokens_to_ids
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    config: Any = Qwen2Config(**common)
    architecture: Any = Qwen2ForCausalLM
    if spec.num_experts:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.intermediate_size,
            shared_expert_intermediate_size=spec.intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
        architecture = Qwen2MoeForCausalLM
    # The weights come from this seed alone: the global generator is saved and
    # restored around the initialisation, so callers' random state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = architecture(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
        do_sample=True,
    )
    model.eval()
    return model, tokenizer


def save_tiny_model(
    directory: str | Path, spec: TinyModelSpec | None = None, *, seed: int | None = None
) -> Path:
    """Build the tiny model and save it and its tokenizer (``save_pretrained``) in
    ``directory``; return the directory."""
    path = Path(directory)
    model, tokenizer = build_tiny_model(spec, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny_model(directory: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (eval mode, float32) and tokenizer saved in ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model.eval()
    return model, tokenizer


def _fields(spec: TinyModelSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in TinyModelSpec.__slots__}
