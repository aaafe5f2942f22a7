"""Engines larger than one device, without an engine: each pool's tensor-parallel size reaches
vLLM's command line, Ray's reservation and the CPU cores of every rank; pools that could not hand
KV over rank by rank are refused before anything starts; a peer whose ranks hold other shards is
not used."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from decode.role import DECODE
from deploy.actor_placement import CoreSets, cpu_core_sets, placement_options
from engine.config import EngineConfig, TensorParallel, replicates_kv_heads
from engine.host import EngineHost
from engine.role_spec import COLOCATED, Role
from engine.server_command import server_command
from engine.weights import PeerWeights
from prefill.role import PREFILL


def test_each_pool_spans_its_own_size_or_every_pools(tiny_model):
    sizes = TensorParallel(every_pool=2, decode=4)
    assert [sizes.for_role(role) for role in Role] == [2, 2, 4]
    with pytest.raises(ValueError, match="each rank stores and loads its own KV heads"):
        sizes.check_pd(direct=False, model=tiny_model)
    TensorParallel(every_pool=4, decode=4).check_pd(direct=False, model=tiny_model)


@pytest.mark.slow  # reads configs through vLLM's (imports it: ~12 s here)
def test_direct_pd_takes_pools_whose_sizes_divide_one_another(tiny_model):
    """vLLM's NixlConnector splits a prefill rank's KV heads between decode ranks, or gathers them,
    but not from prefill ranks that hold copies of the same head (the tiny model has 2 KV heads)."""
    TensorParallel(prefill=1, decode=4).check_pd(direct=True, model=tiny_model)
    TensorParallel(prefill=2, decode=1).check_pd(direct=True, model=tiny_model)
    with pytest.raises(ValueError, match="one must divide the other"):
        TensorParallel(prefill=2, decode=3).check_pd(direct=True, model=tiny_model)
    with pytest.raises(ValueError, match="hold copies of the model's KV heads"):
        TensorParallel(prefill=4, decode=2).check_pd(direct=True, model=tiny_model)


@pytest.mark.slow  # reads configs through vLLM's (imports it: ~12 s here)
@pytest.mark.parametrize("config, replicated_at, whole_at", [
    ({"model_type": "falcon", "num_attention_heads": 32, "num_kv_heads": 8, "new_decoder_architecture": True}, 16, 8),
    ({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8}, 16, 8),
    ({"model_type": "deepseek_v3", "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
      "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}, None, 64),
])
def test_kv_heads_are_counted_as_vllm_counts_them(tmp_path, config, replicated_at, whole_at):
    """Falcon names its KV heads num_kv_heads; MLA's latent KV is one per rank by design."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
    assert not replicates_kv_heads(tmp_path, whole_at)
    if replicated_at:
        assert replicates_kv_heads(tmp_path, replicated_at)


def test_the_engine_command_names_its_pools_size_and_vllms_multiprocessing_executor(tiny_model):
    config = EngineConfig(model=tiny_model, served_model_name="tiny", tensor_parallel=TensorParallel(prefill=2))
    decode = server_command(config.model_copy(update={"role": DECODE}), "127.0.0.1", 8000, "d-0")
    prefill = server_command(config.model_copy(update={"role": PREFILL}), "127.0.0.1", 8000, "p-0")
    assert "--tensor-parallel-size" not in decode
    at = prefill.index("--tensor-parallel-size")
    assert prefill[at:at + 4] == ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


def test_ray_reserves_a_whole_gpu_per_rank_and_shared_gpus_span_one(tiny_model):
    config = EngineConfig(model=tiny_model, served_model_name="tiny", tensor_parallel=TensorParallel(every_pool=4))
    assert placement_options(COLOCATED, config.num_gpus)["num_gpus"] == 4
    assert config.model_copy(update={"gpu_share": 1.0, "tensor_parallel": TensorParallel()}).num_gpus == 1
    with pytest.raises(ValidationError, match="tensor parallelism needs whole GPUs"):
        EngineConfig(model=tiny_model, served_model_name="tiny", gpu_share=0.5,
                     tensor_parallel=TensorParallel(decode=2))


def test_each_rank_of_a_cpu_engine_gets_cores_of_its_own(tiny_model):
    config = EngineConfig(model=tiny_model, served_model_name="tiny", tensor_parallel=TensorParallel(prefill=2))
    cores = CoreSets(cpu_core_sets(3, 4))
    assert cores.bound(config.model_copy(update={"role": PREFILL})).cpu_cores == "1|2"
    assert cores.bound(config.model_copy(update={"role": DECODE})).cpu_cores == "3"
    assert cores.bound(config.model_copy(update={"role": PREFILL})).cpu_cores == "1|2"  # in turn again
    assert CoreSets([]).bound(config).cpu_cores is None  # vLLM binds


def test_shards_go_rank_to_rank_and_a_whole_checkpoint_to_every_rank(tiny_model):
    config = EngineConfig(model=tiny_model, served_model_name="tiny", tensor_parallel=TensorParallel(every_pool=2))
    host = EngineHost(config, "colocated-0", host="127.0.0.1")
    shard = [{"kind": "cuda_ipc", "rank": r} for r in range(2)]
    host_copy = {"manifest": "...", "shm_name": "pdcluster-weights-0"}
    try:
        assert host._peer_ranks(PeerWeights("colocated-1", tuple(shard))) == (shard, None)
        assert host._peer_ranks(PeerWeights("colocated-1", (host_copy,))) == ([host_copy, host_copy], None)
        assert host._peer_ranks(None) == (None, None)
        refused = host._peer_ranks(PeerWeights("colocated-1", (shard[0],)))
        assert refused == (None, "peer colocated-1 has tensor-parallel size 1, this engine 2: its ranks hold other shards")
    finally:
        asyncio.run(host.stop())


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "1", "--decode", "1", "--prefill-tensor-parallel-size", "2"],
     "prefill engines of tensor-parallel size 2 cannot hand KV to decode engines of size 1 through the store"),
    (["--prefill", "1", "--decode", "1", "--kv-transfer", "direct", "--prefill-tensor-parallel-size", "2",
      "--decode-tensor-parallel-size", "3"], "one must divide the other"),
    pytest.param(["--prefill", "1", "--decode", "1", "--kv-transfer", "direct", "--prefill-tensor-parallel-size", "4",
                  "--decode-tensor-parallel-size", "2"], "hold copies of the model's KV heads",
                 marks=pytest.mark.slow),  # reads the config through vLLM's (imports it: ~12 s here)
    (["--decode-tensor-parallel-size", "2"], "are for a P/D topology's pools"),
])
def test_serve_refuses_sizes_it_cannot_serve_before_starting_anything(tiny_model, tmp_path, flags, message):
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--model", str(tiny_model),
                           "--secret-file", str(tmp_path / "secret"), *flags],
                          capture_output=True, text=True, timeout=120)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert message in output and "Ray" not in output
