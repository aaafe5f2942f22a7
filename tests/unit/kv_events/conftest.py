"""The KV event tests' fixtures: this process stands in for an engine (the keys its host gives),
and each test gets a PUB and a replay endpoint of its own."""

from __future__ import annotations

import pytest
from kv_event_parts import CREDENTIALS, fresh_endpoints


@pytest.fixture(autouse=True)
def engine_keys(monkeypatch):
    """Our publishers find the keys where an engine's host puts them."""
    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())


@pytest.fixture
def endpoints() -> tuple[str, str]:
    return fresh_endpoints()
