"""Colocated instances sharing the KV store (`serve --shared-store`): which clusters may, and the
engine each then runs (the store's connector, with the settings every KV connector needs)."""

from __future__ import annotations

import argparse
import json

import pytest

from decode.role import DECODE
from deploy.cli import main
from deploy.serve import _store_bytes
from deploy.topology import Topology
from engine.config import EngineConfig
from engine.role_spec import COLOCATED, KV_CONNECTOR_ENV, KV_CONNECTOR_VLLM_ARGS
from engine.server_command import server_command, server_env
from security.credentials import ClusterCredentials

GIB = 1024**3


def flags(shared_store: bool, kv_transfer: str = "store") -> argparse.Namespace:
    return argparse.Namespace(shared_store=shared_store, store_gib=2.0, kv_transfer=kv_transfer)


def test_a_store_runs_for_pd_through_it_and_for_colocated_instances_that_share_it():
    colocated, pd = Topology.from_args(2), Topology.from_args(0, 1, 1)
    assert _store_bytes(flags(False), colocated) == 0
    assert _store_bytes(flags(True), colocated) == 2 * GIB
    assert _store_bytes(flags(False), pd) == 2 * GIB
    assert _store_bytes(flags(False, kv_transfer="direct"), pd) == 0


@pytest.mark.parametrize("topology, refusal", [
    (Topology.from_args(0, 1, 1), "is for colocated instances"),
    (Topology.from_args(1, models=("a", "b")), "serves one model"),
    (Topology.from_args(1, standby=1, sleeping_standbys=True), "sleeping engines"),
    (Topology.from_args(1, sleep_when_idle=True), "sleeping engines"),
])
def test_a_shared_store_is_refused_where_it_cannot_serve_right(topology, refusal):
    with pytest.raises(ValueError, match=refusal):
        _store_bytes(flags(True), topology)


def test_serve_refuses_a_shared_store_for_pd_before_starting_anything(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), "--prefill", "1", "--decode", "1", "--shared-store"]) == 2
    assert "--shared-store is for colocated instances" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("shares", [False, True])
def test_a_colocated_engine_runs_the_stores_connector_only_when_it_shares_the_store(tmp_path, shares):
    (tmp_path / "config.json").write_text("{}")
    endpoints = ("tcp://127.0.0.1:7001",) if shares else ()
    config = EngineConfig(model=tmp_path, served_model_name="m", role=COLOCATED, kv_store_endpoints=endpoints)
    command = server_command(config, "127.0.0.1", 8000, "colocated-0")
    env = server_env(config, "127.0.0.1", "colocated-0", keys("colocated-0"), None)
    assert config.runs_kv_connector == shares
    assert ("--kv-transfer-config" in command) == shares
    assert all((arg in command) == shares for arg in KV_CONNECTOR_VLLM_ARGS)
    assert all((env.get(name) == value) == shares for name, value in KV_CONNECTOR_ENV)
    if shares:
        transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert (transfer["kv_connector"], transfer["kv_role"]) == ("StoreConnector", "kv_both")
        assert transfer["kv_connector_extra_config"]["endpoints"] == list(endpoints)
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env  # no NIXL agent beside the store's connector


def test_a_pd_engine_runs_a_connector_with_its_settings_through_the_store_or_directly(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for endpoints, connector in ((("tcp://127.0.0.1:7001",), "StoreConnector"), ((), "NixlConnector")):
        config = EngineConfig(model=tmp_path, served_model_name="m", role=DECODE, kv_store_endpoints=endpoints)
        command = server_command(config, "127.0.0.1", 8000, "decode-0")
        env = server_env(config, "127.0.0.1", "decode-0", keys("decode-0"), None)
        assert json.loads(command[command.index("--kv-transfer-config") + 1])["kv_connector"] == connector
        assert all(arg in command for arg in KV_CONNECTOR_VLLM_ARGS)
        assert all(env.get(name) == value for name, value in KV_CONNECTOR_ENV)
        # vLLM's NixlConnector meets its peer on a side channel; the store's connector has none
        assert ("VLLM_NIXL_SIDE_CHANNEL_PORT" in env) == (connector == "NixlConnector")


def keys(instance_id: str):
    return ClusterCredentials.generate().engine_host_keys(instance_id).new_process("127.0.0.1")
