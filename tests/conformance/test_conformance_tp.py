"""Tensor-parallel engines (two ranks, one core each) answer as plain vLLM started with
`--tensor-parallel-size 2` on the same checkpoint: P/D through the store (each rank saving and
loading its own KV heads) and directly (each decode rank reading its heads over NIXL), started
from disk, and as a standby activated with a TP=2 peer's weights (every rank reading the peer's
host copy, each keeping its shard). A rank that dies takes
its whole engine down: no half-alive engine stays up.

The tiny models only: SmolLM2-135M's 9 attention heads do not split over 2 ranks (vLLM refuses).
One peer and one standby for the module (four ranks on CI's two cores)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import warnings

import psutil
import pytest
from engine_pair import peer_and_standby
from kv_handover import assert_long_prompt_handed_over, kv_counts
from oracle import ask_all, assert_conforms, differences

from engine.config import EngineConfig, TensorParallel
from engine.lifecycle import InstanceState
from loadtest.local_cluster import LocalServer
from security.credentials import ClusterCredentials

pytestmark = [pytest.mark.slow, pytest.mark.oracles(("tiny", 2))]
MODEL = "tiny"
TP = 2
CREDENTIALS = ClusterCredentials.load()


@pytest.mark.parametrize(("transfer", "prefill_tp", "decode_tp"),
                         [("store", TP, TP), ("direct", TP, TP), ("direct", 1, TP),
                          pytest.param("direct", TP, 1, marks=pytest.mark.oracles("tiny"))],
                         ids=["store", "direct", "direct-tp1-to-tp2", "direct-tp2-to-tp1"])
def test_pd_with_tp_engines_answers_as_plain_vllm_at_the_decodes_tp(transfer, prefill_tp, decode_tp, oracle,
                                                                     artifacts):
    """First in the module: its clusters' ranks run before the module's engines start. Through the
    store each rank saves and loads its own KV heads; directly, each decode rank reads its heads
    from the prefill rank that holds them (vLLM's NixlConnector): of its number at equal sizes,
    half of one rank's heads from a TP=1 prefill, both ranks' heads from a TP=2 prefill into a TP=1
    decode. The decode engine computes every token, so plain vLLM at the decode's size is the oracle."""
    want = oracle(MODEL, decode_tp)
    # A store read past --store-timeout is a miss that vLLM recomputes (right answers, no KV
    # through the store): one rank's first read took the whole 5 s default once in CI (session
    # 18; the next one 1.0 s), four ranks, the shard and the router sharing two cores. What that
    # read waits for is not known yet (issue #34); here the store gets time to answer.
    sizes = (["--tensor-parallel-size", str(TP)] if prefill_tp == decode_tp else
             ["--prefill-tensor-parallel-size", str(prefill_tp), "--decode-tensor-parallel-size", str(decode_tp)])
    args = ["--model", MODEL, "--prefill", "1", "--decode", "1", "--kv-transfer", transfer, *sizes,
            "--remote-prefill-min-tokens", "0", *(["--store-timeout", "30"] if transfer == "store" else [])]
    log = artifacts / f"serve-conformance-pd-tp{prefill_tp}-tp{decode_tp}-{transfer}.log"
    with LocalServer(args, log) as server:
        assert {(i["role"], i["tensor_parallel_size"]) for i in server.instances()} == {
            ("prefill", prefill_tp), ("decode", decode_tp)}
        (decode,) = [server.engine_access(i["instance_id"]) for i in server.instances() if i["role"] == "decode"]
        before = kv_counts(decode)
        assert_conforms(server.url, MODEL, want)
        # The long completion's KV came from the prefill engine: every rank found its own heads.
        assert_long_prompt_handed_over(decode, before, MODEL, direct=transfer == "direct")
    (decode_log,) = log.with_suffix("").glob("decode-*.log")
    (prefill_log,) = log.with_suffix("").glob("prefill-*.log")
    if transfer == "direct":
        # No read after the prefill let its blocks go (they may hold others' KV by then), and no rank
        # stuck in a read while its engine core waited on it (the stall of docs/tensor-parallel.md).
        assert "Potentially invalid KV blocks" not in prefill_log.read_text()
        for engine_log in (prefill_log, decode_log):
            assert "No available shared memory broadcast block" not in engine_log.read_text()
        return
    # The scheduler looks up rank 0's chunks; a rank that found fewer of its own would say so. Not
    # one whose write the store never committed: the stall of issue #34 (a shard's control socket
    # left a 'commit' unanswered for 30 s in CI, session 20), tracked there and reported here.
    prefill_lines = prefill_log.read_text().splitlines()
    asked_again = [line for line in prefill_lines if "asking again on a new connection" in line]
    if asked_again:  # recovered (kvstore/shard_control.py ASKED_AGAIN), and evidence for the issue
        warnings.warn(f"issue #34: a store shard left a prefill rank's message unanswered: {asked_again[0]}",
                      stacklevel=1)
    failed_writes = [line for line in prefill_lines if "store write failed" in line]
    if failed_writes:
        warnings.warn(f"issue #34: a prefill rank's store write failed: {failed_writes[0]}", stacklevel=1)
    else:
        assert "vLLM recomputes the rest" not in decode_log.read_text()


@pytest.fixture(scope="module")
def config(model_dir, artifacts) -> EngineConfig:
    return EngineConfig(model=model_dir(MODEL), served_model_name=MODEL, cpu_cores="0|1",
                        tensor_parallel=TensorParallel(every_pool=TP), log_dir=artifacts / "conformance-tp")


@pytest.fixture(scope="module")
def engines(config, oracle):
    """A TP=2 engine loaded from disk (the peer) and a TP=2 standby started beside it."""
    want = oracle(MODEL, TP)  # before our engines take the cores
    with peer_and_standby(config, "tp", CREDENTIALS) as hosts:
        yield hosts, want


def test_a_tp2_engine_started_from_disk_answers_as_plain_vllm_at_tp2(engines):
    (hosts, want) = engines
    peer = hosts["peer"]
    assert peer.timeline.details["weights_ranks"].count("disk/read") == TP
    assert_conforms(peer.access, MODEL, want)


def test_a_tp2_standby_activated_from_a_tp2_peer_answers_as_plain_vllm(engines):
    (hosts, want) = engines
    peer, standby = hosts["peer"], hosts["standby"]
    assert differences(ask_all(standby.access, MODEL), want)  # dummy weights: the check can fail
    weights = asyncio.run(peer.export_weights(use_nixl=False))
    assert weights.tensor_parallel_size == TP
    timeline = asyncio.run(standby.activate(weights))
    assert standby.state == InstanceState.READY
    assert timeline["details"]["weights_ranks"].count("peer/shm") == TP, timeline["details"]
    assert "weights_fallback_reason" not in timeline["details"]
    assert_conforms(standby.access, MODEL, want)


def test_the_engine_core_and_its_ranks_are_forked_from_their_server_each_rank_on_its_cores(engines):
    """The core and the ranks inherit the server's imports (engine/serving.py), and each rank runs
    on the cores vLLM named for it (one each here), as a spawned rank's OpenMP binding would."""
    (hosts, _) = engines
    ranks = _ranks(psutil.Process(hosts["peer"].describe().pid))
    (core,) = {rank.parent() for rank in ranks}
    # A forked child shares its parent's heap until either writes a page (~220 MiB of imports
    # here, after both ran a full garbage collection); a spawned interpreter shares no anonymous
    # memory with anyone.
    shared_mib = [_heap_shared_mib(process) for process in (core, *ranks)]
    assert min(shared_mib) > 32, shared_mib
    affinities = [rank.cpu_affinity() for rank in ranks]
    assert [len(cores) for cores in affinities] == [1] * TP and len({c for cores in affinities for c in cores}) == TP


def _heap_shared_mib(process: psutil.Process) -> int:
    """MiB of the process's anonymous memory that another process maps too, written since."""
    return sum(m.shared_dirty for m in process.memory_maps() if m.path in ("[heap]", "[anon]")) >> 20


def _ranks(server: psutil.Process) -> list[psutil.Process]:
    tree = [server, *server.children(recursive=True)]
    ranks = [p for p in tree if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name()]
    assert len(ranks) == TP, [(p.name(), p.cmdline()) for p in tree]
    return ranks


def test_a_rank_that_dies_takes_its_whole_engine_down(engines):
    (hosts, _) = engines
    standby = hosts["standby"]
    server = psutil.Process(standby.describe().pid)
    tree = [server, *server.children(recursive=True)]
    ranks = _ranks(server)
    os.kill(ranks[-1].pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(map(_running, tree)):
        time.sleep(0.5)
    alive = [p.pid for p in tree if _running(p)]
    assert not alive, f"processes of the engine still up after one rank died: {alive}"
    assert standby.describe().exited


def _running(process: psutil.Process) -> bool:
    """Up and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
