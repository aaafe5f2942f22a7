"""loadtest.faults without engines: a fault hits only open streams the victim relays (as the
router's GET /admin/instances lists them), a row that misses its goals fails the run."""

from __future__ import annotations

import pytest

from loadtest import fault_scenarios, faults
from loadtest.sse_client import RequestResult


class FakeRouter:
    """GET /admin/instances as the router answers it: each instance's streams by id."""

    def __init__(self, streams: dict[str, list[str]]):
        self.streams = streams

    def instances(self) -> list[dict]:
        return [{"instance_id": name, "inflight": len(ids), "streams": [{"id": i, "tokens_sent": 1} for i in ids]}
                for name, ids in self.streams.items()]


def stream(response_id: str, tokens: int, ended: bool = False) -> RequestResult:
    result = RequestResult(started_at=0.0, response_id=response_id, chunk_times_s=[0.1] * tokens)
    result.e2e_s = 1.0 if ended else None
    return result


@pytest.fixture(autouse=True)
def engines_running(monkeypatch) -> dict[str, int]:
    """What each stand-in engine generates now (vLLM's num_requests_running): all it holds."""
    running: dict[str, int] = {}
    monkeypatch.setattr(faults, "engine_running",
                        lambda router, instance_id: running.get(instance_id, len(router.streams[instance_id])))
    return running


async def test_the_kill_waits_for_the_engine_to_be_generating_the_streams(engines_running):
    """A stream the engine has finished may still be in the sockets: a kill would not cut it.
    The kill waits for one the engine still generates."""
    live = [stream("a", 5), stream("b", 3)]
    router = FakeRouter({"victim": ["a"], "other": ["b"]})
    engines_running["victim"] = 0
    with pytest.raises(faults.NoFaultHit):
        await faults.streams_on_victim(router, live, count=2, victim_id="victim", within_s=0.2)
    engines_running["victim"] = 1
    hit = await faults.streams_on_victim(router, live, count=2, victim_id="victim", within_s=1)
    assert hit["victim_engine_running_at_kill"] == 1


async def test_the_kill_counts_only_the_victims_open_streams_that_have_tokens():
    live = [stream("a", 5), stream("b", 3), stream("c", 9, ended=True), stream("d", 0), stream("e", 2),
            stream("f", 4)]
    router = FakeRouter({"victim": ["a", "f"], "other": ["b", "d", "e"]})
    hit = await faults.streams_on_victim(router, live, count=6, victim_id="victim", within_s=1)
    # "c" ended (not open), "b", "d" and "e" are elsewhere: of the victim's, "a" and "f" are hit
    assert hit == {"streams_open_at_kill": 4, "streams_on_victim_at_kill": 2, "tokens_each_victim_stream_had": [4, 5],
                   "victim_inflight_at_kill": 2, "victim_engine_running_at_kill": 2}
    router = FakeRouter({"victim": ["a", "b", "e", "f"]})
    everything = await faults.streams_on_victim(router, live, count=6, within_s=1)  # the router itself
    assert everything["tokens_each_victim_stream_had"] == [2, 3, 4, 5]


@pytest.mark.parametrize("live", [
    [stream("a", 5), stream("b", 3)],  # half the burst open, none of them on the victim
    [stream("c", 9, ended=True), stream("c2", 9, ended=True), stream("b", 3)],  # the victim's have ended
    [stream("c", 1), stream("x", 0), stream("y", 0), stream("z", 0)],  # on the victim, but not half the burst open
    [stream("c", 1), stream("c2", 2), stream("x", 0), stream("b", 3)],  # the victim also holds one with no token
])
async def test_no_open_stream_with_tokens_on_the_victim_is_an_error(live):
    router = FakeRouter({"victim": ["c", "c2", "x"], "other": ["a", "b"]})
    with pytest.raises(faults.NoFaultHit):
        await faults.streams_on_victim(router, live, count=4, victim_id="victim", within_s=0.2)


def row(**fields) -> dict:
    base = {"sent": 24, "completed": 24, "failed_clean": 0, "dropped": 0, "hung": 0, "equal_to_no_fault": 24,
            "migrated": 12, "follow_up_completed": 8, "follow_up_sent": 8, "store_in_flight_after": [0]}
    return {**base, **fields}


def test_a_row_misses_its_stated_goals_and_only_those():
    migration = fault_scenarios.SCENARIOS["decode-killed-mid-json-stream"]
    drain = fault_scenarios.SCENARIOS["instance-drained-under-load"]
    assert fault_scenarios.missed_goals(migration, row()) == []
    assert fault_scenarios.missed_goals(migration, row(completed=23, failed_clean=1)) == [fault_scenarios.GOALS["all_completed"][0]]
    assert fault_scenarios.missed_goals(migration, row(equal_to_no_fault=23)) == [fault_scenarios.GOALS["equal_to_no_fault"][0]]
    assert fault_scenarios.missed_goals(migration, row(migrated=0)) == [fault_scenarios.GOALS["migrated"][0]]
    assert fault_scenarios.missed_goals(migration, row(store_in_flight_after=[4096])) == [fault_scenarios.GOALS["store_settled"][0]]
    assert fault_scenarios.missed_goals(drain, row(migrated=0, equal_to_no_fault=20)) == []  # the drain promises no equality
    assert fault_scenarios.missed_goals(drain, row(migrated=0, completed=23, dropped=1)) == [fault_scenarios.GOALS["all_completed"][0]]
    assert fault_scenarios.missed_goals(drain, row(migrated=1)) == [fault_scenarios.GOALS["none_migrated"][0]]
    assert fault_scenarios.missed_goals(drain, row(migrated=0, hung=1, completed=23)) == [
        "nothing hung", fault_scenarios.GOALS["all_completed"][0]]
    assert fault_scenarios.missed_goals(drain, {"scenario": drain.name, "error": "no fault: ..."}) == ["no fault: ..."]


def test_the_run_fails_when_a_row_misses_a_goal_or_hits_nothing(monkeypatch, tmp_path):
    answers = {"colocated-killed-mid-stream": row(), "structured-stream-killed": row(equal_to_no_fault=20)}

    def run_row(scenario, requests):
        if scenario.name == "instance-drained-under-load":
            raise faults.NoFaultHit("no fault")
        return {"scenario": scenario.name, **answers[scenario.name]}

    monkeypatch.setattr(faults, "run_row", run_row)
    out = ["--out", str(tmp_path / "faults.json")]
    assert faults.main(["--scenario", "colocated-killed-mid-stream", *out]) == 0
    assert faults.main(["--scenario", "colocated-killed-mid-stream", "--scenario", "structured-stream-killed", *out]) == 1
    assert faults.main(["--scenario", "instance-drained-under-load", *out]) == 1


def test_the_json_schema_row_streams_chats_in_a_schema():
    scenario = fault_scenarios.SCENARIOS["decode-killed-mid-json-stream"]
    body = scenario.body("a prompt")
    assert scenario.endpoint == "/v1/chat/completions" and "--decode" in scenario.serve_args
    assert body["messages"] == [{"role": "user", "content": "a prompt"}] and body["temperature"] == 0
    assert body["response_format"]["json_schema"]["schema"] == fault_scenarios.JSON_SCHEMA
    from decode.stream_ledger import CHAT, migratable

    assert migratable(CHAT, {**body, "stream": True})  # its streams go on elsewhere
