"""Prompt -> token ids -> KV block hashes, exactly as the engines compute them.

Tokenization follows vLLM's OpenAI server: a completion prompt is encoded with the tokenizer's
special tokens, a chat is rendered with the model's chat template (generation prompt added) and
encoded without them. Block hashes come from vLLM's own `hash_block_tokens` and hash function,
chained from the same root (`NONE_HASH`, derived from the same seed: the engines run with
PYTHONHASHSEED set to the seed), with the cache salt as extra key of the first block, and
converted to the 64-bit integers vLLM publishes in its KV events. A mismatch here silently
turns every hit into a miss, so tests compare these hashes with the engines' own events.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import KVHashing
from router.kv_index import BlockHash
from router.openai_requests import RENDERING_PARAMETERS


class PromptHasher:
    def __init__(self, model: Path, hashing: KVHashing) -> None:
        from transformers import AutoTokenizer
        from vllm.utils.hashing import get_hash_fn_by_name

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.block_size = hashing.block_size
        self._hash_fn = get_hash_fn_by_name(hashing.algorithm)
        self._root = self._hash_fn(hashing.seed)

    # --- tokens -------------------------------------------------------------------------------
    def completion_tokens(
        self, prompt: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]
    ) -> list[int]:
        """Token ids of a completion prompt (the first one, when several are given)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        first = prompt[0]
        if isinstance(first, int):
            return list(prompt)  # type: ignore[arg-type]
        return self.completion_tokens(first)  # type: ignore[arg-type]

    def chat_tokens(self, messages: Sequence[dict[str, Any]], options: dict[str, Any]) -> list[int]:
        """Token ids of a chat request, rendered with the model's chat template."""
        conversation = [_with_parsed_arguments({**m, "content": _text_content(m.get("content"))}) for m in messages]
        continue_final = bool(options.get("continue_final_message", False))
        # The model's own template only: the request's options are its variables, never the
        # rendering's parameters (router/openai_requests.py refuses those too).
        variables = {k: v for k, v in (options.get("chat_template_kwargs") or {}).items()
                     if k not in RENDERING_PARAMETERS}
        text = self.tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=bool(options.get("add_generation_prompt", not continue_final)),
            continue_final_message=continue_final,
            tools=_tools_as_vllm_renders(options.get("tools")),
            **variables,
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    # --- hashes -------------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """The 64-bit hashes vLLM publishes for the full blocks of `token_ids`."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        hashes: list[BlockHash] = []
        parent = self._root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = hash_block_tokens(
                self._hash_fn, parent, token_ids[start : start + self.block_size], extra
            )
            hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
        return hashes


def _tools_as_vllm_renders(tools: Any) -> list[dict] | None:
    """`tools` as vLLM hands them to a chat template (its ChatCompletionToolsParam dumped: every
    field of a function, unset ones None); None for what vLLM would refuse (its engine says why)."""
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                              for t in tools):
        return None
    return [{"type": t.get("type", "function"),
             "function": {k: t["function"].get(k) for k in ("name", "description", "parameters")}}
            for t in tools]


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls with their arguments as objects, as vLLM gives templates
    (renderers/chat_utils.py `_postprocess_messages`: JSON text parsed, empty or malformed as {})."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    return {**message, "tool_calls": [_call_with_parsed_arguments(call) for call in calls]}


def _call_with_parsed_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _text_content(content: Any) -> Any:
    """vLLM's "string" content format: the text parts of a message, joined by newlines."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if part.get("type") == "text")
    return content
