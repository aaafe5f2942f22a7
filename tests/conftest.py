"""Shared fixtures. End-to-end tests share one `pdcluster serve` (tiny model) per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.environment import RAY_LOOPBACK_ENV, UCX_LOOPBACK_ENV
from security.credentials import SECRET_ENV, ClusterCredentials

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / ".cache" / "test-artifacts"
os.environ.setdefault("PDCLUSTER_MODEL_ROOT", str(REPO / ".cache" / "models"))
# Any Ray this test process starts stays on loopback (read when ray is first imported).
os.environ.update(RAY_LOOPBACK_ENV)
os.environ.update(UCX_LOOPBACK_ENV)  # NIXL agents of the tests themselves
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
    here) into the test model root."""
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


@pytest.fixture(scope="session")
def oracle(artifacts):
    """`oracle(model)`: plain vLLM's answers to tests/oracle.py's PROMPTS for a model of
    engine.models.BUILDERS served under its builder name, computed once per session."""
    from oracle import oracle_answers

    from engine.config import EngineConfig

    answers: dict[str, dict] = {}

    def of(model: str) -> dict:
        if model not in answers:
            config = EngineConfig(model=built_model(model), served_model_name=model)
            answers[model] = oracle_answers(config, artifacts / f"plain-vllm-{model}.log")
        return answers[model]

    return of


@pytest.fixture(scope="session")
def served(tiny_model):
    """One colocated tiny-model engine behind the router, for the whole session."""
    from loadtest.local_cluster import LocalServer

    server = LocalServer(["--model", "tiny", "--kv-cache-gib", "1"], ARTIFACTS / "serve-colocated.log")
    with server:
        yield server
