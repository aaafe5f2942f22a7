"""The store shard's bookkeeping (pages, LRU, leases, expiry) and a real round trip through its
control socket and NIXL/UCX on loopback."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore import messages
from kvstore.chunk_store import ChunkStore
from kvstore.shard import PROBE_BYTES, ShardServer
from kvstore.shard_client import ShardClient
from security.credentials import ClusterCredentials
from transport.zmq_curve import STORE_PLANE

PAGE = 1024
CREDENTIALS = ClusterCredentials.generate()
KEYS = CREDENTIALS.curve(STORE_PLANE)


def test_lru_evicts_the_oldest_unleased_chunk_and_never_a_leased_one():
    store = ChunkStore(4 * PAGE, PAGE, max_chunk_bytes=4 * PAGE)
    for key in "abcd":
        assert store.reserve(key, PAGE, 0, now=0, ttl_s=10) is not None
        assert store.commit(key)
    lease, chunks = store.lease(["a"], now=0, ttl_s=10)  # a is read: pinned and most recent
    assert len(chunks) == 1
    assert store.reserve("e", 2 * PAGE, 0, now=0, ttl_s=10) is not None  # evicts b and c
    assert store.commit("e")
    assert [store.contains([k]) for k in "abcde"] == [1, 0, 0, 1, 1]
    assert store.reserve("f", 4 * PAGE, 0, now=0, ttl_s=10) is None  # a is leased: no room
    store.release(lease)
    assert store.reserve("f", 4 * PAGE, 0, now=0, ttl_s=10) is not None


def test_readers_that_never_release_cannot_pin_the_shard_forever(monkeypatch):
    """A flood of leases is capped (the next reader is refused, nothing grows), expires with
    its TTL, and one reader cannot guess another's lease to release it."""
    monkeypatch.setattr("kvstore.chunk_store.MAX_LEASES", 3)
    store = ChunkStore(4 * PAGE, PAGE, max_chunk_bytes=4 * PAGE)
    store.reserve("a", PAGE, 0, now=0, ttl_s=10)
    store.commit("a")
    held = [store.lease(["a"], now=0, ttl_s=10) for _ in range(3)]
    assert None not in held and store.lease(["a"], now=0, ttl_s=10) is None
    ids = [lease_id for lease_id, _ in held]
    assert len(set(ids)) == 3 and all(abs(a - b) > 1 for a in ids for b in ids if a != b)
    store.expire(now=11)
    assert store.stats().leases == 0 and store.lease(["a"], now=11, ttl_s=10) is not None


def test_a_vanished_writer_or_reader_strands_nothing():
    store = ChunkStore(8 * PAGE, PAGE, max_chunk_bytes=8 * PAGE)
    baseline = store.stats()
    store.reserve("written", 3 * PAGE, 0, now=0, ttl_s=5)
    store.commit("written")
    store.reserve("never-committed", 2 * PAGE + 1, 0, now=0, ttl_s=5)
    store.lease(["written"], now=0, ttl_s=5)  # a reader that never releases
    assert store.stats().reserved_bytes == 3 * PAGE and store.stats().leases == 1
    store.expire(now=6)
    after = store.stats()
    assert (after.reserved_bytes, after.leases, after.chunks) == (0, 0, 1)
    assert after.used_bytes == baseline.used_bytes + 3 * PAGE  # only the stored chunk's pages
    assert store.reserve("big", 5 * PAGE, 0, now=7, ttl_s=5) is not None  # all other pages are free


def test_contains_counts_the_stored_prefix_only():
    store = ChunkStore(8 * PAGE, PAGE)
    for key in ["k0", "k1", "k3"]:
        store.reserve(key, 10, 0, now=0, ttl_s=5)
        store.commit(key)
    store.reserve("k2", 10, 0, now=0, ttl_s=5)  # reserved, not committed
    assert store.contains(["k0", "k1", "k2", "k3"]) == 2


@pytest.fixture(scope="module")
def shard():
    server = ShardServer(8 * 1024**2, CREDENTIALS.shard_keys().store, ttl_s=5.0, page_bytes=64 * 1024)  # as a shard actor's
    yield server
    server.close()


async def test_a_shard_actor_is_given_its_keys_never_the_secret(monkeypatch):
    """What the launcher hands a shard's actor (kept in Ray's GCS with it): keys that serve the
    store plane and answer the adoption proof, not the cluster's secret or a client's key."""
    import pickle

    from rich.console import Console

    from deploy.store_shards import StoreShards

    async def one_shard(self, timeout_s, engine_nodes):
        return ("tcp://127.0.0.1:1",)

    monkeypatch.setattr(StoreShards, "reconcile", one_shard)
    monkeypatch.setattr("deploy.store_shards._all_nodes", lambda: [])
    shards = StoreShards(CREDENTIALS, Console(quiet=True), engine_nodes=None)
    await shards.start(1024**2)
    arguments = pickle.dumps(shards._options)
    for secret in (CREDENTIALS.secret, CREDENTIALS.secret.hex().encode(), KEYS.client_secret):
        assert secret not in arguments
    keys = shards._options["keys"]
    assert keys.prove("nonce") == CREDENTIALS.prove("store-shard", "nonce") != CREDENTIALS.prove("engine", "nonce")
    assert (keys.store.server_secret, keys.store.client_public) == (KEYS.server_secret, KEYS.client_public)


def hellos_to(server: ShardServer, monkeypatch) -> list[dict]:
    """The "hello" messages (a client fetching the shard's NIXL agent) the shard answers from now
    on: a spy on the real shard's handler."""
    seen, handle = [], server.handle

    def counting(request) -> dict:
        if isinstance(request, messages.Hello):
            seen.append(request)
        return handle(request)

    monkeypatch.setattr(server, "handle", counting)
    return seen


def test_chunks_round_trip_through_nixl_bit_identical_and_damage_is_a_miss(shard, monkeypatch):
    client = ShardClient(shard.endpoint, KEYS, timeout_s=5.0, staging_bytes=1024**2)
    hellos = hellos_to(shard, monkeypatch)
    try:
        rng = np.random.default_rng(0)
        payloads = [rng.integers(0, 256, size, dtype=np.uint8) for size in (300_000, 200_000, 1000, 700_000)]
        keys = [f"chunk{i}" for i in range(len(payloads))]  # staging holds 1 MiB: two transfers
        assert client.put(keys, payloads) == 4
        assert client.put(keys[:1], payloads[:1]) == 0  # already stored
        assert client.contains(keys + ["missing"]) == 4
        got = client.get(keys + ["missing"])
        assert [g.tobytes() for g in got] == [p.tobytes() for p in payloads]
        assert shard.corrupt(1) == 1  # the first stored chunk
        assert client.get(keys) == [] and client.rejected == 1
        # The damaged chunk is dropped, so a writer can store it afresh. (Asked on the client's
        # own socket: the shard reads the release the get sent before this question.)
        stats = client.stats()
        assert [stats[k] for k in ("leases", "reserved_bytes", "chunks", "rejected")] == [0, 0, 3, 1]
        assert client.put(keys[:1], payloads[:1]) == 1
        assert [g.tobytes() for g in client.get(keys)] == [p.tobytes() for p in payloads]
        # The client met the shard's NIXL agent when it was made; a transfer that fetched it again
        # (NIXL names a loaded peer in bytes, the shard itself in str) cost a round trip and a
        # metadata load every time: store reads of 512 KiB chunks took 1.6x as long.
        assert hellos == []
    finally:
        client.close()


def test_a_commit_whose_answer_is_lost_is_asked_again_and_the_write_counts(shard, monkeypatch):
    """A fault loopback does not cause at will (a mock, named so: the shard's answer dropped):
    the shard commits a write but its answer never reaches the writer (issue #34's stall). The
    writer asks again on a new connection after half its timeout; the write counts, and reads."""
    lost, serve_one = [], shard._serve_one

    def losing_the_first_commits_answer(frames: list[bytes]) -> None:
        if not lost and len(frames) == 3 and isinstance(request := messages.decode(frames[2]), messages.Commit):
            lost.append(shard.handle(request))  # committed here; the answer goes nowhere
            return
        serve_one(frames)

    monkeypatch.setattr(shard, "_serve_one", losing_the_first_commits_answer)
    client = ShardClient(shard.endpoint, KEYS, timeout_s=2.0, staging_bytes=1024**2)
    payload = np.arange(50_000, dtype=np.uint32).view(np.uint8)
    try:
        started = time.monotonic()
        assert client.put(["k"], [payload]) == 1
        assert [a["committed"] for a in lost] == [1] and time.monotonic() - started < 2.0
        assert [g.tobytes() for g in client.get(["k"])] == [payload.tobytes()]
    finally:
        client.close()


def test_a_client_sets_up_its_transfers_with_the_shard_when_it_is_made(shard, monkeypatch):
    """Its first read is of the shard's probe area (zeros, no one's KV), at once: UCX's wire-up is
    paid there, not by a request's first read (issue #34)."""
    from transport.nixl import PostedTransfer

    reads, init = [], PostedTransfer.__init__
    monkeypatch.setattr(PostedTransfer, "__init__", lambda read, agent, op, local, remote, peer: (
        reads.append((op, sum(n for _, n in remote))), init(read, agent, op, local, remote, peer))[1])
    client = ShardClient(shard.endpoint, KEYS, timeout_s=5.0, staging_bytes=1024**2)
    try:
        assert reads == [("READ", PROBE_BYTES)]
    finally:
        client.close()


def stall_reads(monkeypatch) -> threading.Event:
    """A stand-in (named so) for a UCX read that does not end by its deadline, which loopback does
    not cause at will: every READ reports itself in flight until the returned event is set."""
    from transport.nixl import PostedTransfer

    release, done = threading.Event(), PostedTransfer.done
    monkeypatch.setattr(PostedTransfer, "done", lambda read: (read.op != "READ" or release.is_set()) and done(read))
    return release


def test_a_read_still_in_flight_past_its_deadline_keeps_its_memory_until_it_ends(shard, monkeypatch):
    """UCX does not cancel a posted read: memory it may still land in is not reused (the staging
    buffer is retired, the caller told to wait) until the client has seen it end."""
    from kvstore.shard_client import ReadInFlight

    client = ShardClient(shard.endpoint, KEYS, timeout_s=0.5, staging_bytes=1024**2)
    payload = np.arange(60_000, dtype=np.uint32).view(np.uint8)
    try:
        assert client.put(["stalled"], [payload]) == 1
        release, staging = stall_reads(monkeypatch), client.staging
        with pytest.raises(ReadInFlight) as stranded:
            client.get(["stalled"])
        assert not stranded.value.ended.done() and client.staging is not staging  # landing there: retired
        assert client.put(["after"], [payload[::-1].copy()]) == 1  # writes go on, through the new buffer
        assert not stranded.value.ended.done()
        release.set()
        assert [g.tobytes() for g in client.get(["stalled"])] == [payload.tobytes()]
        assert stranded.value.ended.done()  # seen to end on the next call: the caller may free its memory
    finally:
        client.close()


def test_a_shard_slower_than_half_the_timeout_is_still_heard_on_the_first_connection(shard, monkeypatch):
    """Every answer 0.6 of the timeout late (a loaded shard; a stand-in delays its handler, named
    so): the request asked again after half the timeout does not lose the first one's answer."""
    client = ShardClient(shard.endpoint, KEYS, timeout_s=1.0, staging_bytes=64 * 1024)
    handle, handled = shard.handle, []

    def slow(request):
        if isinstance(request, messages.Contains):
            time.sleep(0.6)
            handled.append(request)
        return handle(request)

    monkeypatch.setattr(shard, "handle", slow)
    try:
        started = time.monotonic()
        assert client.contains(["nothing-here"]) == 0
        assert time.monotonic() - started < 1.0
        deadline = time.monotonic() + 5  # the request asked again is answered too (to no one)
        while len(handled) < 2:
            assert time.monotonic() < deadline, handled
            time.sleep(0.05)
    finally:
        client.close()


def test_a_shard_that_stops_answering_costs_one_timeout_then_fails_fast():
    import time

    from kvstore.shard_control import StoreUnavailable

    server = ShardServer(1024**2, KEYS, page_bytes=64 * 1024)
    client = ShardClient(server.endpoint, KEYS, timeout_s=0.5, staging_bytes=64 * 1024, retry_after_s=30)
    try:
        server.close()  # the shard goes away under a connected client
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            client.contains(["k"])
        assert 0.4 < time.monotonic() - started < 2
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            client.contains(["k"])
        assert time.monotonic() - started < 0.4  # no second wait (of 0.5 s): a miss at once
    finally:
        client.close()


def test_a_shard_restarted_on_its_port_is_used_again_by_its_clients(monkeypatch):
    """A restarted shard (new process: new NIXL agent, empty arena) on the same endpoint: at most
    a timeout and a pause, then its clients read and write it as before."""
    from kvstore.shard_control import StoreUnavailable

    first = ShardServer(1024**2, KEYS, page_bytes=64 * 1024)
    client = ShardClient(first.endpoint, KEYS, timeout_s=1.0, staging_bytes=512 * 1024, retry_after_s=0.2)
    payload = np.arange(100_000, dtype=np.uint32).view(np.uint8)[:300_000]
    second = None
    try:
        assert client.put(["before"], [payload]) == 1
        first.close()
        second = ShardServer(1024**2, KEYS, page_bytes=64 * 1024, port=first.port)
        hellos = hellos_to(second, monkeypatch)
        deadline = time.monotonic() + 10
        while True:  # the first call may time out on the connection to the dead shard
            try:
                assert client.get(["before"]) == []  # the new shard is empty: a miss
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        assert client.put(["after"], [payload]) == 1
        assert [g.tobytes() for g in client.get(["after"])] == [payload.tobytes()]
        assert second.stats().chunks == 1
        assert len(hellos) == 1  # its new NIXL agent learned once
    finally:
        client.close()
        (second or first).close()


def test_an_unreachable_shard_is_a_clean_error_within_the_timeout():
    from kvstore.shard_control import StoreUnavailable

    with pytest.raises(StoreUnavailable):
        ShardClient("tcp://127.0.0.1:9", KEYS, timeout_s=0.5)


def test_keys_spread_over_shards_and_read_back_in_prefix_order():
    from kvstore.settings import StoreSettings
    from kvstore.sharded_store import ShardedStore

    servers = [ShardServer(4 * 1024**2, KEYS, page_bytes=64 * 1024) for _ in range(2)]
    store = ShardedStore(StoreSettings(tuple(s.endpoint for s in servers), timeout_s=5.0), KEYS, staging_bytes=1024**2)
    try:
        keys = [f"prefix-chunk-{i}" for i in range(12)]
        payloads = [np.full(10_000 + i, i, dtype=np.uint8) for i in range(12)]
        assert store.put(keys, payloads) == 12
        assert all(s.stats().chunks > 0 for s in servers)  # both shards hold some
        assert [g.tobytes() for g in store.get(keys)] == [p.tobytes() for p in payloads]
        assert store.contains(keys[:5] + ["never-stored"] + keys[5:]) == 5
    finally:
        store.close()
        for server in servers:
            server.close()


def test_clients_follow_the_shard_list_when_a_shard_joins_or_leaves():
    """A client started when the store had one shard learns from that shard's replies that the
    launcher added a second one (a node joined), spreads new chunks over both and reads them
    back; then follows a list without the first (its node left)."""
    from kvstore.settings import StoreSettings
    from kvstore.sharded_store import ShardedStore

    first, second = (ShardServer(4 * 1024**2, KEYS, page_bytes=64 * 1024) for _ in range(2))
    store = ShardedStore(StoreSettings((first.endpoint,), timeout_s=5.0), KEYS, staging_bytes=1024**2)
    try:
        keys = [f"after-join-{i}" for i in range(16)]
        payloads = [np.full(9_000 + i, i, dtype=np.uint8) for i in range(16)]
        first.set_members([first.endpoint, second.endpoint], epoch=1)
        first.set_members([first.endpoint], epoch=1)  # not newer: ignored
        assert store.contains(keys) == 0  # its reply announces epoch 1
        assert store.put(keys, payloads) == 16  # followed before this call
        assert store.members_epoch == 1 and sorted(store.shards) == sorted([first.endpoint, second.endpoint])
        assert first.stats().chunks > 0 and second.stats().chunks > 0
        assert [g.tobytes() for g in store.get(keys)] == [p.tobytes() for p in payloads]

        second.set_members([second.endpoint], epoch=2)
        assert store.contains(keys) == 16  # each key found on its owner; the second announces epoch 2
        found = store.contains(keys)  # followed first: one shard, holding only its own share
        assert store.members_epoch == 2 and list(store.shards) == [second.endpoint]
        assert found < 16 and len(store.get(keys)) == found
    finally:
        store.close()
        first.close()
        second.close()


def test_an_idle_nixl_agent_does_not_spin_a_core():
    """NIXL's Python API would start UCX's progress thread polling without pause (a core per
    agent, idle or not); ours wait for events."""
    from transport.nixl import new_agent

    agent = new_agent("pdc-idle")
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.5  # spinning: ~1.0
    del agent
