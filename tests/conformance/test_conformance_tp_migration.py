"""A stream whose tensor-parallel engine loses a rank goes on on the other TP=2 instance, and the
client gets plain vLLM's greedy token ids at `--tensor-parallel-size 2` on the same checkpoint,
the continuation's included.

Two TP=2 instances of the tiny model behind the router (four ranks on CI's two cores), float32
as in the other migration tests (tests/e2e/test_migration.py: the continuation recomputes the
sent tokens' KV in one prefill, which in float32 flips no greedy near-tie). A long answer, so
that the stream is still being generated when one rank is killed. The migrated continuation
carries no logprobs (decode/stream_ledger.py refuses to migrate streams that ask for them), so
token ids are what is compared; tests/conformance/test_conformance_tp.py compares the logprobs
of every other TP=2 path.
"""

from __future__ import annotations

import os
import time

import httpx
import psutil
import pytest
from oracle import PlainVLLM
from streamed import StreamedRequest

from engine.config import EngineConfig, TensorParallel
from loadtest.fault_probes import engine_process_group, migrations
from loadtest.local_cluster import LocalServer

pytestmark = pytest.mark.slow
MODEL, TP, DTYPE = "tiny", 2, "float32"
# Long enough to find the generating engine and kill one of its ranks mid-stream: 5 s or more at
# the fastest a tiny TP=2 engine generated here (190 tokens a second; 25-40 beside a replacement
# engine's start), where one try found all 16 tokens of a short answer sent before the router's
# first read. Every token more is paid twice, by plain vLLM and by the continuation.
MAX_TOKENS = 1000
BODY = {"model": MODEL, "prompt": "The history of the river Thames begins", "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def plain_vllm_token_ids(model_dir, artifacts) -> list[int]:
    """Plain vLLM's greedy answer at TP=2, float32, one core per rank (before our engines start)."""
    config = EngineConfig(model=model_dir(MODEL), served_model_name=MODEL, dtype=DTYPE,
                          tensor_parallel=TensorParallel(every_pool=TP))
    with PlainVLLM(config, artifacts / "plain-vllm-tiny-tp2-float32.log", core="0|1") as server:
        response = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert len(choice["token_ids"]) == MAX_TOKENS
    return choice["token_ids"]


@pytest.fixture(scope="module")
def served_tp2_pair(plain_vllm_token_ids, artifacts):
    args = ["--model", MODEL, "--instances", "2", "--tensor-parallel-size", str(TP), "--dtype", DTYPE,
            "--kv-cache-gib", "1"]
    with LocalServer(args, artifacts / "serve-conformance-tp2-migration.log") as server:
        yield server


def test_a_stream_whose_tp2_engine_lost_a_rank_goes_on_with_plain_vllms_tokens(served_tp2_pair, plain_vllm_token_ids):
    server = served_tp2_pair
    assert [i["tensor_parallel_size"] for i in server.instances()] == [TP, TP]
    groups = {i["instance_id"]: engine_process_group(i["url"]) for i in server.instances()}
    ranks = {name: _ranks(group) for name, group in groups.items()}
    assert [len(r) for r in ranks.values()] == [TP, TP], ranks
    before = migrations(server)
    streamed = BODY | {"stream": True, "stream_options": {"include_usage": True}}
    stream = StreamedRequest(server.url, "/v1/completions", streamed)
    victim = _generating(ranks)
    ranks[victim][0].kill()  # one rank only: vLLM's executor takes the rest of its engine down
    at_kill = len(stream.token_ids)  # what the client had read then (behind the engine)
    text, usage, errors, token_ids = stream.result()

    assert not errors and stream.ended, errors
    assert migrations(server) == before + 1, (at_kill, migrations(server))
    assert token_ids == plain_vllm_token_ids, _first_difference(token_ids, plain_vllm_token_ids, at_kill)
    assert usage is not None and usage["completion_tokens"] == MAX_TOKENS and len(stream.ids) == 1, usage
    # The engine that lost a rank left whole: none of its processes is still up.
    deadline = time.monotonic() + 60
    while _ranks(groups[victim], every_process=True):
        assert time.monotonic() < deadline, _ranks(groups[victim], every_process=True)
        time.sleep(0.5)


def _generating(ranks: dict[str, list[psutil.Process]]) -> str:
    """The engine generating the stream: the one whose ranks work (CPU time read from /proc; the
    router and vLLM's API server, busy streaming on two cores, answered HTTP seconds late here,
    by which time the stream's engine had finished)."""
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no engine ever ran the stream"
        before = {name: _cpu_s(processes) for name, processes in ranks.items()}
        time.sleep(0.5)
        worked = {name: _cpu_s(processes) - before[name] for name, processes in ranks.items()}
        busiest = max(worked, key=worked.__getitem__)
        if worked[busiest] > 0.25 * len(ranks[busiest]):  # each rank busy half of the time or more
            return busiest


def _cpu_s(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def _ranks(group: int, every_process: bool = False) -> list[psutil.Process]:
    """The engine's rank processes (vLLM titles them `VLLM::Worker_TP<r>`); with `every_process`,
    every live process of its group."""
    found = []
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if os.getpgid(process.pid) != group or process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except ProcessLookupError:
            continue
        if every_process or "Worker" in process.info["name"] or "Worker" in " ".join(process.info["cmdline"] or ()):
            found.append(process)
    return found


def _first_difference(got: list[int], want: list[int], at_kill: int) -> str:
    index = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"first difference at token {index} of {len(got)} (plain vLLM: {len(want)}); the kill at {at_kill}"
