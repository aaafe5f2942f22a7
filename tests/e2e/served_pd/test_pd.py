"""Prefill/decode disaggregation on real CPU engines, KV handed over through the LMCache-backed
store shard: plain vLLM's tokens, KV really moved (vLLM counts it), damaged chunks rejected,
aborted streams strand no store memory, a killed prefill costs no request. (Ad-hoc prompts are
compared with the session's colocated engine, itself checked against plain vLLM.)"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import signal
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest
from fastapi.testclient import TestClient
from oracle import assert_conforms
from stranger import StrangerProcess, needs_stranger

from decode.role import DECODE
from fleet.instances import Instance, InstanceRegistry
from kvstore import messages
from kvstore.shard_control import request_once
from loadtest.arrivals import FixedConcurrency
from loadtest.fault_probes import kill_engine
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.scrape import scrape, scrape_engine
from loadtest.workloads import RandomLengths
from prefill.role import PREFILL
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.engine_access import EngineAccess
from transport.zmq_curve import STORE_PLANE

pytestmark = [pytest.mark.slow, pytest.mark.oracles("tiny")]
LONG = " ".join(f"line {k}: the quick brown fox jumps over the lazy dog." for k in range(60))


def generate(to: str | EngineAccess, body: dict, max_tokens: int = 16) -> list[int]:
    """Greedy token ids from a router (its URL) or straight from an engine (its access)."""
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    full = {"model": "tiny", **body, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    engine = {"headers": to.headers, "verify": to.ssl} if isinstance(to, EngineAccess) else {}
    url = to.url if isinstance(to, EngineAccess) else to
    response = httpx.post(f"{url}{endpoint}", json=full, timeout=120, **engine)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def engine(server, role: str) -> EngineAccess:
    """The access to the server's one engine of `role`."""
    (instance,) = [i for i in server.instances() if i["role"] == role]
    return server.engine_access(instance["instance_id"])


def test_pd_through_the_store_answers_as_plain_vllm(served_pd, oracle):
    """Plain vLLM's answers, every one of them through a remote prefill (the threshold is 0): a
    run whose prefills all fell back to the decode instance would answer the same, and fail here."""
    admin = served_pd.credentials.admin_headers()

    def remote_prefills() -> float:
        return scrape(served_pd.url, ("pdcluster_router_prefills",), headers=admin,
                      labels={"where": "remote"}).get("pdcluster_router_prefills_total", 0.0)

    before = remote_prefills()
    assert_conforms(served_pd.url, "tiny", oracle("tiny"))
    assert remote_prefills() - before == 2 * len(oracle("tiny"))  # every prompt, asked twice, prefilled remotely


def test_decode_counts_the_transferred_kv_as_external_prefix_hits(served_pd):
    decode, admin = engine(served_pd, "decode"), served_pd.credentials.admin_headers()
    before, router_before = scrape_engine(decode), scrape(served_pd.url, ("pdcluster_",), headers=admin)
    prompt = "A fresh prompt nobody sent before. " + LONG
    generate(served_pd.url, {"prompt": prompt}, max_tokens=4)
    after, router_after = scrape_engine(decode), scrape(served_pd.url, ("pdcluster_",), headers=admin)
    delta = {name: after[name] - before.get(name, 0.0) for name in after if after[name] != before.get(name)}
    delta |= {name: v - router_before.get(name, 0.0) for name, v in router_after.items()
              if v != router_before.get(name)}
    shown = "\n".join(f"{name} {value:g}" for name, value in sorted(delta.items()))
    hits = delta["vllm:external_prefix_cache_hits_total"]
    prompt_tokens = delta["vllm:prompt_tokens_total"]
    assert prompt_tokens > 500, shown
    assert hits >= prompt_tokens - 32, shown  # all full blocks came from the prefill instance
    assert delta["pdcluster_router_remote_prefill_seconds_count"] == 1, shown  # prefilled remotely

    # The prefill's connector tells the router (through vLLM's KV events) what the store now holds.
    def store_blocks() -> int:
        body = {"model": "tiny", "prompt": prompt}
        explained = httpx.post(f"{served_pd.url}/admin/explain", json=body, headers=admin, timeout=30).json()
        return explained["matched_blocks"].get("kv-store", 0)

    deadline = time.monotonic() + 10
    while store_blocks() < (prompt_tokens - 32) // 32:
        assert time.monotonic() < deadline, store_blocks()
        time.sleep(0.2)


def test_a_load_report_splits_off_the_remote_prefill_part_of_ttft(served_pd):
    """The router times each remote prefill; a load run's summary reports them beside TTFT (what
    loadtest.pd_bench shows per topology)."""
    jobs = RandomLengths(input_tokens=300, output_tokens=4, seed=5).jobs("tiny")
    run = asyncio.run(
        run_load(served_pd.url, jobs, FixedConcurrency(2), Limits(max_requests=4), scrape_interval_s=0.5)
    )
    summary = summarize(run, slo_ttft_s=5, slo_tpot_s=1)
    assert summary["completed"] == 4, summary["errors"]
    assert summary["remote_prefills"]["count"] == 4  # threshold 0: every request prefilled remotely
    assert 0 < summary["remote_prefills"]["mean_ms"] < summary["ttft"]["mean_ms"]  # a part of TTFT


def store_shard(server) -> dict:
    (shard,) = httpx.get(f"{server.url}/admin/store", headers=server.credentials.admin_headers(),
                         timeout=10).json()["shards"]
    return shard


def test_damaged_chunks_are_rejected_by_checksum_and_recomputed(served, served_pd):
    prompt = "Damaged in the store. " + LONG
    generate(engine(served_pd, "prefill"), {"prompt": prompt}, max_tokens=1)  # stores its KV
    before = store_shard(served_pd)
    assert before["chunks"] > 0
    keys = served_pd.credentials.curve(STORE_PLANE)
    damaged = request_once(before["endpoint"], messages.Corrupt(before["chunks"]), 5.0, keys)
    assert damaged["damaged"] == before["chunks"]
    # Straight to the decode instance: its connector finds the prompt in the store and reads it.
    got = generate(engine(served_pd, "decode"), {"prompt": prompt})
    after = store_shard(served_pd)
    assert after["rejected"] > before["rejected"]  # the checksum caught it, the shard dropped it
    assert got == generate(served.url, {"prompt": prompt})  # vLLM recomputed: no damaged KV used


async def test_aborted_streams_strand_no_store_memory(served_pd):
    baseline = store_shard(served_pd)

    async def one(client: httpx.AsyncClient, k: int) -> None:
        body = {"model": "tiny", "prompt": f"Burst {k}. " + LONG[: 300 + 97 * k], "max_tokens": 48,
                "temperature": 0, "stream": True}
        async with client.stream("POST", f"{served_pd.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                if k % 2:  # every other client walks away after the first chunk
                    break

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(one(client, k) for k in range(10)))
    deadline = time.monotonic() + 15
    while (now := store_shard(served_pd))["leases"] or now["reserved_bytes"]:
        assert time.monotonic() < deadline, f"store memory still in flight: {now}"
        await asyncio.sleep(0.5)
    assert (
        (now["leases"], now["reserved_bytes"]) == (baseline["leases"], baseline["reserved_bytes"]) == (0, 0)
    )
    assert now["chunks"] > baseline["chunks"]  # the burst's prompts were stored...
    assert (
        now["used_bytes"] - baseline["used_bytes"]
        < (now["stored_bytes"] - baseline["stored_bytes"]) + (now["chunks"] - baseline["chunks"]) * 64 * 1024
    )  # ...and hold no pages beyond their own (at most one partial page each)


def test_a_killed_store_shard_comes_back_on_its_endpoint_and_hands_kv_over_again(served, served_pd):
    before = store_shard(served_pd)
    os.kill(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 90
    while (now := store_shard(served_pd)).get("pid") in (None, before["pid"]):  # Ray restarts it
        assert time.monotonic() < deadline, now
        time.sleep(0.5)
    assert now["endpoint"] == before["endpoint"] and now["chunks"] == 0
    # The engines' store clients find the new shard (after at most a timeout and a pause): a new
    # prompt is stored by the prefill instance and loaded by the decode instance again.
    decode = engine(served_pd, "decode")
    for attempt in itertools.count():
        body = {"prompt": f"After the shard came back, try {attempt}. " + LONG}
        hits = scrape_engine(decode)["vllm:external_prefix_cache_hits_total"]
        assert generate(served_pd.url, body) == generate(served.url, body)
        if scrape_engine(decode)["vllm:external_prefix_cache_hits_total"] > hits:
            break
        assert time.monotonic() < deadline + 60, "the decode instance never loaded from the new shard"
        time.sleep(1)
    assert store_shard(served_pd)["chunks"] > 0


def test_one_tenants_store_chunks_are_invisible_to_another(served_pd):
    """Tenant salts (as the router sets them) are part of every store key: tenant B's identical
    prompt finds none of tenant A's chunks (a miss, its KV recomputed), while A's own second
    request loads them (docs/security.md, attack 3; LMCache#4825 is this bug elsewhere)."""
    credentials = served_pd.credentials
    decode = engine(served_pd, "decode")
    prompt = f"A tenant's private prompt {time.time()}. " + LONG
    salt_a, salt_b = credentials.tenant_salt("tenant-a"), credentials.tenant_salt("tenant-b")

    def external_hits(salt: str) -> float:
        before = scrape_engine(decode, ("vllm:external_prefix_cache_hits",))
        generate(decode, {"prompt": prompt, "cache_salt": salt}, max_tokens=1)
        after = scrape_engine(decode, ("vllm:external_prefix_cache_hits",))
        return after["vllm:external_prefix_cache_hits_total"] - before.get("vllm:external_prefix_cache_hits_total", 0)

    # tenant A's prefill: its chunks go to the store
    generate(engine(served_pd, "prefill"), {"prompt": prompt, "cache_salt": salt_a}, max_tokens=1)
    assert external_hits(salt_b) == 0
    assert external_hits(salt_a) > 500


def test_through_the_router_one_tenants_store_chunks_are_invisible_to_another(served_pd, tiny_model):
    """Attack 3 as tenants make it: two API keys on a router in front of this module's P/D engines
    and store shard (docs/security.md). Tenant A's request is prefilled remotely: its chunks go to
    the store, and the decode instance loads them. Then, the decode instance's own cache emptied,
    tenant B's identical prompt goes to the decode instance with no remote prefill (as when no
    prefill instance is ready), which looks the prompt up in the store itself: it loads none of
    A's chunks, while A's second request, the same way, loads them. (In a remote prefill the
    decode instance loads what the prefill instance just stored for that same request, B's own
    chunks too: its counter tells nothing there.) The routers are the app `pdcluster serve`
    builds (router/app.py), run here so that the fixture's own, keyless router stays as this
    module's other tests use it; no engine more is started. Times are reported, not asserted."""
    credentials = served_pd.credentials
    instances = {i["role"]: i for i in served_pd.instances()}
    decode = served_pd.engine_access(instances["decode"]["instance_id"])
    body = {"model": "tiny", "prompt": f"Tenant A's private prompt {uuid.uuid4()}. " + LONG, "max_tokens": 1,
            "temperature": 0}
    names = ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")

    def router(*roles) -> TestClient:
        registry = InstanceRegistry()
        for role in roles:
            listed = instances[role.name]
            access = served_pd.engine_access(listed["instance_id"])
            registry.add(Instance(listed["instance_id"], role, access.url, model="tiny", access=access))
        config = RouterConfig(models=(ServedModel(name="tiny", max_model_len=4096, tokenizer=tiny_model),),
                              api_keys={"key-a": "tenant-a", "key-b": "tenant-b"}, remote_prefill_min_tokens=0,
                              cluster_secret=credentials.secret.hex(), health_interval_s=60)
        return TestClient(build_app(config, registry, store_endpoints=(store_shard(served_pd)["endpoint"],)))

    def sent(client: TestClient, key: str) -> tuple[float, float, float]:
        """One request of `key`'s tenant: the decode instance's hits from the store (its
        connector) and from its own cache, and the seconds to the answer (one token)."""
        before = scrape_engine(decode, names)
        started = time.perf_counter()
        response = client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        seconds = time.perf_counter() - started
        assert response.status_code == 200, response.text
        after = scrape_engine(decode, names)
        external, own = (after.get(n, 0.0) - before.get(n, 0.0) for n in names)
        return external, own, seconds

    with router(PREFILL, DECODE) as pd, router(DECODE) as decode_only:
        a_external, _, a_first_s = sent(pd, "key-a")
        assert a_external > 500, f"A's first request: {a_external:g} tokens from the store (a remote prefill)"
        deadline = time.monotonic() + 30  # refused while blocks are held (a request just finishing)
        while not httpx.post(f"{decode.url}/reset_prefix_cache", headers=decode.headers, verify=decode.ssl,
                             timeout=10).json()["success"]:
            assert time.monotonic() < deadline, "the decode instance's prefix cache was never reset"
            time.sleep(0.2)
        b_external, b_own, b_s = sent(decode_only, "key-b")
        a_again_external, a_again_own, a_again_s = sent(decode_only, "key-a")
    timing = (f"answers of one token: A's first {a_first_s * 1e3:.0f} ms (remote prefill), B's {b_s * 1e3:.0f} ms "
              f"(computed), A's second {a_again_s * 1e3:.0f} ms (loaded); not asserted")
    assert (b_external, b_own) == (0, 0), f"B: {b_external:g} tokens from the store, {b_own:g} cached; {timing}"
    assert a_again_external > 500, f"A again: {a_again_external:g} from the store, {a_again_own:g} cached; {timing}"


WATCHER = """
import os, select, socket, sys, time
seen, taken, engine_ports = set(), [], set()
victim, held, received, accepted = ARGS["victim_port"], None, b"", 0
print("ready", flush=True)
ends = time.monotonic() + ARGS["seconds"]
while time.monotonic() < ends and not select.select([sys.stdin], [], [], 0)[0]:
    for pid in os.listdir("/proc"):  # every new engine process: try to take its port first
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if b"engine.preimport" in argv and b"--port" in argv and pid not in seen:
            seen.add(pid)
            port = int(argv[argv.index(b"--port") + 1])
            engine_ports.add(port)
            try:
                socket.create_server(("127.0.0.1", port)).close()
                taken.append(port)
            except OSError:
                pass
    if held is None:  # the dead engine's port: take it, and keep what its callers send
        try:
            held = socket.create_server(("127.0.0.1", victim))
            held.settimeout(0.005)
        except OSError:
            pass
    else:
        try:
            connection, _ = held.accept()
            accepted += 1
            connection.settimeout(0.5)
            try:
                while chunk := connection.recv(65536):
                    received += chunk
                    connection.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\n{}")
            except OSError:
                pass
            connection.close()
        except OSError:
            pass
    time.sleep(0.005)
print(json.dumps({"engine_ports": sorted(engine_ports), "taken": taken, "victim_taken": held is not None,
                  "accepted": accepted, "received": received.decode("latin-1")}))
"""


@needs_stranger
def test_a_killed_prefill_costs_no_request_and_its_port_betrays_nothing(served, served_pd):
    """Runs last in this module: it kills the prefill instance. Its actor, which held the one
    `prefill` resource of this head, is reaped, and the pool starts a replacement there. Attacks
    12.1 and 12.2 as they ran live, by another local user watching /proc: the replacement
    engine's port, read off its command line, cannot be bound first (its host bound it before the
    process existed); the dead engine's port, taken at once, gets TLS greetings and nothing else."""
    bodies = [{"prompt": f"Killed prefill {k}. " + LONG * 2} for k in range(4)]
    expected = [generate(served.url, b) for b in bodies]
    victim = engine(served_pd, "prefill")
    watcher = StrangerProcess(WATCHER, {"victim_port": urlparse(victim.url).port, "seconds": 400})
    watcher.ready()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, served_pd.url, b) for b in bodies]
        time.sleep(0.05)
        kill_engine(victim.url)
        results = [f.result(timeout=120) for f in futures]  # none hangs, none fails
    assert results == expected
    after = [generate(served_pd.url, b) for b in bodies[:1]]  # and the next one prefills locally
    assert after == expected[:1]
    deadline = time.monotonic() + 240
    while not [i for i in served_pd.instances() if i["role"] == "prefill" and i["state"] == "ready"]:
        assert time.monotonic() < deadline, served_pd.instances()
        time.sleep(1)
    watcher.tell("stop")
    seen = watcher.result()
    replacement = urlparse(engine(served_pd, "prefill").url).port
    assert replacement in seen["engine_ports"] and seen["taken"] == [], seen
    for secret in ("Killed prefill", victim.token, "authorization", "Bearer"):
        assert secret not in seen["received"]
