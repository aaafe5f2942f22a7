"""A tenant's time to first token through the router, quiet and while an attack runs, in one
run: clients sending the largest prompts a body may hold (docs/security.md, attack 5), or a
stranger's idle flood (attack 11.1, loadtest/idle_flood.py). `loadtest.router_overhead
--attackers/--idle-flood` reports it; tests/e2e/test_openai_api.py runs the huge-prompt attack."""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import statistics
import time
import urllib.parse
from collections.abc import Callable, Iterator

import httpx

from loadtest.idle_flood import IdleFlood
from router.metrics import percentile


def timed_stream(client: httpx.Client, base_url: str, body: dict) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one streamed completion."""
    started = time.perf_counter()
    first = None
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return first if first is not None else float("nan"), time.perf_counter() - started


def _attacker(router_url: str, model: str, stop, results) -> None:
    """One attacking client: 130k-character chat prompts until `stop`; its answers by status."""
    huge = {"model": model, "messages": [{"role": "user", "content": "word " * 26_000}]}
    answers: collections.Counter = collections.Counter()
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            answers[client.post(f"{router_url}/v1/chat/completions", json=huge).status_code] += 1
    results.put(dict(answers))


@contextlib.contextmanager
def huge_prompt_attack(router_url: str, model: str, attackers: int) -> Iterator[collections.Counter]:
    """`attackers` processes sending the router 130k-character chat prompts until the block ends
    (processes: threads would share the measuring client's GIL, and encoding a 130 kB body holds
    it for milliseconds, which the measurement then counted against the router); yields the count
    of their answers by HTTP status, filled when the block ends."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    processes = [context.Process(target=_attacker, args=(router_url, model, stop, results), daemon=True)
                 for _ in range(attackers)]
    for process in processes:
        process.start()
    answers: collections.Counter = collections.Counter()
    try:
        time.sleep(3.0)  # the attack under way before the first measured request
        yield answers
    finally:
        stop.set()
        for _ in processes:
            answers.update(results.get(timeout=120))
        for process in processes:
            process.join(30)


@contextlib.contextmanager
def idle_flood_attack(router_url: str, connections: int) -> Iterator[collections.Counter]:
    """`connections` idle half-sent requests held at the router while the block runs (reopened as
    it closes them); yields the flood's counts (loadtest/idle_flood.py), filled at the end."""
    address = urllib.parse.urlsplit(router_url)
    with IdleFlood(address.hostname, address.port, connections) as flood:
        yield flood.counts


def _fresh_health(router_url: str) -> float:
    """Seconds for `/health` on a connection of its own (a newcomer's, as a load balancer's
    probe); infinity when it fails or takes past 10 s."""
    started = time.perf_counter()
    try:
        httpx.get(f"{router_url}/health", timeout=10).raise_for_status()
    except httpx.HTTPError:
        return float("inf")
    return time.perf_counter() - started


def attacked_ttft(router_url: str, model: str, rounds: int,
                  attack: Callable[[], contextlib.AbstractContextManager[collections.Counter]]) -> dict:
    """The router's time to first token (a tenant's kept-alive connection) and, every tenth
    round, `/health` on a new connection, quiet and while `attack()` runs, same run."""
    body = {"model": model, "prompt": "A short question?", "max_tokens": 1, "stream": True}
    samples: dict[str, dict[str, list[float]]] = {}
    with httpx.Client(timeout=60) as client:
        for _ in range(5):
            timed_stream(client, router_url, body)
        for name, phase in (("quiet", lambda: contextlib.nullcontext(collections.Counter())), ("attacked", attack)):
            samples[name] = {"ttft": [], "health": []}
            with phase() as answers:
                for round_ in range(rounds):
                    samples[name]["ttft"].append(timed_stream(client, router_url, body)[0])
                    if round_ % 10 == 0:
                        samples[name]["health"].append(_fresh_health(router_url))
    return {
        **{name: {"median_ms": statistics.median(v["ttft"]) * 1e3, "p90_ms": percentile(v["ttft"], 90) * 1e3,
                  "p99_ms": percentile(v["ttft"], 99) * 1e3, "health_max_ms": max(v["health"]) * 1e3,
                  "health_failed": sum(h == float("inf") for h in v["health"])}
           for name, v in samples.items()},
        "attack_answers": {str(status): count for status, count in sorted(answers.items())},
    }


def summarize_attacks(attacks: list[dict]) -> dict:
    """Medians over runs of each phase's statistics, their ratios, and the 2x goal on p99."""
    stats = ("median_ms", "p90_ms", "p99_ms", "health_max_ms")
    summary = {phase: {stat: statistics.median(a[phase][stat] for a in attacks) for stat in stats}
               for phase in ("quiet", "attacked")}
    summary["ratio"] = {stat: summary["attacked"][stat] / summary["quiet"][stat] for stat in stats}
    summary["p99_within_2x"] = summary["ratio"]["p99_ms"] <= 2
    summary["health_failed"] = sum(a["attacked"]["health_failed"] for a in attacks)
    return summary
