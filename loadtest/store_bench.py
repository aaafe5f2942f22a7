"""KV transfer throughput through the store against raw NIXL between the same two processes.

    python -m loadtest.store_bench [--chunk-kib 512,5760] [--chunks 64] [--runs 5]

A store shard runs in a child process; this process is the client. For each chunk size (the
defaults are one 256-token chunk of the tiny model and of SmolLM2), in the same run:
  raw_read    - one NIXL READ of the chunks' bytes straight from the shard's arena into a
                registered buffer of ours (the extents come from a lease; nothing else)
  store_get   - ShardClient.get: lease, the same READ in 4 MiB pieces straight into the caller's
                registered memory (as into LMCache's memory objects), xxh3 check per chunk
                while later pieces fly, release
  raw_write   - one NIXL WRITE of the same bytes into pages the shard reserved
  store_put   - ShardClient.put: checksums, reserve, the same WRITE straight from the caller's
                registered memory, commit
The raw and store paths of a direction take turns in every run. Medians of --runs; "vs raw" is
the median over runs of raw seconds / store seconds in the same run (goal >= 0.8).
Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np

from engine.environment import UCX_LOOPBACK_ENV
from kvstore import messages
from kvstore.shard_client import ShardClient
from kvstore.shard_control import request_once
from security.credentials import ClusterCredentials, CurveKeys
from transport.nixl import add_peer, new_agent, transfer
from transport.zmq_curve import STORE_PLANE

KEYS = ClusterCredentials.generate().curve(STORE_PLANE)  # this bench's own cluster


def serve_shard(capacity: int, keys: CurveKeys, endpoint_queue) -> None:
    from kvstore.shard import ShardServer

    server = ShardServer(capacity, keys, ttl_s=60.0)
    endpoint_queue.put(server.endpoint)
    time.sleep(3600)  # the parent terminates us


def alternated(paths: dict, runs: int) -> dict[str, list[float]]:
    """Seconds per run of each path, the paths taking turns within every run, so that a raw row
    and its store row see the same state of this noisy machine."""
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for run in range(runs):
        for name, fn in paths.items():
            started = time.perf_counter()
            fn(run)
            seconds[name].append(time.perf_counter() - started)
    return seconds


def measure(endpoint: str, chunk_bytes: int, chunks: int, runs: int) -> dict[str, list[float]]:
    client = ShardClient(endpoint, KEYS, timeout_s=30.0, staging_bytes=chunk_bytes * chunks)
    raw_agent = new_agent("pdc-bench")
    buffer = np.zeros(chunk_bytes * chunks, dtype=np.uint8)
    registration = raw_agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    peer = add_peer(raw_agent, request_once(endpoint, messages.Hello(), 10, KEYS)["agent"])
    rng = np.random.default_rng(0)
    # Payloads and destinations stand for LMCache's buffer of memory objects, registered with the
    # client as the plugin registers it.
    source = rng.integers(0, 256, chunk_bytes * chunks, dtype=np.uint8)
    payloads = [source[i * chunk_bytes :][:chunk_bytes] for i in range(chunks)]
    destination = np.empty_like(buffer)
    for memory in (source, destination):
        client.register_caller_memory(memory.ctypes.data, memory.nbytes)
    local = [(buffer.ctypes.data + i * chunk_bytes, chunk_bytes) for i in range(chunks)]
    try:
        keys = [f"bench-{chunk_bytes}-{i}" for i in range(chunks)]
        client.put(keys, payloads)
        lease = request_once(endpoint, messages.Lease(keys), 10, KEYS)
        remote = [tuple(e) for c in lease["chunks"] for e in c["extents"]]

        def raw_read(_: int) -> None:
            transfer(raw_agent, "READ", local, remote, peer, 30.0)

        def store_get(_: int) -> None:
            slots = iter(range(chunks))

            def allocate(nbytes: int):
                view = destination[next(slots) * chunk_bytes :][:nbytes]
                return view, view

            assert len(client.get(keys, allocate)) == chunks

        results = alternated({"raw_read": raw_read, "store_get": store_get}, runs)
        request_once(endpoint, messages.Release(lease["lease"]), 10, KEYS)

        def fresh_keys(run: int, kind: str) -> list[str]:
            return [f"bench-{kind}-{chunk_bytes}-{run}-{i}" for i in range(chunks)]

        def raw_write(run: int) -> None:
            reserve = messages.Reserve(fresh_keys(run, "raw"), [chunk_bytes] * chunks, [0] * chunks)
            reply = request_once(endpoint, reserve, 10, KEYS)
            transfer(raw_agent, "WRITE", local, [tuple(e) for c in reply["extents"] for e in c], peer, 30.0)

        def store_put(run: int) -> None:
            assert client.put(fresh_keys(run, "store"), payloads) == chunks

        return results | alternated({"raw_write": raw_write, "store_put": store_put}, runs)
    finally:
        raw_agent.remove_remote_agent(peer)
        raw_agent.deregister_memory(registration)
        client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunk-kib", default="512,5760")
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/store_bench.json"))
    args = parser.parse_args(argv)
    os.environ.update(UCX_LOOPBACK_ENV)
    sizes = [int(k) * 1024 for k in args.chunk_kib.split(",")]
    capacity = 3 * max(sizes) * args.chunks * (args.runs + 1)
    context = mp.get_context("spawn")
    endpoints = context.Queue()
    shard = context.Process(target=serve_shard, args=(capacity, KEYS, endpoints), daemon=True)
    shard.start()
    try:
        endpoint = endpoints.get(timeout=60)
        table = {size: measure(endpoint, size, args.chunks, args.runs) for size in sizes}
    finally:
        shard.terminate()
        shard.join(10)
    rows = []
    print(
        f"\n{args.chunks} chunks per transfer, medians of {args.runs} runs, UCX_TLS={os.environ['UCX_TLS']}"
    )
    print(f"{'chunk':>9s} {'path':10s} {'seconds':>9s} {'GiB/s':>7s} {'vs raw':>7s}")
    for size, samples in table.items():
        gib = size * args.chunks / 1024**3
        median = {name: statistics.median(v) for name, v in samples.items()}
        for name, seconds in median.items():
            raw = samples["raw_read" if name.endswith(("read", "get")) else "raw_write"]
            vs_raw = statistics.median(r / s for r, s in zip(raw, samples[name], strict=True))
            rows.append({"chunk_bytes": size, "path": name, "median_s": seconds, "gib_s": gib / seconds,
                         "vs_raw": vs_raw, "samples_s": samples[name]})
            print(f"{size // 1024:>6d} KiB {name:10s} {seconds:9.4f} {gib / seconds:7.2f} {vs_raw:7.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"chunks": args.chunks, "runs": args.runs, "rows": rows}, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["chunk_bytes"] for r in rows})
    paths = ["raw_read", "store_get", "raw_write", "store_put"]
    figure, axis = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(paths)
    for k, name in enumerate(paths):
        values = [
            next(r["gib_s"] for r in rows if r["chunk_bytes"] == s and r["path"] == name) for s in sizes
        ]
        axis.bar([i + k * width for i in range(len(sizes))], values, width, label=name)
    axis.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(sizes))], [f"{s // 1024} KiB chunks" for s in sizes]
    )
    axis.set_ylabel("GiB/s")
    axis.set_title("KV through the store vs raw NIXL (same two processes)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
