"""Plain vLLM as the oracle: the same checkpoint served by vLLM's own OpenAI server, started the
plain way (weights from disk, no worker extension, no KV connector, no pdcluster code), with the
settings our engines use; the same requests; greedy token ids and top-5 logprobs compared.

A test that compares pdcluster only with pdcluster cannot catch a mistake both sides share (the
tied-embedding reload did exactly that): every serving path is checked against this.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.environment import engine_env, free_port
from engine.process import terminate_group
from security.credentials import SECRET_ENV
from security.engine_access import EngineAccess

MAX_TOKENS = 16
TOP_LOGPROBS = 5
# A greedy answer may leave vLLM's own token only where two candidates are this close (nats):
# computing KV in a different batch or loading it instead of computing it moves logprobs by
# rounding (measured below 0.02 on these models), and a near-tie can then flip.
NEAR_TIE = 0.05
# Where the tokens agree, the top-5 lists share at least TOP_SHARED tokens, and each shared token's
# logprob agrees within LOGPROB_ABS + LOGPROB_REL x |logprob|: bf16 logits of magnitude 16-32 are
# 0.125 apart, and computing the same prompt another way moves them (measured on SmolLM2: 0.125
# when batched with other requests; 0.37 at a logprob of -8.1 through P/D, where the decode
# instance's attention reads the prefill's KV with its decode kernel; 0 on the tiny models).
LOGPROB_ABS, LOGPROB_REL, TOP_SHARED = 0.15, 0.08, 3
LONG_TEXT = " ".join(f"Section {k}: the prefill computes this sentence once and the decode reads it back."
                     for k in range(40))
WARM_UP = "A warm-up request that shares no prefix with the prompts under test. " * 8
QUESTION = "What is the capital of France? One word."
# name -> request body without model and sampling fields: completions and chats, a prompt shorter
# than a KV block, one of many blocks (~700 tokens: 20+ blocks of 32).
PROMPTS: dict[str, dict] = {
    "completion-short": {"prompt": "Hello, my name is"},
    "completion-long": {"prompt": LONG_TEXT},
    "chat-question": {"messages": [{"role": "user", "content": QUESTION}]},
    "chat-long-system": {"messages": [{"role": "system", "content": LONG_TEXT[:1800]},
                                      {"role": "user", "content": "Which section comes first?"}]},
}


@dataclasses.dataclass(frozen=True)
class Answer:
    """A greedy answer: its token ids and, per generated token, the top-5 alternatives."""

    token_ids: tuple[int, ...]
    top_logprobs: tuple[dict[str, float], ...]
    text: str


def request_body(model: str, prompt: dict) -> tuple[str, dict]:
    """The endpoint and the whole greedy request for one of PROMPTS."""
    body = {"model": model, **prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    if "messages" in prompt:
        return "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
    return "/v1/completions", body | {"logprobs": TOP_LOGPROBS}


def ask(to: str | EngineAccess, model: str, prompt: dict) -> Answer:
    endpoint, body = request_body(model, prompt)
    engine = {"headers": to.headers, "verify": to.ssl} if isinstance(to, EngineAccess) else {}
    url = to.url if isinstance(to, EngineAccess) else to
    response = httpx.post(f"{url}{endpoint}", json=body, timeout=300, **engine)
    assert response.status_code == 200, f"{url}{endpoint}: {response.status_code} {response.text[:500]}"
    choice = response.json()["choices"][0]
    if "messages" in prompt:
        tops = tuple({t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in choice["logprobs"]["content"])
        text = choice["message"]["content"]
    else:
        tops = tuple(choice["logprobs"]["top_logprobs"])
        text = choice["text"]
    return Answer(tuple(choice["token_ids"]), tops, text)


def ask_all(to: str | EngineAccess, model: str, concurrently: bool = False) -> dict[str, Answer]:
    """Every prompt of PROMPTS, one after the other or all at once; `to`: a server's URL (a
    router, plain vLLM) or an engine of ours straight (its access)."""
    if not concurrently:
        return {name: ask(to, model, prompt) for name, prompt in PROMPTS.items()}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {name: pool.submit(ask, to, model, prompt) for name, prompt in PROMPTS.items()}
        return {name: future.result() for name, future in futures.items()}


def differences(ours: dict[str, Answer], oracle: dict[str, Answer]) -> list[str]:
    """Where our answers leave the oracle's, as readable lines (empty: they conform).

    Token ids must be equal; past a position where we took a token the oracle ranked within
    NEAR_TIE nats of its own (a near-tie), the rest is not compared (vLLM's own
    `check_logprobs_close` stops there too). Where tokens agree, the logprobs of the top-5 tokens
    both sides list agree within LOGPROB_ABS + LOGPROB_REL x |logprob|, TOP_SHARED of them at least."""
    found = []
    for name, want in oracle.items():
        got = ours[name]
        for position, (mine, theirs) in enumerate(zip(got.token_ids, want.token_ids, strict=False)):
            tops_want, tops_got = want.top_logprobs[position], got.top_logprobs[position]
            if mine != theirs:
                if took_the_other_of_a_near_tie(tops_got, tops_want):
                    break  # the rest follows from a different token
                found.append(f"{name}: token {position} is {mine}, vLLM's is {theirs} "
                             f"(ours {got.text!r}, vLLM's {want.text!r})")
                break
            off = {t: (tops_got[t], p) for t, p in tops_want.items()
                   if t in tops_got and abs(tops_got[t] - p) > LOGPROB_ABS + LOGPROB_REL * abs(p)}
            if off or len(tops_want.keys() & tops_got.keys()) < min(TOP_SHARED, len(tops_want)):
                found.append(f"{name}: token {position}: top logprobs differ (ours, vLLM's): "
                             f"{off or (tops_got, tops_want)}")
                break
        else:
            if len(got.token_ids) != len(want.token_ids):
                found.append(f"{name}: {len(got.token_ids)} tokens, vLLM gave {len(want.token_ids)}")
    return found


def took_the_other_of_a_near_tie(tops_got: dict[str, float], tops_want: dict[str, float]) -> bool:
    """Whether our greedy token (our top one) is a token the oracle ranked within NEAR_TIE nats of
    its own choice: a near-tie that rounding may flip, not a different answer."""
    if not tops_got or not tops_want:
        return False
    ours = max(tops_got, key=tops_got.__getitem__)
    return ours in tops_want and max(tops_want.values()) - tops_want[ours] <= NEAR_TIE


class PlainVLLM:
    """vLLM's OpenAI server on a checkpoint, started as vLLM's docs say, with `config`'s model
    settings and one CPU core, as each of our engines gets on a 2-core machine (thread counts
    change how reductions are split, so they are held equal; a tensor-parallel engine, one core
    per rank: "0|1"). Owns its process."""

    def __init__(self, config: EngineConfig, log_path: Path, core: str = "1", start_timeout_s: float = 300,
                 stopped: threading.Event | None = None):
        self.config = config
        self.stopped = stopped or threading.Event()  # set: the start is given up (its owner closes)
        self.log_path = log_path
        self.core = core
        self.start_timeout_s = start_timeout_s
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        c = self.config
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(c.model),
                   "--served-model-name", c.served_model_name, "--host", "127.0.0.1", "--port", str(self.port),
                   "--max-model-len", str(c.max_model_len), "--block-size", str(c.block_size),
                   "--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        command += ["--enforce-eager"] if c.enforce_eager else []
        command += ["--dtype", c.dtype] if c.dtype != "auto" else []
        command += ["--tensor-parallel-size", str(c.tensor_parallel_size)] if c.tensor_parallel_size > 1 else []
        return command + list(c.engine_args.for_role(c.role.kind))

    def __enter__(self) -> PlainVLLM:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # No pdcluster code in vLLM's processes: no plugin of ours, no cluster secret.
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env |= engine_env("127.0.0.1", self.config.kv_cache_gib, self.core) | {"VLLM_PLUGINS": ""}
        with self.log_path.open("w") as log:
            self._process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self.stopped.is_set():
            if self._process.poll() is not None:
                raise RuntimeError(f"plain vLLM exited ({self._process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        if self.stopped.is_set():
            raise RuntimeError("plain vLLM's start given up: its owner closed")
        raise TimeoutError(f"plain vLLM not up in {self.start_timeout_s} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self._process is not None:  # its whole group, and the shared memory vLLM's processes leave
            terminate_group(self._process, grace_s=30)


def oracle_answers(config: EngineConfig, log_path: Path) -> dict[str, Answer]:
    """Plain vLLM's answers to PROMPTS, each computed from scratch (one after the other, each
    prompt a first: no prefix-cache hit between them)."""
    with PlainVLLM(config, log_path) as server:
        return warmed_up_answers(server.url, config.served_model_name)


def oracle_answers_both_ways(config: EngineConfig, log_path: Path) -> tuple[dict[str, Answer], dict[str, Answer]]:
    """Plain vLLM's answers to PROMPTS asked one after the other (as `oracle_answers`), then all
    at once: for a configuration whose answers depend on the batch (FP8 on the H200), what
    `assert_conforms` compares each round with."""
    with PlainVLLM(config, log_path) as server:
        return (warmed_up_answers(server.url, config.served_model_name),
                ask_all(server.url, config.served_model_name, concurrently=True))


def warmed_up_answers(url: str, model: str) -> dict[str, Answer]:
    """PROMPTS' answers from a server just started."""
    # vLLM 0.32's CPU attention uses AMX without asking Linux for it: a short first prompt
    # kills a small model's worker (SIGILL); a long one runs oneDNN first, which asks.
    ask(url, model, {"prompt": WARM_UP})
    return ask_all(url, model)


def assert_conforms(to: str | EngineAccess, model: str, oracle: dict[str, Answer],
                    oracle_concurrent: dict[str, Answer] | None = None) -> None:
    """PROMPTS through `to` (a URL, or an engine's access) give plain vLLM's answers, sent one after
    the other and all at once (compared with `oracle_concurrent` where plain vLLM's own answers
    all at once differ from one after the other)."""
    url = to.url if isinstance(to, EngineAccess) else to
    for concurrently in (False, True):
        found = differences(ask_all(to, model, concurrently), (oracle_concurrent or oracle) if concurrently else oracle)
        assert not found, f"{url} ({'concurrent' if concurrently else 'sequential'}) differs from plain vLLM:\n" + (
            "\n".join(found)
        )
