"""A CPU rank's compute stays on its own cores in a directly connected P/D engine (engine/rank_cores.py):
vLLM's NixlConnector worker moves the thread that creates it onto the cores `discover_numa_topology`
names, the last of each NUMA node, whatever binding the host gave the rank."""

from __future__ import annotations

import os

import pytest
from vllm.platforms import current_platform
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

from decode.role import DECODE
from engine.config import EngineConfig
from engine.environment import RANK_CORES_PLUGIN, is_cpu_build
from engine.server_command import rank_cores_plugin_installed, server_env
from security.credentials import ClusterCredentials

pytestmark = pytest.mark.skipif(not is_cpu_build(), reason="vLLM's NIXL worker moves no thread on CUDA")


def test_a_direct_pd_engine_of_ours_reserves_no_core_for_nixl(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    platform = type(current_platform)
    monkeypatch.setattr(platform, "discover_numa_topology", platform.discover_numa_topology)  # undone after
    assert current_platform.discover_numa_topology()  # vLLM's: this machine's last core, NIXL's pick
    config = EngineConfig(model=tmp_path, served_model_name="m", role=DECODE, cpu_cores="0")
    keys = ClusterCredentials.generate().engine_host_keys("decode-0").new_process("127.0.0.1")
    monkeypatch.setattr(os, "environ", server_env(config, "127.0.0.1", "decode-0", keys, None))
    assert rank_cores_plugin_installed()  # what a host checks before it starts such an engine
    load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[RANK_CORES_PLUGIN]()  # as vLLM loads it in the engine's processes
    assert current_platform.discover_numa_topology() == []  # the NIXL worker then moves no thread
