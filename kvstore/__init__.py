"""The KV plane: KV chunks shared by every engine through a store, moved one-sided over UCX.

- `connector.StoreConnector`: vLLM's KV connector (loaded by `kv_connector_module_path`),
  driving LMCache's engine: LMCache chunks, hashes and looks up; we save whole blocks after a
  prefill and load them before a decode (`paged_blocks` copies them, on the CPU build and on
  CUDA); `lmcache_engine` builds both halves' engines.
- `lmcache_plugin`: the store as LMCache's remote storage plugin (errors are misses).
- `client.ShardedStore` / `ShardClient`: batched put/get/contains over all shards (rendezvous
  hashing), NIXL/UCX one-sided transfers, xxh3 checksums, timeouts.
- `shard`: one shard per node (a Ray actor): a registered host-memory arena in pages, LRU,
  leases and reservations that expire, damaged chunks dropped.
"""

# The `medium` of the BlockStored events the connector publishes (through its engine's KV event
# publisher) for prompt blocks it saved to the store: the router indexes them as the store's.
STORE_MEDIUM = "pdc_store"
