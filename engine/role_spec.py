"""What an instance's role decides, in one frozen record per role, read by the engine's host, the
launcher, the pool controller and the router instead of branching on the role.

`COLOCATED` (prefill and decode in one engine) is the engine's own; `prefill.role.PREFILL` and
`decode.role.DECODE` are the disaggregated pools'.
"""

from __future__ import annotations

import dataclasses
import enum


class Role(enum.StrEnum):
    """What an instance does in the cluster (the name a role's record goes by)."""

    COLOCATED = "colocated"  # prefill and decode in one engine
    PREFILL = "prefill"  # KV producer
    DECODE = "decode"  # KV consumer


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    kind: Role
    ray_resource: str | None
    """The Ray node resource the role's pool is placed by (cluster YAMLs give nodes a role);
    None: any node."""
    kv_transfer: bool = False
    """Hands prompts' KV over between the pools, through the store or directly (NIXL): runs a KV
    connector always (a colocated engine runs one only with a shared store)."""
    direct_kv_role: str = "kv_both"
    """vLLM's `kv_role` when KV goes directly from prefill to decode (NixlConnector): the prefill
    pool produces, the decode pool consumes. Through the store every role is both (see
    engine/server_command.kv_transfer_config)."""
    serves_clients: bool = True
    """The router sends clients' requests there and streams the answers back."""
    takes_remote_prefills: bool = False
    """The router sends it the prefill half of requests served elsewhere."""
    waits_on_queue: bool = True
    """Requests wait in the router's queue for this pool (its depth grows the pool)."""
    prefills: bool = True
    """Computes prompts: a time-to-first-token target applies to its pool."""

    @property
    def name(self) -> str:
        return self.kind.value


COLOCATED = RoleSpec(Role.COLOCATED, ray_resource=None)

# Every engine with a KV connector: vLLM's synchronous scheduling and its V1 model runner, where a
# recompute after a failed KV load starts from the right offset (vllm#49250, open; the CUDA test saw it).
KV_CONNECTOR_VLLM_ARGS = ("--no-async-scheduling",)
KV_CONNECTOR_ENV = (("VLLM_USE_V2_MODEL_RUNNER", "0"),)
