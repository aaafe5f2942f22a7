"""Running a load: jobs from a workload, started by an arrival process, bounded by a request count
and a duration, measured by the streaming client, with the target's metrics scraped meanwhile.

Targets are loopback addresses only: a load test here never sends traffic elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import aiohttp
import httpx
from rich.progress import Progress

from engine.environment import is_loopback
from loadtest.arrivals import Arrival, FixedConcurrency, TraceTimes
from loadtest.scrape import scrape
from loadtest.sse_client import RequestResult, stream_request
from loadtest.workloads import Job


def check_target(url: str) -> str:
    host = urlparse(url).hostname or ""
    if not is_loopback(host):
        raise ValueError(f"load-test targets must be loopback addresses; {url} is not")
    return url.rstrip("/")


@dataclasses.dataclass
class LoadRun:
    results: list[RequestResult]
    samples: list[dict]
    """Scraped metrics over time: {"t": seconds, "engines": {url: {...}}, "router": {...}}."""
    started_at: float
    duration_s: float


@dataclasses.dataclass
class Limits:
    max_requests: int = 100
    duration_s: float = 600.0
    request_timeout_s: float = 120.0


class MetricsSampler:
    """Scrapes the target (a pdcluster router with its engines, or a plain vLLM server) every
    `interval_s`: the router's own metrics, each engine's prefix-cache counters and queue (an
    engine's through its router's relay, with the admin token)."""

    ENGINE_KEYS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                   "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:request_success_total",
                   "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count")

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.admin_headers = _admin_headers()

    def engine_sources(self) -> list[str]:
        """Where each engine's metrics are read (`scrape` appends /metrics)."""
        try:
            response = httpx.get(f"{self.url}/admin/instances", headers=self.admin_headers, timeout=5)
        except httpx.HTTPError:
            return [self.url]
        if response.status_code != 200:
            return [self.url]  # a plain vLLM server is its own engine
        instances = response.json()["instances"]
        relayed = [f"{self.url}/admin/engines/{i['instance_id']}" for i in instances]
        if instances and httpx.get(f"{relayed[0]}/metrics", headers=self.admin_headers, timeout=5).status_code == 404:
            return [i["url"] for i in instances]  # a router older than the relay: its engines answer anyone
        return relayed

    def sample(self, started: float) -> None:
        entry: dict = {"t": time.perf_counter() - started, "engines": {}, "router": {}}
        for source in self.engine_sources():
            try:
                values = scrape(source, self.ENGINE_KEYS, headers=self.admin_headers if source != self.url else None)
            except (httpx.HTTPError, ValueError):
                continue
            entry["engines"][source] = {k: values.get(k, 0.0) for k in self.ENGINE_KEYS}
        try:
            entry["router"] = scrape(self.url, ("pdcluster_router_",), headers=self.admin_headers)
        except (httpx.HTTPError, ValueError):
            pass
        self.samples.append(entry)

    async def run(self, started: float) -> None:
        """Samples every interval_s after the baseline, which the caller takes before any load."""
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.to_thread(self.sample, started)


def _admin_headers() -> dict[str, str]:
    """The admin credential of a pdcluster on this machine (its secret in the environment or its
    file); none for a plain vLLM server or a cluster elsewhere."""
    from security.credentials import ClusterCredentials, CredentialsError

    try:
        credentials = ClusterCredentials.load()
    except (CredentialsError, OSError):
        return {}
    return credentials.admin_headers()


async def run_job(client: aiohttp.ClientSession, url: str, job: Job, timeout_s: float) -> list[RequestResult]:
    """One job: a request, or a session's turns in order, each turn carrying the history."""
    headers = {"Authorization": f"Bearer {job.api_key}"} if job.api_key else None
    if not job.turns:
        return [await _bounded(client, f"{url}{job.endpoint}", job.body, timeout_s, headers)]
    results, messages = [], list(job.body.get("messages", []))
    for turn, question in enumerate(job.turns):
        messages = [*messages, {"role": "user", "content": question}]
        result = await _bounded(client, f"{url}{job.endpoint}", {**job.body, "messages": messages}, timeout_s,
                                headers)
        result.turn = turn
        results.append(result)
        if not result.ok:
            break
        messages = [*messages, {"role": "assistant", "content": result.text}]
    return results


async def _bounded(client: aiohttp.ClientSession, url: str, body: dict, timeout_s: float,
                   headers: dict[str, str] | None = None) -> RequestResult:
    try:
        async with asyncio.timeout(timeout_s):
            return await stream_request(client, url, body, headers=headers)
    except TimeoutError:
        return RequestResult(started_at=time.time(), error="timeout")


async def run_load(
    url: str, jobs: Iterator[Job], arrival: Arrival, limits: Limits, progress: Progress | None = None,
    scrape_interval_s: float = 1.0,
) -> LoadRun:
    url = check_target(url)
    sampler = MetricsSampler(url, scrape_interval_s)
    # The baseline first, before the clock starts: taken beside the load, a short run could end
    # before its first scrape (then the counters' deltas are all zero), and taken after the clock
    # started it delays the arrivals due at 0 s (a CI run saw a trace's first request 0.2 s late).
    await asyncio.to_thread(sampler.sample, time.perf_counter())  # its t is 0
    started, started_at = time.perf_counter(), time.time()
    deadline = started + limits.duration_s
    results: list[RequestResult] = []
    task = progress.add_task(f"{arrival.name} load", total=limits.max_requests) if progress else None

    def record(batch: list[RequestResult]) -> None:
        results.extend(batch)
        if progress is not None and task is not None:
            progress.advance(task, len(batch))

    timeout = aiohttp.ClientTimeout(total=limits.request_timeout_s, connect=10.0)
    sampling = asyncio.create_task(sampler.run(started))
    try:
        connector = aiohttp.TCPConnector(limit=2048)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
            if isinstance(arrival, FixedConcurrency):
                await _closed_loop(client, url, jobs, arrival.concurrency, limits, deadline, record)
            else:
                await _open_loop(client, url, jobs, arrival, limits, started, deadline, record)
        duration = time.perf_counter() - started
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await asyncio.to_thread(sampler.sample, started)  # the final state
    return LoadRun(results, sampler.samples, started_at, duration)


async def _open_loop(client, url, jobs, arrival, limits, started, deadline, record) -> None:
    times = None if isinstance(arrival, TraceTimes) else arrival.start_times()
    running: set[asyncio.Task] = set()
    sent = 0
    for job in jobs:
        at = job.arrival_s if times is None else next(times)
        if at is None:
            raise ValueError("the trace arrival process needs a workload with arrival times (mooncake)")
        if sent >= limits.max_requests or started + at > deadline:
            break
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        task = asyncio.create_task(run_job(client, url, job, limits.request_timeout_s))
        task.add_done_callback(lambda t: record(t.result()))
        running.add(task)
        task.add_done_callback(running.discard)
        sent += max(1, len(job.turns))
    if running:
        await asyncio.wait(running)


async def _closed_loop(client, url, jobs, concurrency, limits, deadline, record) -> None:
    state = {"sent": 0}

    async def worker() -> None:
        while state["sent"] < limits.max_requests and time.perf_counter() < deadline:
            job = next(jobs, None)
            if job is None:
                return
            state["sent"] += max(1, len(job.turns))
            record(await run_job(client, url, job, limits.request_timeout_s))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
