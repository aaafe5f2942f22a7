"""An engine's compile cache key (engine/compile_key.py): the same for every engine of one model
and configuration, whatever port and cores its host gave it, so that what one start compiled (or a
peer sent) the next start reads instead of compiling again."""

from __future__ import annotations

import os

import vllm.envs
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

from decode.role import DECODE
from engine.compile_key import PER_ENGINE_SETTINGS
from engine.config import EngineConfig
from engine.environment import COMPILE_KEY_PLUGIN, ENGINE_PLUGINS
from engine.server_command import server_env
from security.credentials import ClusterCredentials


def test_two_engines_on_other_ports_and_cores_key_their_compile_alike(tmp_path, monkeypatch):
    """Two decode engines connected directly to their prefill peers (each with its own NIXL side
    channel port) on other cores: vLLM's own key tells them apart; an engine of ours does not."""
    (tmp_path / "config.json").write_text("{}")

    def engine_environment(instance_id: str, cores: str) -> dict[str, str]:
        config = EngineConfig(model=tmp_path, served_model_name="m", role=DECODE, cpu_cores=cores)
        keys = ClusterCredentials.generate().engine_host_keys(instance_id).new_process("127.0.0.1")
        return server_env(config, "127.0.0.1", instance_id, keys, None)

    def factors(env: dict[str, str]) -> dict[str, object]:
        monkeypatch.setattr(os, "environ", env)
        return vllm.envs.compile_factors()

    first, second = engine_environment("decode-0", "0"), engine_environment("decode-1", "1")
    monkeypatch.setattr(vllm.envs, "compile_factors", vllm.envs.compile_factors)  # undone after the test
    own = factors(first)
    assert own != factors(second)  # vLLM's own key

    monkeypatch.setattr(os, "environ", first)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)  # as vLLM loads them in an engine's processes
    assert set(plugins) == set(ENGINE_PLUGINS)  # each named plugin installed, and no other loaded
    plugins[COMPILE_KEY_PLUGIN]()
    plugins[COMPILE_KEY_PLUGIN]()  # vLLM may load it again in a process: wrapped once
    assert factors(first) == factors(second)
    assert {name: own[name] for name in factors(first)} == factors(first)  # nothing else changed
    assert set(own) - set(factors(first)) == PER_ENGINE_SETTINGS
