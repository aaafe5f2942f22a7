"""Shared fixtures. End-to-end tests share one `pdcluster serve` (tiny model) per session."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from engine.environment import RAY_LOOPBACK_ENV, UCX_LOOPBACK_ENV
from security.credentials import SECRET_ENV, ClusterCredentials

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / ".cache" / "test-artifacts"
SERVED_MAX_LOGPROBS = 8
# The `served` cluster's engines and the tiny model's oracle run with these vLLM options of a
# user's (none changes the answers to tests/oracle.py's prompts): tool calls parsed, fewer logprobs.
TINY_ENGINE_ARGS = (f"--max-logprobs={SERVED_MAX_LOGPROBS}", "--enable-auto-tool-choice", "--tool-call-parser=hermes")
os.environ.setdefault("PDCLUSTER_MODEL_ROOT", str(REPO / ".cache" / "models"))
# Any Ray this test process starts stays on loopback (read when ray is first imported).
os.environ.update(RAY_LOOPBACK_ENV)
os.environ.update(UCX_LOOPBACK_ENV)  # NIXL agents of the tests themselves
os.environ.update(DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1")  # no usage reports, as engines send none
# One cluster secret for the session: every `pdcluster serve` the tests start uses it, and the
# tests present the credentials derived from it (never the user's own secret file).
os.environ.setdefault(SECRET_ENV, ClusterCredentials.generate().secret.hex())
os.environ.update(ClusterCredentials.load().ray_auth_env())  # Ray in this process: the same token


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where end-to-end tests keep server logs (kept after the run, for reading failures)."""
    return ARTIFACTS


@functools.cache
def built_model(name: str) -> Path:
    """A model of engine.models.BUILDERS, built once (in a child process, as torch must not load
    here) into the test model root; checked once a session (a child costs a second of import)."""
    import subprocess
    import sys

    from engine.models import default_model_root

    path = default_model_root() / name
    subprocess.run([sys.executable, "-m", "deploy.cli", "model", name, str(path)], check=True)
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight model."""
    return built_model("tiny")


@pytest.fixture(scope="session")
def model_dir():
    """`model_dir(name)`: the folder of a model of engine.models.BUILDERS, built once."""
    return built_model


class Oracle:
    """Plain vLLM's answers for models of engine.models.BUILDERS served under their builder names,
    computed once per session: `oracle(model)` to tests/oracle.py's PROMPTS (`oracle(model, 2)`:
    vLLM's own tensor parallelism over two ranks, one core each), and `oracle.tool_calls()` to
    tests/tool_calls.py's requests (the tiny model, TINY_ENGINE_ARGS)."""

    def __init__(self, artifacts: Path) -> None:
        self.artifacts = artifacts
        self._answers: dict[tuple[str, int], dict] = {}
        self._tool_answers: dict = {}

    def __call__(self, model: str, tensor_parallel_size: int = 1) -> dict:
        if (model, tensor_parallel_size) not in self._answers:
            self._ask(model, tensor_parallel_size)
        return self._answers[model, tensor_parallel_size]

    def tool_calls(self) -> dict:
        self("tiny")
        return self._tool_answers

    def _ask(self, model: str, tensor_parallel_size: int) -> None:
        import oracle
        import tool_calls

        from engine.config import EngineConfig, TensorParallel
        from engine.engine_args import EngineArgs

        args = EngineArgs(every_pool=TINY_ENGINE_ARGS if model == "tiny" else ())
        config = EngineConfig(model=built_model(model), served_model_name=model, engine_args=args,
                              tensor_parallel=TensorParallel(every_pool=tensor_parallel_size))
        core = "|".join(str(rank) for rank in range(tensor_parallel_size)) if tensor_parallel_size > 1 else "1"
        log = self.artifacts / f"plain-vllm-{model}-tp{tensor_parallel_size}.log"
        with oracle.PlainVLLM(config, log, core=core) as server:
            self._answers[model, tensor_parallel_size] = oracle.warmed_up_answers(server.url, model)
            if model == "tiny" and tensor_parallel_size == 1:
                self._tool_answers = tool_calls.ask_all(server.url, model)


@pytest.fixture(scope="session")
def oracle(artifacts) -> Oracle:
    return Oracle(artifacts)


@pytest.fixture(scope="session")
def served_max_logprobs() -> int:
    """The `--max-logprobs` the `served` cluster's engines are given (`--engine-arg`)."""
    return SERVED_MAX_LOGPROBS


@pytest.fixture(scope="session")
def served(tiny_model):
    """One colocated tiny-model engine behind the router, for the whole session; with a vLLM engine
    arguments of a user's (TINY_ENGINE_ARGS), as the tiny model's oracle."""
    from loadtest.local_cluster import LocalServer

    server = LocalServer(["--model", "tiny", "--kv-cache-gib", "1", *(f"--engine-arg={a}" for a in TINY_ENGINE_ARGS)],
                         ARTIFACTS / "serve-colocated.log")
    with server:
        yield server
