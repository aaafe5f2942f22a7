"""Shared fixtures. End-to-end tests share one `pdcluster serve` (tiny model) per session."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import warnings
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


def built_model(name: str) -> Path:
    """A model of engine.models.BUILDERS, built once (in a child process, as torch must not load
    here) into the test model root; checked once a session (a child costs a second of import).
    One build at a time: the oracles' thread and a test may want the same model first."""
    with _BUILDING:
        return _built_model(name)


_BUILDING = threading.Lock()


@functools.cache
def _built_model(name: str) -> Path:
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


OracleKey = tuple[str, int]  # a model of engine.models.BUILDERS and a tensor-parallel size
WANTED_ORACLES = pytest.StashKey[list]()


def oracle_keys(mark: pytest.Mark) -> list[OracleKey]:
    """The keys an `oracles` mark names: model names (at TP=1), or (model, TP) pairs."""
    return [(key, 1) if isinstance(key, str) else tuple(key) for key in mark.args]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "oracles(*keys): the plain-vLLM answers a test compares with "
                            "(model names, or (model, tensor-parallel size) pairs), computed ahead (Oracle)")


def pytest_collection_finish(session) -> None:
    """The oracles the selected tests want, in the order they run: what Oracle computes ahead.
    None in a pytest-xdist worker, which collects every test but runs only those it is sent, in
    no order known here: there each oracle is computed when asked for."""
    wanted: list[OracleKey] = []
    for item in session.items if not hasattr(session.config, "workerinput") else ():
        for mark in item.iter_markers("oracles"):
            wanted += [key for key in oracle_keys(mark) if key not in wanted]
    session.config.stash[WANTED_ORACLES] = wanted


class Oracle:
    """Plain vLLM's answers for models of engine.models.BUILDERS served under their builder names,
    computed once per session: `oracle(model)` to tests/oracle.py's PROMPTS (`oracle(model, 2)`:
    vLLM's own tensor parallelism over two ranks, one core each), and `oracle.tool_calls()` to
    tests/tool_calls.py's requests (the tiny model, TINY_ENGINE_ARGS).

    One plain vLLM at a time computes them, in a thread of its own, starting with those the
    session's tests name (`pytest.mark.oracles`) in the order they run: an oracle's start and
    prompts (49-115 s each here) overlap the tests' own engine starts, which had left a core
    idle much of the time, instead of adding to them."""

    def __init__(self, artifacts: Path, wanted: list[OracleKey]) -> None:
        self.artifacts = artifacts
        self._computing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="oracle")
        self._answers: dict[OracleKey, concurrent.futures.Future] = {}
        self._tool_answers: dict = {}
        self._server = None  # the plain vLLM started last, stopped by `close`
        self._closed = threading.Event()  # also ends a plain vLLM's start (PlainVLLM's `stopped`)
        for key in wanted:
            self._ahead(key)

    def __call__(self, model: str, tensor_parallel_size: int = 1) -> dict:
        key = (model, tensor_parallel_size)
        if self._answers and key not in self._answers:  # none named: an xdist worker, or no marks
            warnings.warn(f"oracle {key} computed on demand: name it in the test's pytest.mark.oracles", stacklevel=2)
        return self._ahead(key).result(timeout=1200)

    def tool_calls(self) -> dict:
        self("tiny")
        return self._tool_answers

    def close(self) -> None:
        """Compute nothing more; stop a plain vLLM still running (a session cut short)."""
        self._closed.set()
        self._computing.shutdown(wait=False, cancel_futures=True)
        if (server := self._server) is not None:
            server.__exit__()

    def _ahead(self, key: OracleKey) -> concurrent.futures.Future:
        """`key`'s answers, being computed or done; asked again where they failed (a start that
        timed out fails the test that waited, not every later one)."""
        known = self._answers.get(key)
        if known is None or (known.done() and not known.cancelled() and known.exception() is not None):
            self._answers[key] = self._computing.submit(self._ask, *key)
        return self._answers[key]

    def _ask(self, model: str, tensor_parallel_size: int) -> dict:
        import oracle
        import tool_calls

        from engine.config import EngineConfig, TensorParallel
        from engine.engine_args import EngineArgs

        args = EngineArgs(every_pool=TINY_ENGINE_ARGS if model == "tiny" else ())
        config = EngineConfig(model=built_model(model), served_model_name=model, engine_args=args,
                              tensor_parallel=TensorParallel(every_pool=tensor_parallel_size))
        core = "|".join(str(rank) for rank in range(tensor_parallel_size)) if tensor_parallel_size > 1 else "1"
        log = self.artifacts / f"plain-vllm-{model}-tp{tensor_parallel_size}.log"
        self._server = server = oracle.PlainVLLM(config, log, core=core, stopped=self._closed)
        with server:
            answers = oracle.warmed_up_answers(server.url, model)
            if model == "tiny" and tensor_parallel_size == 1:
                self._tool_answers = tool_calls.ask_all(server.url, model)
        return answers


@pytest.fixture(scope="session", autouse=True)
def oracles_ahead(request) -> None:
    """The session's oracles start computing with its first test, whichever it is."""
    if request.config.stash.get(WANTED_ORACLES, []):
        request.getfixturevalue("oracle")


@pytest.fixture(scope="session")
def oracle(artifacts, pytestconfig):
    computed = Oracle(artifacts, pytestconfig.stash.get(WANTED_ORACLES, []))
    try:
        yield computed
    finally:
        computed.close()


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
