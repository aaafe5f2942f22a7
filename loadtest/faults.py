"""Fault injection with real processes and signals: what a crash costs the clients.

    python -m loadtest.faults [--requests 24] [--scenario NAME ...]

Each scenario starts its own `pdcluster serve` (tiny model), sends a burst of concurrent greedy
streams, SIGKILLs one engine's whole process group (vLLM server, engine core, worker), the KV
store shard's process or the router's (which is then started again: it adopts the engines and
rebuilds its KV index) while they run, then sends a follow-up batch to see the service recover.
`instance-drained-under-load` drains an engine instead (a planned shrink: its streams must end
where they run, none migrated); `router-killed-of-two` runs two routers (`--router-only` for the
second) behind nginx (loadtest/balancer.py), kills the one that owns the fleet, and sends each
cut stream again once, as a client would.
An engine that serves streams (decode, colocated; drained too), and the router that owns the
fleet in `router-killed-of-two`, is hit only once at least half the burst is open with tokens
sent and the victim relays some of those open streams: which ones, the router's GET
/admin/instances says (each instance's migratable streams, by the id the client sees on every
event). None within 60 s: the row is an error. The row says how many open streams were on the
victim at the kill and how many tokens each of those had received, and how many streams' texts
equal the same burst's without a fault (sent first; the streams the victim held go on
elsewhere, decode/stream_ledger.py; in `structured-stream-killed` they carry a regex, in
`decode-killed-mid-json-stream` a JSON schema as `response_format`, whose grammar goes on from
the sent tokens: engine/grammar_continuation.py); P/D scenarios also report what the store still
holds in flight afterwards (leases, reserved bytes: both must be back at 0). Every request is
classified: completed (all its tokens), failed clean (an OpenAI-style HTTP error or an error
event closing the stream), dropped (connection cut or stream ended short) or hung (no end within
the client's timeout). Each scenario states its goals (loadtest/fault_scenarios.py; every one: nothing hung, the
follow-up batch served whole); a row that misses one, or whose fault hit nothing, makes the
exit status 1. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import httpx
from rich.console import Console
from rich.table import Table

from loadtest.balancer import balancer
from loadtest.fault_probes import engine_running, index_blocks, kill_engine, migrations, store_shards
from loadtest.fault_scenarios import SCENARIOS, Scenario, missed_goals
from loadtest.local_cluster import LocalServer, RayHead
from loadtest.sse_client import RequestResult, stream_request
from loadtest.workloads import random_text

HANG_TIMEOUT_S = 120.0


class NoFaultHit(RuntimeError):
    """The victim never held open streams that had sent tokens: the run proves nothing."""


def classify(result: RequestResult, scenario: Scenario) -> str:
    if result.error == "timeout":
        return "hung"
    if result.error in ("stream",) or (result.error or "").startswith("http_"):
        return "failed_clean"
    if result.error or result.output_tokens != scenario.max_tokens:
        return "dropped"
    return "completed"


@dataclasses.dataclass
class Outcome:
    kind: str
    """completed, failed_clean, dropped or hung (see the module docstring)."""
    error: str
    text: str


def prompts_of(count: int, scenario: Scenario, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, scenario.prompt_words) for _ in range(count)]


async def burst(url: str, count: int, scenario: Scenario, seed: int,
                live: list[RequestResult] | None = None) -> list[Outcome]:
    """`count` concurrent greedy streams (the same prompts for the same seed); each one's outcome.
    `live`, if given, gets each stream's result as it fills (tokens so far)."""
    return await streams(url, prompts_of(count, scenario, seed), scenario, live)


async def streams(url: str, prompts: list[str], scenario: Scenario,
                  live: list[RequestResult] | None = None) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=None, connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(prompt: str) -> Outcome:
            body = scenario.body(prompt)
            result = RequestResult(started_at=time.time())
            if live is not None:
                live.append(result)
            try:
                async with asyncio.timeout(HANG_TIMEOUT_S):
                    await stream_request(session, f"{url}{scenario.endpoint}", body, result)
            except TimeoutError:
                return Outcome("hung", "timeout", result.text)
            return Outcome(classify(result, scenario), result.error or "", result.text)

        return await asyncio.gather(*(one(p) for p in prompts))


def tally(outcomes: list[Outcome]) -> dict:
    counts = collections.Counter(o.kind for o in outcomes)
    errors = collections.Counter(o.error for o in outcomes if o.error)
    return {
        **{k: counts[k] for k in ("completed", "failed_clean", "dropped", "hung")},
        "errors": dict(errors),
    }


def open_streams(live: list[RequestResult]) -> list[RequestResult]:
    """The streams that have received tokens and not ended."""
    return [r for r in live if r.chunk_times_s and r.e2e_s is None]


async def streams_on_victim(server: LocalServer, live: list[RequestResult], count: int,
                            victim_id: str | None = None, within_s: float = 60.0) -> dict:
    """Waits until at least half the burst is open with tokens received and the victim relays
    some of those open streams and holds nothing else (`victim_id`: that instance, as `server`
    routes to it; None: `server`, the router itself), and, for an engine, while that engine is
    still generating some of them (vLLM's `num_requests_running`: a stream the engine has
    finished may still be in the sockets' buffers, which a kill does not cut: the row's
    `migrated` says how many were). A request whose engine dies before its first token fails
    cleanly by design (it may be what killed the engine: it is not tried on another), so a kill
    then would test that, not migration. Returns what the kill will hit: how many open streams
    were on the victim and how many tokens each had received. The streams an instance serves are
    the router's (GET /admin/instances, `streams`: the migratable ones, by the id every event of
    theirs carries); read before the kill, which follows with no wait in between."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            instances = await asyncio.to_thread(server.instances)
        except httpx.TimeoutException:  # a router busy relaying the burst answers late: ask again
            continue
        running = None
        if victim_id and (running := await asyncio.to_thread(engine_running, server, victim_id)) is None:
            continue  # not known now: ask again
        relayed = {s["id"] for i in instances if victim_id in (None, i["instance_id"]) for s in i["streams"]}
        streaming = open_streams(live)
        hit = [r for r in streaming if r.response_id in relayed]
        inflight = sum(i["inflight"] for i in instances if victim_id in (None, i["instance_id"]))
        if len(streaming) >= count / 2 and hit and len(hit) >= inflight and (running is None or running >= 1):
            return {"streams_open_at_kill": len(streaming), "streams_on_victim_at_kill": len(hit),
                    "tokens_each_victim_stream_had": sorted(len(r.chunk_times_s) for r in hit),
                    "victim_inflight_at_kill": inflight, "victim_engine_running_at_kill": running}
        await asyncio.sleep(0.05)
    raise NoFaultHit(f"no fault: within {within_s:g} s, half the burst was never open with tokens while the victim "
                     f"({victim_id or 'the router'}) relayed some of those streams, still generating some, "
                     "and nothing else")


async def restart_router(server: LocalServer, blocks_known: int) -> dict:
    """SIGKILL the router, start it again: how long until it served again, whether it kept the
    engines, and whether its index knows again the `blocks_known` blocks it knew before the load
    (rebuilt from the engines' KV event buffers)."""
    instances_before = sorted(i["instance_id"] for i in server.instances())
    server.kill()
    started = time.monotonic()
    server.log_path = server.log_path.with_name(server.log_path.stem + "-restarted.log")
    await asyncio.to_thread(server.start)
    restart_s = time.monotonic() - started
    deadline = time.monotonic() + 10
    while (blocks_after := index_blocks(server)) < blocks_known and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return {"restart_s": round(restart_s, 2), "index_blocks_before": blocks_known,
            "index_blocks_after_restart": blocks_after,
            "engines_kept": instances_before == sorted(i["instance_id"] for i in server.instances())}


async def run_scenario(server: LocalServer, scenario: Scenario, requests: int) -> dict:
    restart: dict = {}
    if scenario.victim_role == "store":
        (shard,) = store_shards(server.url)
        victim = {"instance_id": f"store shard (pid {shard['pid']})"}
    elif scenario.victim_role == "router":
        victim = {"instance_id": f"router (pid {server.pid})"}
        await burst(server.url, 4, scenario, seed=3)  # prefixes the engines hold before the load
        await asyncio.sleep(3)  # the router's speculative entries expire; the engines' remain
        blocks_known = index_blocks(server)
    else:
        victim = [i for i in server.instances() if i["role"] == scenario.victim_role][0]
    if scenario.kills_streams:
        # The same burst without a fault: what each stream must say (greedy) despite the kill.
        no_fault = await burst(server.url, requests, scenario, seed=1)
    migrations_before = migrations(server)
    live: list[RequestResult] = []
    load = asyncio.create_task(burst(server.url, requests, scenario, seed=1, live=live))
    load_ended = asyncio.get_running_loop().create_future()
    load.add_done_callback(lambda _: load_ended.set_result(time.monotonic()))
    hit: dict = {}
    if scenario.kills_streams:
        hit = await streams_on_victim(server, live, requests, victim["instance_id"])
    else:
        await asyncio.sleep(scenario.kill_after_s)
    killed_at = time.monotonic()
    if scenario.victim_role == "store":
        os.kill(shard["pid"], signal.SIGKILL)
    elif scenario.victim_role == "router":
        restart = await restart_router(server, blocks_known)
    elif scenario.drained:
        admin = server.credentials.admin_headers()
        httpx.post(f"{server.url}/admin/instances/{victim['instance_id']}/drain", headers=admin,
                   timeout=10).raise_for_status()
    else:
        kill_engine(victim["url"])
    outcomes = await load
    drained_s = await load_ended - killed_at
    # Give the health checks their few seconds, then see the rest of the service serve.
    await asyncio.sleep(6)
    follow_up = await burst(server.url, 8, scenario, seed=2)
    states = {i["instance_id"]: i["state"] for i in server.instances()}
    shards_after = store_shards(server.url)
    in_flight = [s.get("leases", 0) + s.get("reserved_bytes", 0) if "error" not in s else "gone"
                 for s in shards_after]
    if scenario.victim_role == "store":  # Ray restarts it: a new process, filled by the follow-up
        restart = {"store_restarted": [s.get("pid") for s in shards_after] != [shard["pid"]],
                   "store_chunks_after_follow_up": [s.get("chunks") for s in shards_after]}
    followed = tally(follow_up)
    if hit:
        hit["equal_to_no_fault"] = sum(o.text == n.text for o, n in zip(outcomes, no_fault, strict=True))
        hit["migrated"] = migrations(server) - migrations_before
    return {
        "scenario": scenario.name, "victim": victim["instance_id"], "sent": requests,
        "max_tokens": scenario.max_tokens, **tally(outcomes), **hit,
        "burst_end_after_kill_s": round(drained_s, 2),
        "follow_up_completed": followed["completed"], "follow_up_sent": len(follow_up),
        "follow_up_errors": followed["errors"],
        "instances_after": states, "store_in_flight_after": in_flight, **restart,
    }


async def run_two_routers(owner: LocalServer, other: LocalServer, front: str, scenario: Scenario,
                          requests: int) -> dict:
    """The burst through the balancer; the fleet's owner router SIGKILLed once half of it is open
    with tokens and the owner relays some of those; each cut stream sent again once (as a client
    retries); then new requests."""
    prompts = prompts_of(requests, scenario, seed=1)
    no_fault = await streams(front, prompts, scenario)
    blocks_before = index_blocks(other)
    live: list[RequestResult] = []
    load = asyncio.create_task(streams(front, prompts, scenario, live))
    hit = await streams_on_victim(owner, live, requests)
    owner.kill()
    outcomes = await load
    cut = [k for k, o in enumerate(outcomes) if o.kind != "completed"]
    retried = await streams(front, [prompts[k] for k in cut], scenario)
    for k, again in zip(cut, retried, strict=True):
        outcomes[k] = again
    follow_up = await burst(front, 8, scenario, seed=2)
    return {"scenario": scenario.name, "victim": "router (the fleet's owner)", "sent": requests,
            "max_tokens": scenario.max_tokens, **hit, "cut_by_kill": len(cut), **tally(outcomes),
            "equal_to_no_fault": sum(o.text == n.text for o, n in zip(outcomes, no_fault, strict=True)),
            "follow_up_completed": tally(follow_up)["completed"], "follow_up_sent": len(follow_up),
            "follow_up_errors": tally(follow_up)["errors"],
            "surviving_index_blocks": {"before": blocks_before, "after": index_blocks(other)}}


def two_routers_row(scenario: Scenario, requests: int) -> dict:
    with contextlib.ExitStack() as stack:
        head = stack.enter_context(RayHead())
        args = ["--model", "tiny", "--address", head.address, *scenario.serve_args]
        owner = stack.enter_context(LocalServer(args, Path("results") / f"faults-{scenario.name}-a.log"))
        other = stack.enter_context(LocalServer([*args, "--router-only"],
                                                Path("results") / f"faults-{scenario.name}-b.log"))
        front = stack.enter_context(balancer([owner.url, other.url], Path("results") / f"faults-{scenario.name}-nginx"))
        return asyncio.run(run_two_routers(owner, other, front, scenario, requests))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("results/faults.json"))
    args = parser.parse_args(argv)
    console = Console()
    rows = []
    for name in args.scenario or list(SCENARIOS):
        scenario = SCENARIOS[name]
        console.print(f"[bold]{name}[/]: starting pdcluster serve {' '.join(scenario.serve_args)}")
        try:
            rows.append(run_row(scenario, args.requests))
        except NoFaultHit as exc:  # an error, not a pass; the other scenarios still run
            rows.append({"scenario": name, "error": str(exc)})
        rows[-1]["missed_goals"] = missed_goals(scenario, rows[-1])
        console.print(rows[-1])
    console.print(table_of(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {args.out}")
    missed = [row["scenario"] for row in rows if row["missed_goals"]]
    if missed:
        console.print(f"[bold red]goals missed[/]: {', '.join(missed)}")
    return 1 if missed else 0


def run_row(scenario: Scenario, requests: int) -> dict:
    if scenario.victim_role == "router-of-two":
        return two_routers_row(scenario, requests)
    with contextlib.ExitStack() as stack:
        serve_args = ["--model", "tiny", *scenario.serve_args]
        if scenario.victim_role == "router":
            head = stack.enter_context(RayHead(resources={"prefill": 2, "decode": 2}))
            serve_args += ["--address", head.address]
        server = stack.enter_context(LocalServer(serve_args, Path("results") / f"faults-{scenario.name}.log"))
        return asyncio.run(run_scenario(server, scenario, requests))


def table_of(rows: list[dict]) -> Table:
    table = Table(title="faults: an engine, the store shard or a router SIGKILLed (or an engine drained) under load")
    columns = ("scenario", "sent", "streams_on_victim_at_kill", "tokens_each_victim_stream_had", "cut_by_kill",
               "migrated", "completed", "equal_to_no_fault", "failed_clean", "dropped", "hung", "follow_up",
               "store_in_flight_after", "missed_goals")
    for column in columns:
        table.add_column(column)
    for row in rows:
        cells = {**row, "follow_up": f"{row['follow_up_completed']}/{row['follow_up_sent']}" if "follow_up_sent" in row
                 else "-", "missed_goals": "; ".join(row["missed_goals"]) or "none"}
        tokens = row.get("tokens_each_victim_stream_had")
        if tokens:
            cells["tokens_each_victim_stream_had"] = f"{tokens[0]}-{tokens[-1]}"
        table.add_row(*(str(cells.get(c, "-")) for c in columns))
    return table


if __name__ == "__main__":
    raise SystemExit(main())
