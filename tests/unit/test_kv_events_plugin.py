"""An engine with KV events starts only where vLLM will load our KV event publisher: without it,
vLLM's own would serve every prompt's token ids to anyone who reaches its replay socket."""

from __future__ import annotations

import importlib.metadata

import pytest

from engine.config import EngineConfig
from engine.environment import COMPILE_KEY_PLUGIN, KV_EVENTS_PLUGIN
from engine.host import EngineHost, EngineStartError
from engine.lifecycle import InstanceState
from engine.server_command import KV_EVENTS_PLUGIN_TARGET, kv_events_plugin_installed

NOT_OURS = importlib.metadata.EntryPoint(KV_EVENTS_PLUGIN, "someone_else:register", "vllm.general_plugins")


def test_the_installed_plugin_is_ours():
    (plugin,) = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins") if p.name == KV_EVENTS_PLUGIN]
    assert plugin.value == KV_EVENTS_PLUGIN_TARGET and kv_events_plugin_installed()


@pytest.mark.parametrize("plugins", [[], [NOT_OURS]], ids=["missing", "not ours"])
async def test_an_engine_with_kv_events_refuses_to_start_without_our_publisher(tmp_path, monkeypatch, plugins):
    (tmp_path / "config.json").write_text("{}")  # a model folder, as far as the config checks
    config = EngineConfig(model=tmp_path, served_model_name="m", kv_events=True)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: plugins if group == "vllm.general_plugins"
                        else pytest.fail(f"asked for {group}"))
    host = EngineHost(config, "colocated-0", host="127.0.0.1")

    def no_engine_process(*args, **kwargs):
        raise AssertionError("a vLLM server was started")

    monkeypatch.setattr("engine.host.subprocess.Popen", no_engine_process)
    with pytest.raises(EngineStartError, match=KV_EVENTS_PLUGIN):
        await host.start()
    assert host.state == InstanceState.STOPPED


async def test_a_host_warns_when_an_engines_compile_would_be_read_by_no_other_start(tmp_path, monkeypatch, caplog):
    """Without our compile-key plugin an engine still serves, but keys its compile by its own port
    and cores (engine/compile_key.py): the operator is told, once per start, before it launches."""
    (tmp_path / "config.json").write_text("{}")
    config = EngineConfig(model=tmp_path, served_model_name="m", enforce_eager=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    host = EngineHost(config, "colocated-0", host="127.0.0.1")

    def no_engine_process(*args, **kwargs):
        raise AssertionError("stopped before a vLLM server starts")

    monkeypatch.setattr("engine.host.subprocess.Popen", no_engine_process)
    with pytest.raises(Exception):  # noqa: B017 - whatever stops the start; the warning is the point
        await host.start()
    assert COMPILE_KEY_PLUGIN in caplog.text
