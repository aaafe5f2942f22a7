"""The serving simulator (issue #37): its step model fits what it is given, its engines batch and
stall as vLLM's do, P/D keeps decode streams free of prefill stalls, and on the H200 profiles it
predicts the two-GPU load test that docs/pd.md reports (measured by loadtest.pd_goodput), and on
the CPU profiles pd_bench's closed loop on two cores."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from deploy.cli import command_parser
from loadtest import pd_plan
from loadtest.pd_predict import comparison, measured_rows
from loadtest.serving_sim import NETWORKS_GBIT, Simulation, Topology, Workload, random_prompts, simulate_rate
from loadtest.step_model import Step, StepModel, chunked_prefill

GPU = Path(__file__).resolve().parents[2] / "docs" / "gpu"
CPU = GPU.parent / "cpu"
H200_COLOCATED, H200_PD = GPU / "engine_profile-h200-8b-colocated.json", GPU / "engine_profile-h200-8b-pd.json"
MEASURED = [GPU / "pd_goodput-h200x2-run1.json", GPU / "pd_goodput-h200x2-run2.json"]


# A known step time: g(T) linear, a per-sequence cost, attention terms large enough to see.
G0, G1, PER_SEQ, PER_CONTEXT, PER_ATTENTION, FIRST_TOKEN = 4e-3, 1e-5, 2e-5, 1e-6, 1e-9, 5e-3


def true_seconds(steps: list[Step], first_token: bool = False) -> float:
    return sum(G0 + G1 * s.tokens + PER_SEQ * s.decode_seqs + PER_CONTEXT * s.decode_context_tokens
               + PER_ATTENTION * s.prefill_attention for s in steps) + FIRST_TOKEN * first_token


def synthetic_profile(budget: int = 2048) -> dict:
    """A profile whose every observation is `true_seconds`, in the shapes engine_profile writes."""
    return {
        "engine": {"max_num_batched_tokens": budget, "max_num_seqs": 256, "kv_capacity_tokens": 200_000},
        "kv_bytes_per_token": 1000,
        "prefill": [{"prompts": n, "tokens": t, "seconds": true_seconds(chunked_prefill([t] * n, budget), True)}
                    for n, t in ((1, 128), (1, 512), (1, 1024), (1, 4000), (4, 1024), (2, 3000))],
        "decode": [{"batch": b, "context": c, "step_s": true_seconds([Step(b, b * c)])}
                   for b in (1, 4, 16, 64, 256) for c in (256, 2048)],
        "mixed": [{"batch": b, "context": 1024, "chunk": k,
                   "step_s": true_seconds([Step(b, b * 1024, k, Step.chunk_attention(k, 0))])}
                  for b in (1, 32) for k in (256, 1024, 1536)],
        "handover": [{"tokens": t, "direct_s": 1e-4 + t * 1000 / 1e11, "store_s": 0.01 + t * 1000 / 1e9}
                     for t in (1024, 4096, 16384)],
    }


def test_the_step_model_recovers_the_step_times_it_was_fitted_to_and_extends_them():
    model = StepModel.fit(synthetic_profile())
    assert model.knots[-1] == 4096  # no knot that no measured step reaches
    assert model.first_token_s == pytest.approx(FIRST_TOKEN, rel=1e-6)
    for step in (Step(1, 300), Step(200, 200 * 3000), Step(8, 8000, 1024, Step.chunk_attention(1024, 2000)),
                 Step(prefill_tokens=16384, prefill_attention=Step.chunk_attention(16384, 0))):  # beyond the data
        assert model.seconds(step) == pytest.approx(true_seconds([step]), rel=1e-6), step
    assert model.handovers["store"].seconds(8192) == pytest.approx(0.01 + 8192 * 1000 / 1e9, rel=1e-6)
    slow = model.handovers["direct"].over_network(NETWORKS_GBIT["tcp-100"])
    assert slow.seconds(8192) == pytest.approx(1e-4 + 8192 * 1000 * 8 / 100e9, rel=1e-6)


def test_prompts_are_chunked_first_come_first_served_under_the_budget():
    steps = chunked_prefill([5000, 5000], 8192)
    assert [s.prefill_tokens for s in steps] == [8192, 1808]
    # the second prompt's chunk in step one attends to nothing before it, in step two to its first 3192
    assert steps[1].prefill_attention == Step.chunk_attention(1808, 3192)


@pytest.fixture(scope="module")
def model() -> StepModel:
    return StepModel.fit(synthetic_profile())


def one_run(topology: Topology, model: StepModel, arrivals: list[float], handover: str = "direct",
            prompt: int = 1024, output: int = 64):
    sim = Simulation(topology, model, model.handovers[handover], remote_prefill_min_tokens=0)  # P/D: every prompt remote
    results = sorted(sim.run(random_prompts(arrivals, prompt, output)), key=lambda r: r.started_at)
    return sim, results


def test_an_idle_engine_prefills_then_decodes_one_step_per_token_over_a_growing_context(model):
    _, (result,) = one_run(Topology("colocated:1", 1), model, [0.0])
    prefill = model.seconds(Step(prefill_tokens=1024, prefill_attention=Step.chunk_attention(1024, 0)))
    assert result.ttft_s == pytest.approx(prefill + model.first_token_s, rel=1e-9)
    assert len(result.chunk_times_s) == result.output_tokens == 64
    gaps = result.inter_token_s()  # gap j-1 is decode step j, over the prompt and j-1 tokens
    for j in (1, 50):
        assert gaps[j - 1] == pytest.approx(model.seconds(Step(1, 1024 + j - 1)), rel=1e-9)
    assert gaps[49] > gaps[0]


def test_an_engine_with_part_of_its_core_steps_that_much_slower(model):
    """core_share: the CPU an engine's neighbours take stretches its steps, not the delivery."""
    sim = Simulation(Topology("colocated:1", 1), model, model.handovers["direct"], core_share=0.5)
    (result,) = sim.run(random_prompts([0.0], 1024, 8))
    prefill = model.seconds(Step(prefill_tokens=1024, prefill_attention=Step.chunk_attention(1024, 0)))
    assert result.ttft_s == pytest.approx(2 * prefill + model.first_token_s, rel=1e-9)
    assert result.inter_token_s()[0] == pytest.approx(2 * model.seconds(Step(1, 1024)), rel=1e-9)
    with pytest.raises(ValueError, match="core_share"):
        Simulation(Topology("colocated:1", 1), model, model.handovers["direct"], core_share=0.0)


def test_a_pd_request_pays_the_prefill_the_hop_the_kv_read_and_one_decode_step(model):
    sim, (result,) = one_run(Topology("pd:1+1", 1, 1), model, [0.0], handover="store")
    prefill = model.seconds(Step(prefill_tokens=1024, prefill_attention=Step.chunk_attention(1024, 0)))
    last_token = model.seconds(Step(prefill_tokens=1, prefill_attention=Step.chunk_attention(1, 1023)))
    expected = (prefill + model.first_token_s + sim.hop_s + model.handovers["store"].seconds(1024) + last_token
                + model.first_token_s)
    assert result.ttft_s == pytest.approx(expected, rel=1e-9)


def test_a_colocated_stream_stalls_behind_a_prefill_and_a_pd_one_does_not(model):
    """The reason P/D exists: the second prompt's prefill shares a colocated engine's step with the
    first stream's decode; in P/D it runs on the prefill engine."""
    _, colocated = one_run(Topology("colocated:1", 1), model, [0.0, 0.1])
    _, pd = one_run(Topology("pd:1+1", 1, 1), model, [0.0, 0.1])
    for stream, stalled in ((colocated[0], True), (pd[0], False)):
        gaps = stream.inter_token_s()
        assert bool(max(gaps) > 2 * np.median(gaps)) is stalled


def test_adaptive_prefills_on_the_decode_engine_while_the_prefill_engine_is_queued(model):
    burst = [0.001 * k for k in range(12)]
    plain, _ = one_run(Topology("pd:1+1", 1, 1), model, burst)
    adaptive, results = one_run(Topology("adaptive:1+1", 1, 1, max_queued_tokens=1024), model, burst)
    assert plain.engines["prefill-0"].requests == 12
    assert 0 < adaptive.engines["prefill-0"].requests < 12
    assert all(r.ok and len(r.chunk_times_s) == 64 for r in results)


def test_a_closed_loop_keeps_its_clients_busy_and_never_more(model):
    """pd_bench's fixed concurrency: each client's next request leaves when its last answer ends,
    so no more than `concurrency` are in flight and one engine's queue is what two clients send."""
    sim = Simulation(Topology("colocated:1", 1), model, model.handovers["direct"])
    prompts = random_prompts([0.0] * 7, 1024, 16)
    results = sorted(sim.run_closed(prompts, concurrency=2), key=lambda r: r.started_at)
    assert len(results) == 7 and all(r.ok and len(r.chunk_times_s) == 16 for r in results)
    ends = sorted(r.started_at + r.e2e_s for r in results)
    assert [r.started_at for r in results] == pytest.approx([0.0, 0.0, *ends[:5]], abs=1e-12)
    for r in results:
        in_flight = sum(o.started_at <= r.started_at < o.started_at + o.e2e_s for o in results)
        assert in_flight <= 2


@pytest.mark.slow  # simulates whole benchmarks: seconds
def test_pd_bench_predictions_run_on_its_prompts_and_its_topologies(model, tmp_path):
    """loadtest.pd_bench_predict: the prompts pd_bench sends (their lengths, none sharing a block),
    and each of its four topologies simulated to a summary as pd_bench reduces them."""
    from loadtest import pd_bench_predict
    from loadtest.workloads import RandomLengths

    prompts = pd_bench_predict.bench_prompts(1536, 8, 5, seed=7)
    sent = [len(job.body["prompt"]) for job in itertools.islice(RandomLengths(1536, 8, 0.5, seed=7).jobs("tiny"), 5)]
    assert [p.input_length for p in prompts] == sent
    blocks = [i for p in prompts for i in p.hash_ids]
    assert len(set(blocks)) == len(blocks)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(synthetic_profile()))
    out = tmp_path / "predict.json"
    assert pd_bench_predict.main(["--profile", str(profile), "--out", str(out)]) == 0
    predicted = json.loads(out.read_text())["predicted"]
    assert list(predicted) == list(pd_bench_predict.topologies(1536))
    assert predicted["colocated x2"]["req/s"] > predicted["P/D 1+1, KV via store"]["req/s"] > 0


@pytest.mark.slow  # simulates whole benchmarks: seconds
def test_on_the_h200_profiles_it_predicts_the_two_gpu_load_test_below_saturation():
    """docs/pd.md's table, measured on two H200s, for colocated, P/D and adaptive at 4 and 8 req/s
    (the seeds pd_goodput used): TTFT and TPOT p50 within 20%, served rate and loose goodput
    within 15% (below saturation those two follow from the arrivals: they check the bookkeeping)."""
    model, pd_model = StepModel.load(H200_COLOCATED), StepModel.load(H200_PD)
    handover = pd_model.handovers["direct"].over_network(NETWORKS_GBIT["nvlink"])
    workload = Workload.parse("4096/256")
    rows = [simulate_rate(Topology.parse(name, 4096), model, handover, workload, rate, 20.0, seed, pd_model)
            for name in ("colocated:2", "pd:1+1", "adaptive:1+1") for seed, rate in enumerate((4.0, 8.0))]
    pairs = comparison(rows, measured_rows(MEASURED))
    assert len(pairs) == 6
    for pair in pairs:
        for column, tolerance in (("TTFT p50 ms", 0.2), ("TPOT p50 ms", 0.2), ("served", 0.15), ("good loose", 0.15)):
            measured, predicted = pair["values"][column]
            assert predicted == pytest.approx(measured, rel=tolerance), (pair["topology"], pair["offered_rps"], column)


@pytest.mark.slow  # simulates whole benchmarks: seconds
def test_on_cpu_profiles_it_predicts_pd_benchs_rates_and_ranking(tmp_path):
    """docs/pd.md's CPU table: pd_bench measured on two cores (session 39) against the simulator on
    tiny's CPU profiles from the same machine, each topology's engines given the share of a core
    pd_bench measured them to have: every rate within 20% (colocated's is +19%, the nearest to
    it: decode steps come out fast, docs/pd.md says why), colocated the fastest, and of the P/D
    topologies the one that prefills locally when busy the fastest, as measured."""
    from loadtest import pd_bench_predict

    out = tmp_path / "predict.json"
    assert pd_bench_predict.main(["--profile", str(CPU / "engine_profile-tiny-colocated.json"), "--pd-profile",
                                  str(CPU / "engine_profile-tiny-pd.json"), "--compare",
                                  str(CPU / "pd_bench-session39.json"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert all(0.7 < share < 0.9 for share in report["core_shares"].values())
    rates = {side: {name: row["req/s"] for name, row in report[side].items()} for side in ("measured", "predicted")}
    for name, measured in rates["measured"].items():
        assert rates["predicted"][name] == pytest.approx(measured, rel=0.2), name
    for side in rates.values():
        ranked = sorted(side, key=side.get, reverse=True)
        assert ranked[:2] == ["colocated x2", "P/D 1+1, store, local when busy"], ranked


@pytest.mark.slow  # simulates whole benchmarks: seconds
def test_a_plan_names_pool_sizes_and_writes_its_figures_and_the_pools_serve_starts(tmp_path):
    out, serve_args = tmp_path / "plan.json", tmp_path / "pools.args"
    assert pd_plan.main(["--profile", str(H200_COLOCATED), "--pd-profile", str(H200_PD), "--gpus", "2",
                         "--duration", "4", "--jobs", "1", "--out", str(out), "--serve-args", str(serve_args)]) == 0
    (plan,) = json.loads(out.read_text())["plans"]
    names = {row["topology"] for row in plan["rows"]}
    assert names == {"colocated:2", "pd:1+1", "adaptive:1+1@4096"}
    # what two H200s showed (docs/pd.md): P/D holds the streaming SLO for far more requests
    streaming = plan["best"]["streaming"]
    assert streaming["topology"] != "colocated:2"
    assert streaming["goodput_rps"] > 1.5 * streaming["colocated_goodput_rps"]
    assert streaming["serve_flags"].startswith("--prefill 1 --decode 1")
    assert streaming["pd_pays_at_rps"]
    assert out.with_suffix(".png").stat().st_size > 0
    # `pdcluster serve` starts the planned pools: its own parser reads the flags from the file
    serve = command_parser().parse_args(["serve", "--model", "tiny", f"@{serve_args}"])
    assert (serve.instances, serve.prefill, serve.decode) == (1, 1, 1)
    planned = Topology.parse(streaming["topology"], 0)
    assert serve.remote_prefill_max_queued_tokens == planned.max_queued_tokens
    assert serve.remote_prefill_min_tokens == 0  # every prompt to the prefill pool, as simulated
