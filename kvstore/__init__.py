"""The KV plane: KV chunks shared by every engine through a store, moved one-sided over UCX.

- `connector.StoreConnector`: vLLM's KV connector (loaded by `kv_connector_module_path`), the
  half of its role: `store_scheduler.StoreScheduler` (lookups, the plan of loads and saves, what
  the router is told) or `store_worker.StoreWorker` (the copies, whole blocks through
  `paged_blocks` on the CPU build and on CUDA), over `connector_types`; `lmcache_engine` builds
  LMCache's engine for either half.
- `lmcache_plugin`: the store as LMCache's remote storage plugin (errors are misses).
- `sharded_store.ShardedStore` / `shard_client.ShardClient`: batched put/get/contains over all
  shards (rendezvous hashing), NIXL/UCX one-sided transfers, xxh3 checksums, timeouts;
  `shard_control`: its control messages (asked again on a new connection where harmless);
  `stranded_reads`: reads past their deadline, whose memory is kept until they end.
- `shard`: one shard per node (a Ray actor): a registered host-memory arena (`chunk_store`: pages,
  LRU, leases and reservations that expire), typed control messages (`messages`) on a CURVE
  socket only the cluster's members reach.
"""

# The `medium` of the BlockStored events the connector publishes (through its engine's KV event
# publisher) for prompt blocks it saved to the store: the router indexes them as the store's.
STORE_MEDIUM = "pdc_store"
