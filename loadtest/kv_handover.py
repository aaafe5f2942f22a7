"""A prompt's KV moved from one engine's memory to another's, timed alone (`loadtest.engine_profile`
calls it; issue #37's hand-over profile).

  direct  one device -> device copy of the bytes (on one GPU the lower bound of vLLM's
          NixlConnector, whose cuda_ipc reads between a node's GPUs do no better; on the CPU
          build a memory copy)
  store   device -> pinned host memory, `ShardClient.put` of 256-token chunks to a real store shard
          (ours, in a child process, NIXL over UCX), `ShardClient.get` into other host memory,
          host -> device: the path our StoreConnector's whole-block copies take

Each path's seconds are medians of `repeats`; the store's parts are given too.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence

from loadtest.store_bench import KEYS, serve_shard

CHUNK_TOKENS = 256  # LMCache's chunk, the store's unit


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - started


def _store_round_trip(client, tokens: int, size: int, chunk: int, buffers: tuple, sync: Callable[[], None],
                      repeat: int) -> dict[str, float]:
    """One hand-over of `size` bytes each way (direct, and the store's four legs), timed."""
    source, destination, host_out, host_in = buffers
    offsets = list(range(0, size, chunk))
    keys = [f"handover-{tokens}-{repeat}-{i}" for i in range(len(offsets))]
    payloads = [host_out[o : o + chunk][: size - o].numpy() for o in offsets]
    slots = iter(offsets)

    def allocate(nbytes: int):
        view = host_in[next(slots) :][:nbytes].numpy()
        return view, view

    return {
        "direct": _timed(lambda: destination[:size].copy_(source[:size]), sync),
        "d2h": _timed(lambda: host_out[:size].copy_(source[:size]), sync),
        "put": _timed(lambda: client.put(keys, payloads), sync),
        "get": _timed(lambda: client.get(keys, allocate), sync),
        "h2d": _timed(lambda: destination[:size].copy_(host_in[:size]), sync),
    }


def measure_handover(token_counts: Sequence[int], kv_bytes_per_token: int, repeats: int) -> list[dict]:
    import torch

    from kvstore.shard_client import ShardClient

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    largest = max(token_counts) * kv_bytes_per_token
    context = mp.get_context("spawn")
    endpoints = context.Queue()
    shard = context.Process(target=serve_shard, args=(3 * largest, KEYS, endpoints), daemon=True)
    shard.start()
    client = None
    try:
        client = ShardClient(endpoints.get(timeout=120), KEYS, timeout_s=60.0,
                             staging_bytes=CHUNK_TOKENS * kv_bytes_per_token)
        source = torch.randint(0, 255, (largest,), dtype=torch.uint8, device=device)
        destination = torch.empty_like(source)
        host_out, host_in = (torch.empty(largest, dtype=torch.uint8, pin_memory=cuda) for _ in range(2))
        for buffer in (host_out, host_in):
            client.register_caller_memory(buffer.data_ptr(), buffer.nbytes)
        chunk = CHUNK_TOKENS * kv_bytes_per_token
        rows = []
        for tokens in token_counts:
            size = tokens * kv_bytes_per_token
            runs = [_store_round_trip(client, tokens, size, chunk, (source, destination, host_out, host_in), sync, r)
                    for r in range(repeats)]
            if not torch.equal(destination[:size].cpu(), source[:size].cpu()):
                raise RuntimeError(f"the KV of {tokens} tokens came back changed through the store")
            medians = {f"{name}_s": statistics.median(run[name] for run in runs) for name in runs[0]}
            store = statistics.median(sum(run[p] for p in ("d2h", "put", "get", "h2d")) for run in runs)
            rows.append({"tokens": tokens, "bytes": size, **medians, "store_s": store})
        return rows
    finally:
        if client is not None:
            client.close()
        shard.terminate()
        shard.join(10)
