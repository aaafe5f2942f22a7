"""A validated request -> what routing sees of it: token ids, KV block hashes, text.

Tokenizing (a chat rendered with the model's own template, never a client's) costs time in
proportion to the request: small requests are tokenized on the event loop (a hop elsewhere costs
more than they do), large ones in a small pool of processes with a deadline and a bounded wait,
so a client sending huge prompts slows only its own requests, never the event loop that streams
everyone else's tokens. Processes, not threads: a thread rendering a template holds the GIL, and
the event loop, which gives it up at every socket call, waited up to the switch interval (5 ms)
for it back each time, ~100 ms a request under three huge-prompt clients
(`loadtest.router_overhead --attackers 3`). And niced: on a contested core the event loop goes
first (the others' p99 time to first token under that attack: 4.5x quiet's not niced, 1.4x
niced). Large is judged by the request's body, whatever fields its text sits in; a body larger
than any prompt the model could take is refused untokenized.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import jinja2

from engine.config import KVHashing
from engine.process import die_with_parent
from router.config import RouterConfig
from router.errors import BadRequest, Overloaded
from router.hashing import PromptHasher
from router.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.policies import RoutingRequest

TOKENIZING_NICENESS = 10
"""How much lower the tokenizing processes' CPU priority is than the router's (os.nice)."""


class RequestAnalyzer:
    # Tokenizing a long prompt takes milliseconds: off the event loop beyond this many bytes of body.
    INLINE_BYTES = 4096
    # Room in a body for what is not the prompt (sampling fields, a tool schema) beyond the cap.
    BODY_OVERHEAD_BYTES = 64 * 1024
    # A tokenizing process loads its tokenizers (seconds; tens on a node whose cores engines keep busy).
    START_TIMEOUT_S = 120.0

    def __init__(self, config: RouterConfig) -> None:
        self.block_size = config.block_size
        self.max_chars_per_token = config.max_chars_per_token
        self.models = {m.name: m for m in config.models}
        self.hashers = {m.name: PromptHasher(m.tokenizer, config.kv_hashing) for m in config.models if m.tokenizer}
        """Each model's (the router's hashes are its engines'); a model without one routes on load only."""
        self.timeout_s = config.tokenize_timeout_s
        self._processes = config.tokenize_processes
        self._tokenizers = ({m.name: str(m.tokenizer) for m in config.models if m.tokenizer}, config.kv_hashing)
        self._pool = self._new_pool()
        self._starting: list[concurrent.futures.Future] = []
        self._capacity = config.tokenize_processes + config.tokenize_max_waiting
        self._pending = 0  # long prompts in the pool, running or waiting

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # Spawned: the router's process holds threads (Ray's, the event loop's) a fork would copy.
        return concurrent.futures.ProcessPoolExecutor(self._processes, multiprocessing.get_context("spawn"),
                                                      initializer=_load_tokenizers, initargs=self._tokenizers)

    def start(self) -> None:
        """Start the tokenizing processes now (each loads its tokenizers: seconds), not on the
        first long prompt. None for a router with no tokenizer: it routes on load only."""
        if self.hashers:
            self._starting = [self._pool.submit(_ready) for _ in range(self._processes)]

    async def _started(self) -> None:
        """Until a tokenizing process is up: a prompt's deadline counts its tokenizing, not the
        pool's start."""
        if self._starting and not any(f.done() for f in self._starting):
            waiting = [asyncio.wrap_future(f) for f in self._starting]
            done, _ = await asyncio.wait(waiting, timeout=self.START_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise Overloaded("the tokenizing processes are still starting; retry shortly", retry_after_s=5)

    async def analyze(self, request: SamplingRequest, body_bytes: int) -> RoutingRequest:
        """`request` names a served model (the intake checked it)."""
        text = _prompt_text(request)
        longest = self.models[request.model].max_model_len
        if body_bytes > longest * self.max_chars_per_token + self.BODY_OVERHEAD_BYTES:  # no tokenizer makes it fit
            raise BadRequest(f"the prompt cannot fit the model's {longest} tokens", param="prompt")
        hasher = self.hashers.get(request.model)
        if hasher is None:
            return RoutingRequest((), 0, self.block_size, text)
        try:
            if body_bytes > self.INLINE_BYTES:
                tokens = await self._off_loop(request)
            else:
                tokens = self.token_ids(request)
        except (TypeError, ValueError, jinja2.TemplateError) as exc:  # e.g. a message with no content
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise BadRequest(f"the {param} cannot be tokenized for this model: {exc}", param=param) from None
        if len(tokens) >= longest:  # refused here: the engine never spends on it
            raise BadRequest(f"the prompt has {len(tokens)} tokens; the model takes fewer than {longest}",
                             param="messages" if isinstance(request, ChatCompletionRequest) else "prompt")
        hashes = hasher.block_hashes(tokens, getattr(request, "cache_salt", None))
        return RoutingRequest(hashes, len(tokens), self.block_size, text)

    async def _off_loop(self, request: SamplingRequest) -> list[int]:
        if self._pending >= self._capacity:
            raise Overloaded("too many long prompts are being tokenized; retry shortly", retry_after_s=1)
        self._pending += 1
        try:
            await self._started()
            future = asyncio.get_running_loop().run_in_executor(self._pool, _tokens, request.model,
                                                                *_tokenizing(request))
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())  # when the process is done, not the wait
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise BadRequest(f"the prompt took over {self.timeout_s:g} s to tokenize") from None
        except BrokenProcessPool:  # a tokenizing process died (its pool refuses work since): new ones
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            self.start()
            raise Overloaded("the prompt's tokenizing process failed; retry shortly", retry_after_s=1) from None

    def _release(self) -> None:
        self._pending -= 1

    def token_ids(self, request: SamplingRequest) -> list[int] | None:
        """The prompt's tokens with its model's tokenizer; None for a model the router has none of."""
        hasher = self.hashers.get(request.model)
        return None if hasher is None else _tokens_with(hasher, *_tokenizing(request))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tokenizing(request: SamplingRequest) -> tuple[list[dict] | None, dict[str, Any], Any]:
    """What tokenizing `request` takes, in plain values a process can be sent: a chat's messages
    and template options, or a completion's prompt."""
    if isinstance(request, ChatCompletionRequest):
        return [m.model_dump(exclude_unset=True) for m in request.messages], request.template_options(), None
    assert isinstance(request, CompletionRequest)
    return None, {}, request.prompt


def _tokens_with(hasher: PromptHasher, messages: list[dict] | None, options: dict[str, Any], prompt: Any) -> list[int]:
    return hasher.chat_tokens(messages, options) if messages is not None else hasher.completion_tokens(prompt)


# In a tokenizing process: its own copy of each model's tokenizer.
_HASHERS: dict[str, PromptHasher] = {}


def _load_tokenizers(tokenizers: dict[str, str], hashing: KVHashing) -> None:
    die_with_parent()  # a router killed outright leaves no tokenizing process (~0.5 GB each) behind
    _HASHERS.update({name: PromptHasher(Path(path), hashing) for name, path in tokenizers.items()})
    # Behind the router's event loop for the CPU: a core both want goes to the loop that streams
    # everyone's tokens, not to one client's huge prompt. Only now: the start (seconds of loading
    # tokenizers) at the router's priority, or on a node whose engines keep the cores busy the
    # first long prompt would wait out its deadline for a process still loading.
    os.nice(TOKENIZING_NICENESS)


def _ready() -> None:
    """A task that only makes the pool start a process."""


def _tokens(model: str, messages: list[dict] | None, options: dict[str, Any], prompt: Any) -> list[int]:
    return _tokens_with(_HASHERS[model], messages, options, prompt)


def _prompt_text(request: SamplingRequest) -> str:
    if isinstance(request, ChatCompletionRequest):
        return "\n".join(str(m.content) for m in request.messages if m.content)
    prompt = request.prompt  # type: ignore[attr-defined]
    return prompt if isinstance(prompt, str) else ""
