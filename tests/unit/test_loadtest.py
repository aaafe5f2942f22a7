"""Load-test pieces that need no server: prompts, arrivals, target checks, the stage ledger."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.lifecycle import STAGE_PATTERNS
from loadtest.arrivals import Bursts, Constant, Poisson
from loadtest.runner import check_target
from loadtest.stage_ledger import ledger_row
from loadtest.workloads import MooncakeReplay, MultiTurn, RandomLengths, SharedPrefix


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_mooncake_prompts_share_exactly_the_blocks_their_hash_ids_share(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 2000, "output_length": 4, "hash_ids": [1, 2, 3, 4]},
        {"timestamp": 5, "input_length": 1800, "output_length": 4, "hash_ids": [1, 2, 9, 10]},
        {"timestamp": 9, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 12, "input_length": 600, "output_length": 4, "hash_ids": [7, 2]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    replay = MooncakeReplay(trace, block_tokens=64, max_input_tokens=10_000)
    prompts = [job.body["prompt"] for job in replay.jobs("m")]
    assert [len(p) for p in prompts] == [250, 225, 137, 75]  # input lengths scaled by 64/512
    for (i, a), (j, b) in itertools.combinations(enumerate(prompts), 2):
        shared_ids = common_prefix(rows[i]["hash_ids"], rows[j]["hash_ids"])
        expected = min(shared_ids * 64, len(a), len(b))
        assert common_prefix(a, b) == expected, (i, j)
    assert [job.arrival_s for job in replay.jobs("m")] == [0, 0.005, 0.009, 0.012]


def test_random_lengths_are_exact_token_counts():
    jobs = RandomLengths(input_tokens=100, output_tokens=7, range_ratio=0.5, seed=3).jobs("m")
    for job in itertools.islice(jobs, 20):
        assert 50 <= len(job.body["prompt"]) <= 150
        assert job.body["max_tokens"] == 7 and job.body["ignore_eos"]


def test_shared_prefix_interleaves_groups_behind_identical_system_prompts():
    jobs = list(itertools.islice(SharedPrefix(groups=3, questions=2).jobs("m"), 6))
    systems = [job.body["messages"][0]["content"] for job in jobs]
    assert systems[:3] == systems[3:] and len(set(systems)) == 3
    assert len({job.body["messages"][1]["content"] for job in jobs}) == 6


def test_multi_turn_sessions_carry_their_turns():
    job = next(MultiTurn(turns=4).jobs("m"))
    assert len(job.turns) == 4 and job.body["messages"] == []


def test_arrival_processes():
    assert list(itertools.islice(Constant(4).start_times(), 3)) == [0, 0.25, 0.5]
    assert list(itertools.islice(Bursts(3, 2.0).start_times(), 7)) == [0, 0, 0, 2.0, 2.0, 2.0, 4.0]
    times = list(itertools.islice(Poisson(10, seed=1).start_times(), 5001))
    assert times[-1] / 5000 == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://192.168.1.1"])
def test_load_tests_refuse_targets_beyond_loopback(url):
    with pytest.raises(ValueError, match="loopback"):
        check_target(url)
    assert check_target("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "event,expected",
    [
        ({"choices": [{"text": "Hi", "finish_reason": None}]}, "Hi"),
        ({"choices": [{"text": "", "finish_reason": None}]}, ""),  # a token ending mid-character
        ({"choices": [{"text": "", "finish_reason": "length"}]}, None),  # the closing event
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, None),  # the chat role event
        ({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]}, "x"),
        ({"choices": [], "usage": {"completion_tokens": 3}}, None),
    ],
)
def test_token_events_are_the_ones_vllm_bench_times(event, expected):
    from loadtest.sse_client import _token_text

    assert _token_text(event) == expected


def test_goodput_counts_only_requests_that_met_every_part_of_the_slo():
    """The streaming SLO judges each request by its own p99 gap: one stall in a smooth stream of
    256 tokens passes, three (over 1% of its gaps) do not; the loose SLO looks at TPOT alone."""
    from loadtest.pd_goodput import LOOSE, STREAMING, summarize
    from loadtest.sse_client import RequestResult

    def stream(ttft_s: float, gaps: list[float]) -> RequestResult:
        times = [ttft_s]
        for gap in gaps:
            times.append(times[-1] + gap)
        return RequestResult(started_at=0, ttft_s=ttft_s, e2e_s=times[-1], chunk_times_s=times,
                             output_tokens=len(times))

    smooth = stream(0.1, [0.006] * 255)
    one_stall = stream(0.1, [0.006] * 254 + [0.2])
    stalls = stream(0.1, [0.006] * 252 + [0.05] * 3)
    slow_start = stream(0.5, [0.006] * 255)
    assert [STREAMING.met(r) for r in (smooth, one_stall, stalls, slow_start)] == [True, True, False, False]
    assert [LOOSE.met(r) for r in (smooth, stalls, slow_start)] == [True, True, True]
    failed = RequestResult(started_at=0, error="http_503")
    summary = summarize([smooth, stalls, slow_start, failed], duration_s=2.0, offered=2.0)
    assert summary["goodput_streaming_rps"] == 0.5 and summary["goodput_loose_rps"] == 1.5
    assert summary["attainment_loose"] == 0.75 and summary["errors"] == 1


def test_the_stage_ledger_places_every_stage_of_a_start_from_nothing_and_refuses_one_it_does_not_know():
    """A start's seconds all land in one group each (a stage the ledger does not know would drop
    out of its bars unnoticed): every stage our engines' log marks after the pre-import, the
    weights and their checksum, the warm-up request and the first token (a sleeper's wake-up is
    not a start from nothing: refused)."""
    stages = [name for name, _ in STAGE_PATTERNS if name != "preimport"]
    stages += ["weights", "weights_checksum", "warmup_request", "first_token"]
    row = ledger_row(dict.fromkeys(stages, 1.0))
    assert sum(row.values()) == len(stages)
    with pytest.raises(ValueError, match="model_swap"):
        ledger_row({"weights": 1.0, "model_swap": 2.0})
