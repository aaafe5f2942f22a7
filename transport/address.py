"""The address this process serves on: engines' servers and sockets and store shards bind to it,
and peers reach them there."""

from __future__ import annotations


def node_address() -> str:
    """The address this process's Ray node uses (loopback on a one-machine cluster)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
