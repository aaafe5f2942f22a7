"""The router as the unit tests drive it: `pdcluster serve`'s app (router/app.py) over a registry
of the given instances, in process (FastAPI's TestClient), with the session's cluster secret.

    with router_client(instances, policy="round_robin") as client: ...
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.testclient import TestClient

from fleet.instances import Instance, InstanceRegistry
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials

MODEL = ServedModel(name="m", max_model_len=128)


def router_client(instances: Iterable[Instance] = (), raise_server_exceptions: bool = False, **config) -> TestClient:
    """A client of a router over `instances` (model "m", no health checks worth the name, no
    queue), its RouterConfig's other fields from `config`."""
    registry = InstanceRegistry()
    for instance in instances:
        registry.add(instance)
    settings = {"models": (MODEL,), "health_interval_s": 60, "queue_timeout_s": 0,
                "cluster_secret": ClusterCredentials.load().secret.hex(), **config}
    return TestClient(build_app(RouterConfig(**settings), registry), raise_server_exceptions=raise_server_exceptions)
