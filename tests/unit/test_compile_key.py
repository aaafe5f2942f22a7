"""An engine's compile cache key (engine/compile_key.py): the same for every engine of one model
and configuration, whatever port and cores its host gave it, so that what one start compiled (or a
peer sent) the next start reads instead of compiling again."""

from __future__ import annotations

import os

import vllm.envs
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

from decode.role import DECODE
from engine.compile_key import CORES, PORT, cores_per_rank
from engine.config import EngineConfig
from engine.environment import COMPILE_KEY_PLUGIN, ENGINE_PLUGINS
from engine.server_command import compile_key_plugin_installed, server_env
from security.credentials import ClusterCredentials


def test_two_engines_on_other_ports_and_cores_key_their_compile_alike(tmp_path, monkeypatch):
    """Two decode engines connected directly to their prefill peers (each with its own NIXL side
    channel port), each on another core: vLLM's own key tells them apart; an engine of ours does
    not (one core each)."""
    (tmp_path / "config.json").write_text("{}")

    def engine_environment(instance_id: str, cores: str) -> dict[str, str]:
        config = EngineConfig(model=tmp_path, served_model_name="m", role=DECODE, cpu_cores=cores)
        keys = ClusterCredentials.generate().engine_host_keys(instance_id).new_process("127.0.0.1")
        return server_env(config, "127.0.0.1", instance_id, keys, None)

    def factors(env: dict[str, str]) -> dict[str, object]:
        monkeypatch.setattr(os, "environ", env)
        return vllm.envs.compile_factors()

    first, second = engine_environment("decode-0", "0"), engine_environment("decode-1", "1")
    original = vllm.envs.compile_factors
    monkeypatch.setattr(vllm.envs, "compile_factors", original)  # undone after the test
    own = factors(first)
    assert own != factors(second)  # vLLM's own key

    monkeypatch.setattr(os, "environ", first)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)  # as vLLM loads them in an engine's processes
    assert set(plugins) == set(ENGINE_PLUGINS)  # each named plugin installed, and no other loaded
    assert compile_key_plugin_installed()  # what a host checks before it starts an engine
    plugins[COMPILE_KEY_PLUGIN]()
    plugins[COMPILE_KEY_PLUGIN]()  # vLLM may load it again in a process: wrapped once
    assert vllm.envs.compile_factors.__wrapped__ is original
    assert factors(first) == factors(second)
    assert set(own) - set(factors(first)) == {PORT}
    assert factors(first)[CORES] == "1"  # how many cores, not which
    assert {name: own[name] for name in factors(first) if name != CORES} == {
        name: value for name, value in factors(first).items() if name != CORES}  # nothing else changed


def test_a_binding_counts_each_ranks_cores():
    bindings = ("0", "2-5", "0-3|4,5", "0,2,4-6|7", "0,0", "0-3,2-5", "3-1", "0-1000000000", "auto", "nobind")
    assert [cores_per_rank(b) for b in bindings] == [
        "1", "4", "4|2", "5|1", "1", "6", "0", "1000000001", "auto", "nobind"]
