"""The trace simulator on hand-made traces whose answers are known."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from loadtest.simulate import SimConfig, TraceRecord, infinite_cache_hit_rate, load_trace, simulate


def record(t: float, hash_ids: tuple[int, ...], tokens: int | None = None) -> TraceRecord:
    return TraceRecord(t, tokens if tokens is not None else 512 * len(hash_ids), 10, hash_ids)


def test_load_trace_reads_mooncake_records_and_applies_speed(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 1000, "input_length": 100, "output_length": 5, "hash_ids": [0]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_trace(path, speed=2.0)
    assert [r.arrival_s for r in trace] == [0.5, 1.0]
    assert trace[1].block_tokens() == [512, 88]


def test_infinite_cache_hit_rate_counts_repeated_blocks():
    trace = [record(0, (1, 2)), record(1, (1, 2, 3)), record(2, (4,))]
    assert infinite_cache_hit_rate(trace) == pytest.approx(1024 / 3072)


def test_one_instance_reaches_the_ceiling_and_ttft_is_queue_plus_compute():
    trace = [record(0, (1, 2)), record(0, (1, 2, 3)), record(10, (1, 2, 3))]
    result = simulate(
        trace, "kv_aware", SimConfig(instances=1, cache_blocks=100, prefill_rate=1024), progress=False
    )
    assert result["hit_rate"] == pytest.approx(infinite_cache_hit_rate(trace))
    # 1 s for the first prompt; the second waits for it, then computes one new block (0.5 s).
    assert result["ttfts_s"] == pytest.approx([1.0, 1.5, 0.0])


def test_store_tier_serves_blocks_another_instance_computed():
    trace = [record(0, (1, 2, 3, 4)), record(0, (1, 2, 3, 4))]
    config = SimConfig(instances=2, cache_blocks=100, prefill_rate=2048, store_blocks=100, fetch_cost=0.5)
    result = simulate(trace, "round_robin", config, progress=False)
    assert result["hit_rate"] == pytest.approx(0.5)
    assert result["ttfts_s"] == pytest.approx([1.0, 0.5])  # all four blocks fetched at half cost


def test_kv_aware_beats_round_robin_on_a_prefix_heavy_trace():
    """40 system prompts of 4 blocks, each request adding one unique block; every instance's
    cache holds a quarter of the prompts: affinity is the only way to hit."""
    groups = random.Random(0)
    trace = []
    for t in range(800):
        group = groups.randrange(40)
        trace.append(record(t * 0.05, tuple(1000 * group + k for k in range(4)) + (10**6 + t,)))
    config = SimConfig(instances=4, cache_blocks=60, prefill_rate=20_000)
    rr = simulate(trace, "round_robin", config, progress=False)
    ours = simulate(trace, "kv_aware", config, progress=False)
    assert ours["hit_rate"] > 2 * rr["hit_rate"]
    assert ours["ttft_p50_s"] < rr["ttft_p50_s"] / 2
    assert ours["imbalance"] <= 1.2


def test_pd_places_long_prompts_on_prefill_instances_and_short_ones_on_decode():
    """The simulator runs the router's own placement step: a long uncached prompt is prefilled on
    the prefill instance (then handed to decode at fetch cost), a short one by decode itself."""
    long, short = record(0, (1, 2, 3, 4)), record(10, (9,), tokens=100)
    config = SimConfig(instances=1, cache_blocks=100, prefill_rate=1024, prefill_instances=1,
                       remote_prefill_min_tokens=256, fetch_cost=0.05)
    result = simulate([long, short], "least_loaded", config, progress=False)
    assert result["remote_prefills"] == 1
    # 2 s to compute 2048 tokens on the prefill instance, then 0.1 s to hand 2048 tokens over.
    assert result["ttfts_s"] == pytest.approx([2.0 + 0.05 * 2048 / 1024, 100 / 1024])


def test_pd_prefills_locally_while_the_prefill_instance_is_busy():
    """With `remote_prefill_max_queued_tokens` the simulator's placement sees the prefill
    instance's queue, as the router's does (`local_busy`): two long prompts arriving together,
    the first is prefilled remotely, the second by the decode instance while the first is queued."""
    trace = [record(0, (1, 2, 3, 4)), record(0, (5, 6, 7, 8))]
    config = SimConfig(instances=1, cache_blocks=100, prefill_rate=1024, prefill_instances=1,
                       remote_prefill_min_tokens=256, fetch_cost=0.05)
    assert simulate(trace, "least_loaded", config, progress=False)["remote_prefills"] == 2
    busy = dataclasses.replace(config, remote_prefill_max_queued_tokens=1024)
    result = simulate(trace, "least_loaded", busy, progress=False)
    assert result["remote_prefills"] == 1
    # The second prompt waits for the handed-over first one on the decode instance (2.1 s), then
    # computes its 2048 tokens there (2 s).
    assert result["ttfts_s"] == pytest.approx([2.0 + 0.05 * 2048 / 1024, 2.1 + 2.0])


def test_the_agent_workload_as_a_trace_keeps_its_prefixes_and_block_size(tmp_path):
    """loadtest.agents_trace: a tenant's sessions share its system prompt's blocks and no other
    tenant's; each turn's prompt extends the one before; the simulator reads the block size each
    record names, and kv_aware finds more of the prompts cached than round robin, as live."""
    from loadtest.agents_trace import main as agents_trace
    from loadtest.workloads import AgentSessions

    path = tmp_path / "agents.jsonl"
    agents_trace(["--block-tokens", "32", "--out", str(path)])
    trace = load_trace(path)
    workload = AgentSessions()
    assert len(trace) == workload.tenants * workload.sessions * workload.turns
    assert {r.block_size for r in trace} == {32}
    system_blocks = int(workload.system_words * 2.55) // 32
    by_system = {r.hash_ids[:system_blocks] for r in trace}
    assert len(by_system) == workload.tenants
    first_turns = [r for r in trace if r.input_length == trace[0].input_length]
    full = trace[0].input_length // 32  # a first turn's full blocks: what its session's later turns start with
    last_turn = max(trace, key=lambda r: r.input_length)
    assert sum(r.hash_ids[:full] == last_turn.hash_ids[:full] for r in first_turns) == 1
    config = SimConfig(instances=2, cache_blocks=4000, prefill_rate=5000.0)
    hit_rates = {name: simulate(trace, name, config, progress=False)["hit_rate"] for name in ("round_robin", "kv_aware")}
    assert hit_rates["kv_aware"] > hit_rates["round_robin"]
