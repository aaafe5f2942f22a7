"""The decode pool: engine instances in the KV-consumer role, streaming the tokens.

Today a decode instance is an `engine.host.EngineHost` with `Role.DECODE` (vLLM's NixlConnector
reading the prefill's KV blocks over UCX), placed on nodes that offer the Ray resource `decode`
(`deploy.launcher.placement_options`). What the pool needs beyond that (its scaling controller,
its reads from the KV store) belongs here.
"""
