"""Prefill/decode through the store on a CUDA GPU: the same StoreConnector and whole-block copier
as on the CPU build, with the KV cache in GPU memory.

Needs a GPU and vLLM's CUDA build, LMCache and NIXL (on the lent H200:
docs/gpu/h200/run_cuda_test.sh); skipped anywhere else, CI included. Three engines (colocated,
prefill, decode) share GPU 0 and one store shard in this process; no Ray and no router: the test
plays the router's two steps itself (prefill with max_tokens=1, then decode).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from transport.zmq_curve import STORE_PLANE

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
for module in ("vllm", "lmcache", "nixl"):
    pytest.importorskip(module)

from decode.role import DECODE  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.host import EngineHost  # noqa: E402
from engine.role_spec import COLOCATED, RoleSpec  # noqa: E402
from kvstore.shard import ShardServer  # noqa: E402
from loadtest.scrape import scrape_engine  # noqa: E402
from prefill.role import PREFILL  # noqa: E402
from security.credentials import ClusterCredentials  # noqa: E402

pytestmark = pytest.mark.slow
LONG = " ".join(f"line {k}: the quick brown fox jumps over the lazy dog." for k in range(60))
# Each starts differently, so that no prompt finds another's blocks in the decode's own cache.
PROMPTS = {"shorter-than-a-block": "Hello there", "several-chunks": "Several chunks. " + LONG,
           "a-block-and-a-bit": "A block and a bit. " + LONG[:200]}


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory) -> Path:
    """The tiny model, built in its own process: torch work before vLLM starts can hang an engine
    (vLLM forks after OpenMP threads exist; docs/gpu-notes.md)."""
    path = Path(os.environ.get("PDC_CUDA_MODEL_DIR", tmp_path_factory.mktemp("models"))) / "tiny"
    code = "import sys; from pathlib import Path; from engine.models import build_tiny; build_tiny(Path(sys.argv[1]))"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=300)
    return path


@pytest.fixture(scope="module")
def engines(cuda_model, artifacts):
    """(colocated, prefill, decode) hosts on GPU 0, the last two sharing one store shard. Their
    logs' tails are kept in the artifacts folder."""
    credentials = ClusterCredentials.generate()
    shard = ShardServer(2 * 1024**3, credentials.curve(STORE_PLANE), host="127.0.0.1")

    # float32 by default: a random-weight model's greedy choices are near-ties, and the P/D engines
    # run vLLM's V1 model runner where the colocated one runs V2 (engine/host.py): in bf16 any
    # difference of kernels between them could flip a tie. PDC_CUDA_DTYPE=bfloat16 runs the same
    # tests in the dtype GPUs serve in (docs/gpu-notes.md, session 7).
    dtype = os.environ.get("PDC_CUDA_DTYPE", "float32")

    def config(role: RoleSpec) -> EngineConfig:
        return EngineConfig(model=cuda_model, served_model_name="tiny", role=role, max_model_len=2048,
                            gpu_memory_utilization=0.15, keep_host_weights=False, dtype=dtype,
                            kv_store_endpoints=() if role is COLOCATED else (shard.endpoint,))

    hosts = [EngineHost(config(role), f"cuda-{role.name}", host="127.0.0.1",
                        keys=credentials.engine_host_keys(f"cuda-{role.name}")) for role in (COLOCATED, PREFILL, DECODE)]

    async def start_all() -> None:
        for host in hosts:  # one at a time: vLLM's memory profiling assumes a quiet GPU
            await host.start()

    try:
        asyncio.run(start_all())
        yield hosts, shard
    finally:
        artifacts.mkdir(parents=True, exist_ok=True)
        for host in hosts:
            asyncio.run(host.stop())
            (artifacts / f"{host.instance_id}.log").write_text("\n".join(host.log_tail()))
        shard.close()


def complete(host: EngineHost, prompt: str, max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    response = httpx.post(f"{host.url}/v1/completions", json=body, headers=host.access.headers,
                          verify=host.access.ssl, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def external_hits(host: EngineHost) -> float:
    return scrape_engine(host.access, ("vllm:external_prefix_cache_hits",)).get(
        "vllm:external_prefix_cache_hits_total", 0.0)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_through_the_store_on_cuda_equals_one_engine_and_really_loads(engines, name):
    (colocated, prefill, decode), _ = engines
    prompt = PROMPTS[name]
    want = complete(colocated, prompt, max_tokens=24)
    # The comparison means something only if the reference does not move with the kernel path:
    # served again, from its own prefix cache, the colocated engine must say the same.
    assert complete(colocated, prompt, max_tokens=24) == want, "reference unstable under prefix caching"
    complete(prefill, prompt, max_tokens=1)  # computes the prompt's KV and stores it
    before = external_hits(decode)
    assert complete(decode, prompt, max_tokens=24) == want
    loaded = external_hits(decode) - before
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "return_token_ids": True}
    served = httpx.post(f"{decode.url}/v1/completions", json=body, headers=decode.access.headers,
                        verify=decode.access.ssl, timeout=120)
    prompt_tokens = len(served.json()["choices"][0]["prompt_token_ids"])
    whole_blocks = (prompt_tokens - 1) // decode.config.block_size * decode.config.block_size
    assert loaded == whole_blocks  # every whole block but the last token's came from the store


def test_damaged_chunks_on_cuda_are_rejected_and_recomputed(engines):
    (colocated, prefill, decode), shard = engines
    prompt = "Damaged in the store. " + LONG
    complete(prefill, prompt, max_tokens=1)
    rejected = shard.stats().rejected
    assert shard.corrupt(shard.stats().chunks) > 0
    assert complete(decode, prompt, max_tokens=24) == complete(colocated, prompt, max_tokens=24)
    assert shard.stats().rejected > rejected
