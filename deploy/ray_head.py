"""The connection to Ray: join a cluster, or start the one-node head on loopback that pdcluster
runs when it is given none.

That head is started two ways: in this process by `start_ray` (`pdcluster serve` without
`--address`), and as `ray start --head` by loadtest/local_cluster.py's `RayHead`, which
outlives the processes using it (a router restart's tests). Both take its settings from `LoopbackHead`, so the
two heads are the same. Ray is imported only inside `start_ray`: it reads the environment
`engine.environment.use_ray()` sets when first imported.
"""

from __future__ import annotations

import dataclasses
import json
import os

from engine.environment import RAY_LOOPBACK_ENV, UCX_LOOPBACK_ENV

RAY_NAMESPACE = "pdcluster"


@dataclasses.dataclass(frozen=True)
class LoopbackHead:
    """A one-node Ray head on loopback: no dashboard, a small object store (tokens and KV never
    pass through Ray), UCX kept on loopback."""

    num_cpus: int
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    node_ip_address: str = "127.0.0.1"
    object_store_bytes: int = 256 * 1024**2
    env: dict[str, str] = dataclasses.field(default_factory=lambda: {**RAY_LOOPBACK_ENV, **UCX_LOOPBACK_ENV})
    """For the head's processes (Ray's token: inherited from the starting process)."""

    def init_kwargs(self) -> dict:
        """The head as `ray.init` starts it in this process."""
        return {"_node_ip_address": self.node_ip_address, "include_dashboard": False, "num_cpus": self.num_cpus,
                "resources": self.resources, "object_store_memory": self.object_store_bytes,
                "runtime_env": {"env_vars": self.env}}

    def start_flags(self) -> list[str]:
        """The head as `ray start --head` starts it (ports and temp dir are the caller's)."""
        return [f"--node-ip-address={self.node_ip_address}", "--include-dashboard=false",
                f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(self.resources)}",
                f"--object-store-memory={self.object_store_bytes}"]


def start_ray(address: str | None, resources: dict[str, float] | None = None) -> bool:
    """Join the Ray cluster at `address`, or start a one-node head on loopback (the caller ran
    `engine.environment.use_ray()` first: token auth, loopback).

    Returns True when this call started the head (and so should stop it).
    """
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        return False
    head = LoopbackHead(num_cpus=max(4, os.cpu_count() or 1), resources=resources or {})
    # address "local": a head of its own, never another Ray found on this machine.
    ray.init(address="local", namespace=RAY_NAMESPACE, log_to_driver=False, **head.init_kwargs())
    return True
