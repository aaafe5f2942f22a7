"""A stream whose engine dies goes on on another instance: the client sees one stream, with the
same greedy tokens and usage as a run without the fault (decode/stream_ledger.py), structured output
included (its grammar goes on from the sent tokens: engine/grammar_continuation.py).

SmolLM2 in float32: the continuation recomputes the sent tokens' KV in one prefill, where the
first engine computed it step by step. In bfloat16 the two differ enough to flip a near-tie later
on (seen: SmolLM2's token 16 of 96, 11 tokens after the break, in a repetitive answer; the random
tiny model's token 85 of 400); in float32 they do not (docs/faults.md).
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from streamed import StreamedRequest

from loadtest.fault_probes import kill_engine, migrations

pytestmark = pytest.mark.slow
MODEL, MAX_TOKENS = "smollm2", 96
STALL_S = 4.0  # a frozen engine's streams go on elsewhere after this long without an event
PROMPTS = ["The history of the river Thames begins", "Explain in detail how a bicycle works.",
           "Dear committee, I am writing to apply for", "Tell me a long story about a lighthouse keeper."]
SCHEMA = {"type": "object", "required": ["title", "year", "themes"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "themes": {"type": "array", "items": {"type": "string"}}}}


@pytest.fixture(scope="module")
def served_two(model_dir, artifacts):
    from loadtest.local_cluster import LocalServer

    model_dir(MODEL)
    server = LocalServer(["--model", MODEL, "--instances", "2", "--kv-cache-gib", "1", "--dtype", "float32",
                          "--structured-migration",
                          "--stream-stall-timeout", str(STALL_S)], artifacts / "serve-migration.log").start()
    try:
        yield server
    finally:
        server.stop()


def body(k: int, structured: bool = False) -> tuple[str, dict]:
    """Completions and chats, alternately: greedy, every token owed, usage at the end; if
    `structured`, the chats answer in a JSON schema and the completions in a regex."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if k == 2:  # a client that asks for token ids gets them, continuation included
        common["return_token_ids"] = True
    if k % 2:
        if structured:
            common["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": PROMPTS[k]}]}
    if structured:
        common["structured_outputs"] = {"regex": "[A-Za-z ,.]+"}
    return "/v1/completions", {**common, "prompt": PROMPTS[k]}


def streamed(url: str, k: int, structured: bool = False) -> StreamedRequest:
    return StreamedRequest(url, *body(k, structured))


def _until_each_sent_tokens(server, streams: list[StreamedRequest], timeout_s: float = 60) -> None:
    """Until every stream has sent a few tokens; one that ended first (refused, broken) fails the
    test with its errors and the router's last warnings."""
    deadline = time.monotonic() + timeout_s
    while min(s.tokens for s in streams) < 3:
        ended_early = [s.errors for s in streams if s.ended and s.tokens < 3]
        if ended_early or time.monotonic() > deadline:
            warnings = [line for line in server.log_path.read_text().splitlines() if " WARNING " in line]
            pytest.fail(f"streams ended early: {ended_early}; tokens {[s.tokens for s in streams]}; the router's "
                        "last warnings:\n" + "\n".join(warnings[-15:]))
        time.sleep(0.005)


@pytest.fixture(scope="module")
def fault_free() -> dict[bool, list]:
    """Each kind's fault-free results, by `structured`: asked once for the module (greedy, float32:
    the same on either instance and in every round)."""
    return {}


@pytest.mark.parametrize(("structured", "fault"), [(False, "killed"), (True, "killed"), (False, "frozen")],
                         ids=["plain", "structured", "frozen"])
def test_a_killed_engine_costs_no_stream_and_no_token(served_two, fault_free, structured, fault):
    """Killed (SIGKILL: the connection breaks) or frozen (SIGSTOP: it stays open, silent, until
    the stall deadline)."""
    _wait_for_two_ready(served_two)
    if structured not in fault_free:
        fault_free[structured] = [s.result() for s in [streamed(served_two.url, k, structured)
                                                       for k in range(len(PROMPTS))]]
    expected = fault_free[structured]
    assert all(usage["completion_tokens"] == MAX_TOKENS and not errors for _, usage, errors, _ in expected)
    assert len(expected[2][3]) == MAX_TOKENS and not expected[0][3]  # token ids for who asked only

    # A round whose streams on the victim all ended before the fault landed (one stream started
    # late, e.g. on a grammar compile, while the others ran to their end) tested nothing: replay it.
    for _ in range(3):
        migrations_before = migrations(served_two)
        streams, at_kill = _fault_mid_stream(served_two, structured, fault)
        results = [s.result() for s in streams]
        # Every stream, cut and continued or not, is the fault-free one: same text token for token,
        # usage counted once, no error event, one id as the client sees it.
        assert [r[2] for r in results] == [[]] * len(streams)
        assert [r[0] for r in results] == [e[0] for e in expected]
        assert [r[1] for r in results] == [e[1] for e in expected]
        assert [r[3] for r in results] == [e[3] for e in expected]
        assert all(len(s.ids) == 1 for s in streams)
        deadline = time.monotonic() + 10  # the router's books: every stream left every instance it entered
        while any(i["inflight"] for i in served_two.instances()):
            assert time.monotonic() < deadline, served_two.instances()
            time.sleep(0.1)
        _wait_for_two_ready(served_two)  # the pool controller brings the killed instance's capacity back
        if migrations(served_two) > migrations_before:
            break
    else:
        pytest.fail(f"three rounds and no stream was cut by the fault: tokens at the fault {at_kill}")


def _fault_mid_stream(server, structured: bool, fault: str) -> tuple[list[StreamedRequest], list[int]]:
    """Starts one stream per prompt and, once each has sent tokens, kills or freezes the instance
    holding the most of them; a frozen one is thawed after its streams ended."""
    streams = [streamed(server.url, k, structured) for k in range(len(PROMPTS))]
    _until_each_sent_tokens(server, streams)
    victim = max((i for i in server.instances() if i["state"] == "ready"), key=lambda i: i["inflight"])
    assert victim["inflight"] >= 1, victim
    kill_engine(victim["url"], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    at_kill = [s.tokens for s in streams]
    if fault == "frozen":
        try:
            for s in streams:
                s.result()
        finally:
            kill_engine(victim["url"], signal.SIGCONT)  # it serves again once its health checks pass
    return streams, at_kill


def _wait_for_two_ready(server) -> None:
    """Both instances serve (each test begins so: one that failed half-way leaves no cascade)."""
    deadline = time.monotonic() + 240
    while sum(i["state"] == "ready" for i in server.instances()) < 2:
        assert time.monotonic() < deadline, server.instances()
        time.sleep(0.5)


def test_a_drained_instance_finishes_its_streams_then_stops(served_two):
    """A planned shrink (POST /admin/instances/ID/drain, the pool controller's own drain): the
    instance takes no new request, its streams end whole where they are (none migrates), then it
    stops, and the pool gets its capacity back."""
    admin = served_two.credentials.admin_headers()
    _wait_for_two_ready(served_two)
    migrations_before = migrations(served_two)
    streams = [streamed(served_two.url, k) for k in range(len(PROMPTS))]
    _until_each_sent_tokens(served_two, streams)
    victim = max((i for i in served_two.instances() if i["state"] == "ready"), key=lambda i: i["inflight"])
    assert victim["inflight"] >= 1, victim
    drained = httpx.post(f"{served_two.url}/admin/instances/{victim['instance_id']}/drain", headers=admin, timeout=10)
    assert drained.status_code == 202, drained.text
    states = {i["instance_id"]: i["state"] for i in served_two.instances()}
    assert states[victim["instance_id"]] == "draining", states  # its streams still run: it is there
    during = httpx.post(f"{served_two.url}/v1/completions", timeout=120,  # served by the other one
                        json={"model": MODEL, "prompt": "While one drains", "max_tokens": 4, "temperature": 0})
    assert during.status_code == 200, during.text
    results = [s.result() for s in streams]
    assert all(not errors and usage["completion_tokens"] == MAX_TOKENS for _, usage, errors, _ in results), results
    assert migrations(served_two) == migrations_before  # each ended where it ran
    deadline = time.monotonic() + 240  # gone, and the pool controller restores the pool's floor
    while victim["instance_id"] in (ids := [i["instance_id"] for i in served_two.instances()]) or sum(
            i["state"] == "ready" for i in served_two.instances()) < 2:
        assert time.monotonic() < deadline, ids
        time.sleep(0.5)


def test_sigterm_drains_the_streams_in_flight_before_the_engines_stop(served_two):
    """Last in this module: it stops the server. `pdcluster down` and a pod's termination send
    SIGTERM; the router takes no new connection but its open streams end whole."""
    stream = streamed(served_two.url, 0)
    _until_each_sent_tokens(served_two, [stream])
    served_two._process.send_signal(signal.SIGTERM)
    text, usage, errors, _ = stream.result()
    assert not errors and usage["completion_tokens"] == MAX_TOKENS
    served_two._process.wait(120)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served_two.url}/health", timeout=5)
