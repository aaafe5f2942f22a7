"""The decode pool: engine instances in the KV-consumer role, streaming the tokens.

A decode instance is an `engine.host.EngineHost` with `Role.DECODE`, placed on nodes that offer
the Ray resource `decode` (`deploy.launcher.placement_options`) and scaled by
`deploy.pool.PoolController`; its `kvstore.connector.StoreConnector` loads the prompt's KV from
the store before it decodes (or, with `--kv-transfer direct`, vLLM's NixlConnector reads the
prefill's blocks over UCX). What only this pool needs beyond that belongs here.
"""
