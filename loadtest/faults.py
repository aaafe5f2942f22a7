"""Fault injection with real processes and signals: what a crash costs the clients.

    python -m loadtest.faults [--requests 24] [--scenario NAME ...]

Each scenario starts its own `pdcluster serve` (tiny model), sends a burst of concurrent greedy
streams, SIGKILLs one engine's whole process group (vLLM server, engine core, worker) or the KV
store shard's process while they run, then sends a follow-up batch to see the service recover;
P/D scenarios also report what the store still holds in flight afterwards (leases, reserved
bytes: both must be back at 0). Every request is classified:
completed (all its tokens), failed clean (an OpenAI-style HTTP error or an error event closing
the stream), dropped (connection cut or stream ended short) or hung (no end within the client's
timeout; must be 0). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import httpx
import psutil
from rich.console import Console
from rich.table import Table

from deploy.local import LocalServer
from loadtest.client import stream_request
from loadtest.workloads import random_text

HANG_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    serve_args: tuple[str, ...]
    victim_role: str
    kill_after_s: float
    prompt_words: int
    max_tokens: int


SCENARIOS = {
    "prefill-killed-mid-transfer": Scenario(
        "prefill-killed-mid-transfer",
        ("--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"),
        "prefill", 1.0, 400, 16,
    ),
    "decode-killed-mid-stream": Scenario(
        "decode-killed-mid-stream",
        ("--prefill", "1", "--decode", "2", "--remote-prefill-min-tokens", "0"),
        "decode", 3.0, 40, 128,
    ),
    "store-shard-killed": Scenario(
        "store-shard-killed",
        ("--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"),
        "store", 1.0, 400, 16,
    ),
    "colocated-killed-mid-stream": Scenario(
        "colocated-killed-mid-stream", ("--instances", "2"), "colocated", 1.0, 40, 512,
    ),
}  # fmt: skip


def kill_engine(url: str) -> None:
    """SIGKILL the engine serving `url` as a lost machine would: the process listening on its
    port and the whole process group around it (server, engine core, worker, guard)."""
    port = urlparse(url).port
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    os.killpg(os.getpgid(pid), signal.SIGKILL)


def classify(result, max_tokens: int) -> str:
    if result.error == "timeout":
        return "hung"
    if result.error in ("stream",) or (result.error or "").startswith("http_"):
        return "failed_clean"
    if result.error or result.output_tokens != max_tokens:
        return "dropped"
    return "completed"


async def burst(url: str, count: int, scenario: Scenario, seed: int) -> list[str]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=None, connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one() -> str:
            body = {"model": "tiny", "prompt": random_text(rng, scenario.prompt_words),
                    "max_tokens": scenario.max_tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
            try:
                async with asyncio.timeout(HANG_TIMEOUT_S):
                    result = await stream_request(session, f"{url}/v1/completions", body)
            except TimeoutError:
                return "hung"
            return classify(result, scenario.max_tokens)

        return await asyncio.gather(*(one() for _ in range(count)))


def store_shards(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/store", timeout=10).json()["shards"]


async def run_scenario(server: LocalServer, scenario: Scenario, requests: int) -> dict:
    if scenario.victim_role == "store":
        (shard,) = store_shards(server.url)
        victim = {"instance_id": f"store shard (pid {shard['pid']})"}
    else:
        victim = [i for i in server.instances() if i["role"] == scenario.victim_role][0]
    load = asyncio.create_task(burst(server.url, requests, scenario, seed=1))
    await asyncio.sleep(scenario.kill_after_s)
    killed_at = time.monotonic()
    if scenario.victim_role == "store":
        os.kill(shard["pid"], signal.SIGKILL)
    else:
        kill_engine(victim["url"])
    outcomes = await load
    drained_s = time.monotonic() - killed_at
    # Give the health checks their few seconds, then see the rest of the service serve.
    await asyncio.sleep(6)
    follow_up = await burst(server.url, 8, scenario, seed=2)
    states = {i["instance_id"]: i["state"] for i in server.instances()}
    in_flight = [s.get("leases", 0) + s.get("reserved_bytes", 0) if "error" not in s else "gone"
                 for s in store_shards(server.url)]  # fmt: skip
    return {
        "scenario": scenario.name, "victim": victim["instance_id"], "sent": requests,
        **{k: outcomes.count(k) for k in ("completed", "failed_clean", "dropped", "hung")},
        "burst_end_after_kill_s": round(drained_s, 2),
        "follow_up_completed": follow_up.count("completed"), "follow_up_sent": len(follow_up),
        "instances_after": states, "store_in_flight_after": in_flight,
    }  # fmt: skip


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
        log = Path("results") / f"faults-{name}.log"
        with LocalServer(["--model", "tiny", *scenario.serve_args], log) as server:
            rows.append(asyncio.run(run_scenario(server, scenario, args.requests)))
        console.print(rows[-1])
    rows.append(
        {"scenario": "router-restarted", "note": "not run: engines are owned by the router's process today"}
    )
    table = Table(title="faults: one engine or the store shard SIGKILLed under load")
    columns = ("scenario", "sent", "completed", "failed_clean", "dropped", "hung", "follow_up_completed",
               "store_in_flight_after")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for row in rows:
        if "note" in row:
            table.add_row(row["scenario"], row["note"], *[""] * (len(columns) - 2))
        else:
            table.add_row(*(str(row[c]) if c != "follow_up_completed" else f"{row[c]}/{row['follow_up_sent']}"
                            for c in columns))  # fmt: skip
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    console.print(f"wrote {args.out}")
    return 0 if all(row.get("hung", 0) == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
