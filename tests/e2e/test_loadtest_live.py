"""Load tests against the real server (tiny model): every workload kind and arrival process."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from rich.console import Console

from loadtest import report
from loadtest.arrivals import Bursts, Constant, FixedConcurrency, Poisson, TraceTimes
from loadtest.runner import Limits, run_load
from loadtest.workloads import MooncakeReplay, MultiTurn, RandomLengths, SharedPrefix

pytestmark = pytest.mark.slow
MODEL = "tiny"


def load(served, workload, arrival, requests: int, **limits):
    return asyncio.run(run_load(served.url, workload.jobs(MODEL), arrival,
                                Limits(max_requests=requests, **limits), scrape_interval_s=0.5))


def assert_clean(run, requests: int) -> dict:
    summary = report.summarize(run, slo_ttft_s=5, slo_tpot_s=1)
    assert summary["requests"] == requests and summary["completed"] == requests, summary["errors"]
    assert summary["ttft"]["p50_ms"] > 0 and summary["itl"]["count"] > 0 and summary["tpot"]["count"] > 0
    assert summary["request_throughput"] > 0 and summary["goodput"] <= summary["request_throughput"]
    assert run.samples and run.samples[-1]["engines"], "the engines' metrics were scraped"
    return summary


def test_random_lengths_with_poisson_arrivals(served):
    run = load(served, RandomLengths(input_tokens=64, output_tokens=8, seed=11), Poisson(8, seed=1), 12)
    summary = assert_clean(run, 12)
    assert all(r.prompt_tokens == 64 and r.output_tokens == 8 for r in run.results)
    assert summary["tpot"]["p50_ms"] < summary["e2e"]["p50_ms"]


def test_shared_prefix_at_fixed_concurrency_hits_the_prefix_cache(served):
    run = load(served, SharedPrefix(groups=2, questions=4, system_words=200, output_tokens=4, seed=5),
               FixedConcurrency(3), 8)
    summary = assert_clean(run, 8)
    assert summary["prefix_hit_rate"] > 0.3  # vLLM's own counters: later questions reuse the system prompt


def test_multi_turn_sessions_grow_their_prompts_with_bursts(served):
    run = load(served, MultiTurn(turns=3, user_words=10, output_tokens=4, seed=2), Bursts(2, 0.5), 6)
    assert_clean(run, 6)
    by_start = sorted(run.results, key=lambda r: r.started_at)
    turn_lengths = sorted(r.prompt_tokens for r in by_start)
    assert turn_lengths[-1] > turn_lengths[0] * 2  # the third turn carries two answers and questions


def test_mooncake_replay_follows_the_trace_clock(served, tmp_path):
    rows = [{"timestamp": 300 * k, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1, 2, 100 + k]}
            for k in range(5)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    started = time.monotonic()
    run = load(served, MooncakeReplay(trace, block_tokens=64, max_output_tokens=4), TraceTimes(), 5)
    assert time.monotonic() - started >= 1.2  # the last record arrives at 1.2 s
    summary = assert_clean(run, 5)
    # Never early (a sleep never ends early, so this holds on a loaded machine too): the k-th
    # request leaves at 0.3 k s of the run or later, not all at once.
    offsets = sorted(r.started_at - run.started_at for r in run.results)
    assert all(offset >= 0.3 * k - 0.01 for k, offset in enumerate(offsets)), offsets
    assert summary["prefix_hit_rate"] > 0.5  # records share 3 of their 4 blocks


def test_constant_rate_is_bounded_by_duration_and_reported(served, tmp_path):
    run = load(
        served, RandomLengths(input_tokens=32, output_tokens=4, seed=12), Constant(5), 100, duration_s=1.0
    )
    assert 4 <= len(run.results) <= 6  # 1 s at 5 req/s, not 100 requests
    summary = report.summarize(run, 1, 1, "constant")
    report.save(run, summary, tmp_path / "a.json")
    report.plot_run(run, summary, tmp_path / "a.png")
    report.save(run, summary, tmp_path / "b.json")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    compared = report.compare(
        [tmp_path / "a.json", tmp_path / "b.json"], Console(file=open("/dev/null", "w"))
    )
    assert compared[0] == compared[1]
