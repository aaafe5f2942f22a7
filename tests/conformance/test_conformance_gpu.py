"""On a CUDA GPU: a random ~1B Llama with tied word embeddings, loaded by our disk streaming
loader, by a standby over CUDA IPC from that peer, and by a standby that slept (vLLM's sleep
mode, level 2) until activated, answers as plain vLLM does on the same checkpoint (issue #18,
item 4; issue #23; docs/gpu-notes.md). FP8 (issue #35): `PDC_CUDA_MODEL=llama1b-tied-fp8` for the
same model quantized offline, `PDC_CUDA_ENGINE_ARGS="--quantization=fp8 --no-enable-prefix-caching"`
for vLLM's online FP8 (docs/gpu/h200/run_fp8.sh; prefix caching off on both sides: docs/conformance.md).

With two GPUs or more, the same at tensor-parallel size 2 (issue #34): a TP=2 engine from disk and
a TP=2 standby given its weights rank by rank over CUDA IPC, against plain vLLM at TP=2.

Needs a GPU and vLLM's CUDA build (on the lent H200: docs/gpu/h200/run_conformance.sh); skipped
anywhere else, CI included. Three servers share GPU 0 (GPUs 0 and 1 at TP=2): plain vLLM, our
peer, our standby.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from oracle import Answer, ask_all, assert_conforms, differences, oracle_answers_both_ways  # noqa: E402

from engine import quantization  # noqa: E402
from engine.config import EngineConfig, TensorParallel  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402
from engine.host import EngineHost, EngineStartError  # noqa: E402
from engine.lifecycle import InstanceState  # noqa: E402
from security.credentials import ClusterCredentials  # noqa: E402

CREDENTIALS = ClusterCredentials.generate()  # one cluster: its peers and standbys sign weights alike

pytestmark = pytest.mark.slow


MODEL = os.environ.get("PDC_CUDA_MODEL", "llama1b-tied")
"""An engine/models.py builder: llama1b-tied (bf16), or llama1b-tied-fp8 (an offline FP8 checkpoint)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Built in its own process: torch work before vLLM starts can hang an engine."""
    path = Path(os.environ.get("PDC_CUDA_MODEL_DIR", tmp_path_factory.mktemp("models"))) / MODEL
    code = ("import sys; from pathlib import Path; from engine.models import ensure_model; "
            "ensure_model(sys.argv[1], Path(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, MODEL, str(path)], check=True, timeout=600)
    return path


@pytest.fixture(scope="module")
def config(checkpoint, artifacts) -> EngineConfig:
    # This test is how a quantized format earns its place in engine/quantization.py's lists: the
    # checkpoint's own format is let through while the configuration is made, no other.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantization, "RELOAD_VERIFIED", {False: {quantization.checkpoint_format(checkpoint)}})
        config = EngineConfig(model=checkpoint, served_model_name=MODEL, gpu_memory_utilization=0.25,
                              enforce_eager=os.environ.get("PDC_CUDA_EAGER", "1") == "1", max_model_len=2048,
                              log_dir=artifacts / "conformance-gpu")
    # PDC_CUDA_ENGINE_ARGS: vLLM flags for our engines and plain vLLM alike, unvalidated: online FP8
    # is checked here before ONLINE_VERIFIED takes it, and needs prefix caching off on both sides
    # (docs/conformance.md), which the configuration refuses
    extra = tuple(os.environ.get("PDC_CUDA_ENGINE_ARGS", "").split())
    return config.model_copy(update={"engine_args": EngineArgs.model_construct(every_pool=extra)}) if extra else config


Answers = tuple[dict[str, Answer], dict[str, Answer]]
"""Plain vLLM's, asked one after the other and all at once: with online FP8 on the H200 plain vLLM
answers a prompt differently in a batch of four than alone (docs/gpu-notes.md, session 21), so each
of our rounds is compared with plain vLLM asked the same way."""


@pytest.fixture(scope="module")
def want(config, artifacts) -> Answers:
    answers = oracle_answers_both_ways(config, artifacts / f"plain-vllm-{MODEL}-cuda.log")
    print({name: answer.token_ids for name, answer in answers[0].items()})
    return answers


def test_disk_loader_and_cuda_ipc_standby_answer_as_plain_vllm(config, want):
    disk_and_ipc_standby_conform(config, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_tp2_disk_loader_and_per_rank_cuda_ipc_standby_answer_as_plain_vllm_at_tp2(config, artifacts):
    config = config.model_copy(update={"tensor_parallel": TensorParallel(every_pool=2)})
    want = oracle_answers_both_ways(config, artifacts / f"plain-vllm-{MODEL}-cuda-tp2.log")
    ranks = disk_and_ipc_standby_conform(config, want)
    assert ranks.count("peer/cuda_ipc") == 2, ranks


def disk_and_ipc_standby_conform(config: EngineConfig, want: Answers) -> str:
    """A peer from disk and a standby activated with its weights (CUDA IPC, rank r from the peer's
    rank r) answer as `want`; returns where each rank's weights came from."""
    peer = EngineHost(config, "peer-1b", host="127.0.0.1", keys=CREDENTIALS.engine_host_keys("peer-1b"))
    standby = EngineHost(config, "standby-1b", host="127.0.0.1", keys=CREDENTIALS.engine_host_keys("standby-1b"))

    async def start_both() -> None:
        # One after another (as test_sleeping_standby...): two engines profiling at once at 0.25
        # of the GPU each left one no memory for its KV cache (FP8, session 20).
        await peer.start()
        await standby.start(standby=True)

    try:
        asyncio.run(start_both())
        assert peer.weights_record["source"] == "disk"  # the pinned streaming loader (stream_to_device)
        assert_conforms(peer.access, MODEL, *want)
        assert differences(ask_all(standby.access, MODEL), want[0])  # dummy weights: the check can fail
        timeline = asyncio.run(standby.activate(asyncio.run(peer.export_weights())))
        assert standby.weights_record["transport"] == "cuda_ipc"
        assert_conforms(standby.access, MODEL, *want)
        return timeline["details"].get("weights_ranks", "")
    finally:
        asyncio.run(standby.stop())
        asyncio.run(peer.stop())


def test_sleeping_standby_wakes_with_peer_weights_and_answers_as_plain_vllm(config, want):
    """A standby asleep (weights and KV cache given back) wakes with the peer's weights over CUDA
    IPC. It cannot be a CUDA IPC peer itself (memory vLLM maps has no IPC handle): it says so."""
    peer = EngineHost(config, "peer-1b", host="127.0.0.1", keys=CREDENTIALS.engine_host_keys("peer-1b"))
    sleeper = EngineHost(config.model_copy(update={"sleep_mode": True}), "sleeping-1b", host="127.0.0.1",
                         keys=CREDENTIALS.engine_host_keys("sleeping-1b"))

    async def start_all() -> None:
        # One after another: vLLM sizes its KV cache from the memory free while it profiles, which
        # engines starting beside it take (seen: "No available memory for the cache blocks").
        await peer.start()
        await sleeper.start(standby=True)

    try:
        asyncio.run(start_all())
        assert sleeper.state == InstanceState.SLEEPING
        asyncio.run(sleeper.activate(asyncio.run(peer.export_weights())))
        assert sleeper.weights_record["transport"] == "cuda_ipc"
        assert_conforms(sleeper.access, MODEL, *want)
        with pytest.raises(EngineStartError, match="sleep mode cannot offer its weights over CUDA IPC"):
            asyncio.run(sleeper.export_weights())
    finally:
        for host in (sleeper, peer):
            asyncio.run(host.stop())
