"""Engine-side pieces that need no engine: config validation, timelines, core placement."""

from __future__ import annotations

import os
import time

import pytest
from pydantic import ValidationError

from deploy.actor_placement import cpu_core_sets
from engine.config import EngineConfig
from engine.environment import engine_env, engine_process_env
from engine.lifecycle import STAGE_PATTERNS, StartTimeline


def test_engine_config_rejects_a_folder_without_a_model(tmp_path):
    with pytest.raises(ValidationError, match="config.json"):
        EngineConfig(model=tmp_path, served_model_name="m")


def test_engine_config_forbids_unknown_fields(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model folder, as far as the config checks
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(model=tmp_path, served_model_name="m", blocksize=16)


def test_timeline_durations_add_up():
    timeline = StartTimeline(started_at=time.time() - 1.0)
    for stage in ("spawn_and_import", "weights", "warmup_request"):
        timeline.mark(stage)
    timeline.mark("weights")  # a repeated mark keeps the first
    record = timeline.as_record()
    assert list(record["stages_s"]) == ["spawn_and_import", "weights", "warmup_request"]
    assert sum(record["stages_s"].values()) == pytest.approx(record["total_s"], abs=1e-3)
    assert record["total_s"] >= 1.0


def test_a_step_timed_inside_a_stage_is_a_stage_of_its_own():
    """The weights' checksum, timed by the worker inside the weights' call, shows in the ledger
    as its own stage, and the two add up to the call; none measured: just the stage."""
    timeline = StartTimeline(started_at=time.time() - 1.0)
    timeline.mark("wake_up")
    time.sleep(0.05)
    timeline.mark_split("weights", "weights_checksum", 0.02)
    stages = timeline.as_record()["stages_s"]
    assert list(stages) == ["wake_up", "weights", "weights_checksum"]
    assert stages["weights_checksum"] == pytest.approx(0.02, abs=1e-3)
    assert stages["weights"] >= 0.03
    untimed = StartTimeline()
    untimed.mark_split("weights", "weights_checksum", 0.0)
    assert list(untimed.as_record()["stages_s"]) == ["weights"]


def test_stage_patterns_match_vllm_log_lines():
    lines = {  # vLLM 0.26's on CUDA (docs/gpu/engine logs), 0.32's CPU build's
        "worker_and_model": "(EngineCore pid=7) INFO 12-02 07:22:11 [gpu_model_runner.py:5347] Model loading "
                            "took 13.03 GiB memory and 0.690199 seconds",
        "compile": "(EngineCore pid=7) INFO 12-02 07:22:18 [monitor.py:53] torch.compile took 7.22 s in total",
        "profile_and_kv_cache": "(EngineCore pid=7) INFO 12-02 03:12:32 [kv_cache_utils.py:2327] CPU KV cache "
                                "size: 23,296 tokens, Maximum concurrency for 4,096 tokens per request: 5.69x",
        "graph_capture": "(EngineCore pid=7) INFO 12-02 07:22:27 [gpu_model_runner.py:6844] Graph capturing "
                         "finished in 7 secs, took 0.65 GiB",
        "engine_ready": "INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 2.79 s",
        "api_server": "INFO:     Application startup complete.",
    }
    patterns = dict(STAGE_PATTERNS)
    for stage, line in lines.items():
        assert patterns[stage].search(line), stage


def test_timeline_records_a_start_that_reused_vllms_startup_plan():
    # vLLM 0.26's line (v1/worker/startup_plan.py); a start that measured its KV cache has none
    timeline = StartTimeline()
    timeline.mark_from_log("(EngineCore pid=7) INFO [startup_plan.py:138] Available KV cache memory: 20.31 GiB")
    assert "startup_plan" not in timeline.details
    timeline.mark_from_log("(EngineCore pid=7) INFO [startup_plan.py:138] Applying persisted startup plan "
                           "(fingerprint 0123456789abcdef): kv_cache_memory_bytes=21807161344 (20.31 GiB)")
    assert timeline.details["startup_plan"] == "applied"


@pytest.mark.parametrize(
    "engines,cores,expected",
    [(1, 2, ["1"]), (2, 2, ["0", "1"]), (2, 5, ["1-2", "3-4"]), (3, 8, ["1-2", "3-4", "5-6"]), (0, 4, [])],
)
def test_cpu_core_sets_are_disjoint_and_spare_core_zero(engines, cores, expected):
    assert cpu_core_sets(engines, cores) == expected


def test_engines_do_not_share_an_inherited_prometheus_multiprocess_dir(monkeypatch):
    # LMCache sets it in any process that builds its engine (this test process too): engines that
    # inherit it write their metrics to one folder and each /metrics reports the sum of all.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/shared-by-everyone")
    env = engine_process_env("127.0.0.1", 1, None, "0")
    assert "PROMETHEUS_MULTIPROC_DIR" not in env
    assert env["PATH"] == os.environ["PATH"] and env["UCX_NET_DEVICES"] == "lo"


# What vLLM 0.26 (the GPU build) leaves out of its compile cache key: the caches themselves.
VLLM_PATHS_OUTSIDE_THE_COMPILE_KEY = {"VLLM_CACHE_ROOT", "VLLM_ASSETS_CACHE"}


def test_no_vllm_setting_of_an_engine_follows_its_nodes_home_but_the_caches(monkeypatch):
    """An engine's vLLM settings on two nodes whose homes differ: 0.26 hashes every setting but a
    short list into its compile cache key, so any other setting derived from HOME or the XDG roots
    would key the same compile apart and a new node would compile again what a peer sent it."""
    import vllm.envs

    def settings(home: str) -> dict[str, str]:
        monkeypatch.setattr(os, "environ", {**os.environ, "HOME": home, "XDG_CACHE_HOME": f"{home}/cache",
                                            "XDG_CONFIG_HOME": f"{home}/config"})
        monkeypatch.setattr(os, "environ", engine_process_env("127.0.0.1", 1, None, "0"))
        return {name: str(setting()) for name, setting in vllm.envs.environment_variables.items()}

    following = {name for name, value in settings("/home/node-a").items() if "/home/node-a" in value}
    assert following <= VLLM_PATHS_OUTSIDE_THE_COMPILE_KEY  # a subset: an operator may set those two
    assert settings("/home/node-b")["VLLM_XLA_CACHE_PATH"] == settings("/home/node-a")["VLLM_XLA_CACHE_PATH"]


def test_engine_env_keeps_ucx_on_loopback_only_for_loopback_hosts():
    assert engine_env("127.0.0.1", 1, "1")["UCX_NET_DEVICES"] == "lo"
    assert "UCX_NET_DEVICES" not in engine_env("10.0.0.5", 1, None)


def test_a_picked_port_is_reserved_for_its_process_until_it_ends(monkeypatch, tmp_path):
    """A pre-imported engine binds its ports only when started, maybe hours later: no other
    process of ours on the node may pick them meanwhile; a reservation of an ended process lapses."""
    import subprocess
    import sys

    from engine import environment

    monkeypatch.setattr(environment.tempfile, "gettempdir", lambda: str(tmp_path))
    port = environment.free_port("127.0.0.1")
    assert not environment._reserve("127.0.0.1", port)  # held: this process lives
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim = tmp_path / f"pdcluster-ports-{os.getuid()}" / f"127.0.0.1-{port + 1}"
    claim.write_text(ended.stdout.strip())
    assert environment._reserve("127.0.0.1", port + 1)  # its owner has ended
    assert claim.read_text() == str(os.getpid())


@pytest.mark.slow  # vLLM's config from our command line: seconds
def test_vllms_startup_plan_is_kept_per_memory_utilization(tiny_model):
    """vLLM's startup plan (server_env turns it on) is keyed by its config's hash plus the device:
    an engine started at another utilization must not find the plan of this one."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32 (the CPU build)
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from engine.server_command import SERVER_MODULE, server_command

    def config_hash(utilization: float) -> str:
        config = EngineConfig(model=tiny_model, served_model_name="tiny", gpu_memory_utilization=utilization)
        command = server_command(config, "127.0.0.1", 8000, "engine-0")
        args = command[command.index(SERVER_MODULE) + 1:]
        namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
        return EngineArgs.from_cli_args(namespace).create_engine_config().compute_hash()

    assert config_hash(0.45) == config_hash(0.45)
    assert config_hash(0.45) != config_hash(0.9)


def test_a_model_built_by_another_revision_of_the_builders_is_built_again(tmp_path, monkeypatch):
    from engine import models

    built = []
    monkeypatch.setitem(models.BUILDERS, "stand-in", lambda target: built.append(target) or target.mkdir(exist_ok=True))
    target = tmp_path / "stand-in"
    models.ensure_model("stand-in", target)
    models.ensure_model("stand-in", target)
    assert len(built) == 1 and models.is_complete(target)
    (target / models.COMPLETE_MARKER).write_text('{"builder": "stand-in"}')  # an older revision's marker
    assert not models.is_complete(target)
    models.ensure_model("stand-in", target)
    assert len(built) == 2 and models.is_complete(target)
