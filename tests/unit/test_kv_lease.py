"""P/D direct: how long a prefill instance keeps a prompt's KV for its decode instance (vLLM's
NixlConnector lease) and how long the router waits for a prefill come from one flag."""

from __future__ import annotations

import argparse
import json

import pytest

from decode.role import DECODE
from deploy.serve import _engine_args, _engine_configs, _router_config
from deploy.serve_flags import add_serve_parser
from deploy.topology import Topology
from engine.server_command import server_command
from prefill.role import PREFILL


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), lambda args: 0)
    return parser.parse_args(["serve", *flags])


@pytest.mark.parametrize("lease, deadline", [(None, 60.0), (40, 30.0)])
def test_both_pools_hold_kv_for_the_lease_and_the_router_waits_for_a_prefill_within_it(tiny_model, lease, deadline):
    args = serve_args("--model", str(tiny_model), "--prefill", "1", "--decode", "1", "--kv-transfer", "direct",
                      *(("--kv-lease", str(lease)) if lease else ()))
    topology, models = Topology.from_args(0, 1, 1), [(tiny_model, "tiny")]
    [config] = _engine_configs(args, models, topology, _engine_args(args, topology))
    held = set()
    for role in (PREFILL, DECODE):
        command = server_command(config.model_copy(update={"role": role}), "127.0.0.1", 8000, f"{role.kind}-0")
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "NixlConnector"
        held.add(transfer["kv_connector_extra_config"]["kv_lease_duration"])
    assert held == {lease or config.kv_lease_s} == {config.kv_lease_s}
    router = _router_config(args, models, [config], "00" * 32)
    assert router.kv_lease_s == config.kv_lease_s
    assert router.prefill_deadline_s == deadline  # the default lease leaves prefill_timeout_s's 60 s
