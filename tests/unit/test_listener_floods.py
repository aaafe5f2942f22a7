"""No stranger can exhaust a listener of ours (docs/security.md, attacks 11.x): the router's and an
engine's HTTP listeners (transport/listener_guard.py) under another local user's 20,000 idle
connections (half a request line each) and 50,000 connect-and-close calls keep their descriptors
bounded and serve: /health, a tenant's request, the router's own requests to an engine. The
router is the app `pdcluster serve` runs, under the same listener settings; the engine is a
stand-in (named so; no vLLM) served exactly as engines are (engine/serving.py)."""

from __future__ import annotations

import resource
import threading
import time

import httpx
import pytest
import uvicorn
from flood import connect_and_close, idle_connections, open_descriptors
from stranger import needs_stranger

from engine.environment import free_port
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import AppStandIn
from router.app import build_app, router_server
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials
from transport.listener_guard import FD_RESERVE, ListenerLimits

pytestmark = [pytest.mark.slow, needs_stranger]
CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
IDLE, CALLS = 20_000, 50_000
KEY = {"authorization": "Bearer key-a"}


async def completion(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices": [{"index": 0, "text": "ok"}]}'})


def serving_router(engine: AppStandIn) -> tuple[uvicorn.Server, str]:
    registry = InstanceRegistry()
    registry.add(engine.instance())
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), port=free_port("127.0.0.1"),
                          api_keys={"key-a": "tenant-a"}, health_interval_s=60, header_timeout_s=2.0,
                          cluster_secret=CREDENTIALS.secret.hex())
    server = router_server(build_app(config, registry), freeze_heap=False)  # this test process's heap
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{config.port}"


def descriptors_ceiling() -> int:
    """What no flood may take this process past: its descriptor limit, less the reserve the
    listeners keep for everything else (ListenerLimits.fitted)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_RESERVE // 2


def test_the_router_serves_through_idle_and_churning_strangers():
    with AppStandIn(completion, "colocated-0", CREDENTIALS) as engine:
        server, url = serving_router(engine)
        try:
            before = open_descriptors_here()
            with idle_connections(server.config.port, IDLE) as held, httpx.Client(timeout=10) as client:
                assert client.get(f"{url}/health").status_code == 200
                answered = client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}, headers=KEY)
                assert answered.status_code == 200, answered.text
                assert open_descriptors_here() < descriptors_ceiling()
                time.sleep(3)  # past the header deadline: the half-sent requests are closed
            assert held["opened"] + held["failed"] == IDLE
            assert held["closed_by_listener"] >= 0.99 * held["opened"], held
            connect_and_close(server.config.port, CALLS)
            with httpx.Client(timeout=10) as client:
                assert client.get(f"{url}/health").status_code == 200
                assert client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"},
                                   headers=KEY).status_code == 200
            assert open_descriptors_here() < before + 64  # nothing left behind
        finally:
            server.should_exit = True


def test_an_engines_listener_serves_its_router_through_idle_and_churning_strangers():
    limits = ListenerLimits.for_engine()
    with AppStandIn(completion, "colocated-0", CREDENTIALS, limits=limits) as engine:
        access, port = engine.access, int(engine.url.rsplit(":", 1)[1])

        def answered() -> int:
            with httpx.Client(timeout=10, headers=access.headers, verify=access.ssl) as client:
                return client.post(f"{access.url}/v1/completions", json={}).status_code

        before = open_descriptors_here()
        with idle_connections(port, IDLE, send="\x16\x03\x01"):  # a TLS record's first bytes
            assert answered() == 200
            assert open_descriptors_here() < descriptors_ceiling()
        connect_and_close(port, CALLS)
        assert answered() == 200
        assert open_descriptors_here() < before + 64


def open_descriptors_here() -> int:
    import os

    return open_descriptors(os.getpid())
