"""The prefill pool: engine instances in the KV-producer role.

A prefill instance is an `engine.host.EngineHost` with `Role.PREFILL`, placed on nodes that
offer the Ray resource `prefill` (`deploy.launcher.placement_options`) and scaled by
`deploy.pool.PoolController`; the router's `router.disagg` sends it the prefill half of each
request, and its `kvstore.connector.StoreConnector` writes the prompt's KV to the store (or,
with `--kv-transfer direct`, vLLM's NixlConnector lets the decode side read it). What only this
pool needs beyond that belongs here.
"""
