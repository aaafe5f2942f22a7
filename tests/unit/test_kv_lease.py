"""P/D direct: how long a prefill engine keeps a prompt's KV for its decode engine (vLLM's
NixlConnector lease, `serve --kv-lease`), and how long a router, its own or any that adopts the
engine, waits for that engine's prefills: no longer than the share of the lease that leaves the
decode engine time to take the request in before the blocks are freed."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from vllm.config import KVTransferConfig

from decode.role import DECODE
from deploy.serve import _engine_args, _engine_configs
from deploy.serve_flags import add_serve_parser
from deploy.topology import Topology
from engine.config import NIXL_KV_LEASE_S, EngineConfig
from engine.environment import free_port
from engine.host import EngineHost
from engine.role_spec import Role
from engine.server_command import server_command
from fleet.instances import InstanceRegistry, described_instance
from loadtest.engine_standin import HOST, StandInIdentity
from prefill.handoff import PrefillHop
from prefill.role import PREFILL
from router.config import RouterConfig
from security.credentials import ClusterCredentials

PREFILL_TIMEOUT_S = RouterConfig.model_fields["prefill_timeout_s"].default


def engine_config(tiny_model, *flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), lambda args: 0)
    args = parser.parse_args(["serve", "--model", str(tiny_model), "--prefill", "1", "--decode", "1", *flags])
    topology = Topology.from_args(0, 1, 1)
    [config] = _engine_configs(args, [(tiny_model, "tiny")], topology, _engine_args(args, topology))
    return config


def vllms_lease(config: EngineConfig) -> float:
    """The lease vLLM's NixlConnector reads from the engine's command line (30 s if none)."""
    command = server_command(config, "127.0.0.1", 8000, f"{config.role.kind}-0")
    transfer = KVTransferConfig(**json.loads(command[command.index("--kv-transfer-config") + 1]))
    assert transfer.kv_connector == "NixlConnector"
    return transfer.get_from_extra_config("kv_lease_duration", 30)


def routers_wait(config: EngineConfig) -> float:
    """How long a router waits for a prefill on the engine `config` starts, as its host describes it."""
    host = EngineHost(config, "prefill-0", host=HOST)
    try:
        lease = host.describe().kv_lease_s
    finally:
        asyncio.run(host.stop())
    credentials = ClusterCredentials.generate()
    stand_in = StandInIdentity("prefill-0", free_port(HOST), credentials)
    instance = described_instance(stand_in.description(role=Role.PREFILL, kv_lease_s=lease), PREFILL, credentials)
    return PrefillHop(InstanceRegistry(), lambda: None, PREFILL_TIMEOUT_S, 2, 30).deadline_s(instance)


@pytest.mark.parametrize("flags, lease, wait", [((), NIXL_KV_LEASE_S, PREFILL_TIMEOUT_S),
                                                    (("--kv-lease", "40"), 40, 30.0)])
def test_both_pools_hold_kv_for_the_lease_and_routers_wait_for_a_prefill_within_it(tiny_model, flags, lease, wait):
    config = engine_config(tiny_model, "--kv-transfer", "direct", *flags)
    assert [vllms_lease(config.model_copy(update={"role": role})) for role in (PREFILL, DECODE)] == [lease, lease]
    assert routers_wait(config.model_copy(update={"role": PREFILL})) == wait  # the default: prefill_timeout_s's


def test_a_prefill_through_the_store_is_waited_for_as_long_as_the_timeout(tiny_model):
    config = engine_config(tiny_model, "--kv-transfer", "store", "--kv-lease", "40")
    stored = config.model_copy(update={"role": PREFILL, "kv_store_endpoints": ("tcp://127.0.0.1:7001",)})
    assert routers_wait(stored) == PREFILL_TIMEOUT_S  # the store keeps the KV: no lease to outrun


def test_a_lease_shorter_than_vllms_heartbeats_allow_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_lease_s"):
        engine_config(tiny_model, "--kv-transfer", "direct", "--kv-lease", "5")
