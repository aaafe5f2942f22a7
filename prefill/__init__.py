"""The prefill pool: engine instances in the KV-producer role.

Today a prefill instance is an `engine.host.EngineHost` with `Role.PREFILL` (vLLM's
NixlConnector, the decode side reading its KV blocks), placed on nodes that offer the Ray
resource `prefill` (`deploy.launcher.placement_options`); the router's `router.disagg` sends it
the prefill half of each request. What the pool needs beyond that (its scaling controller, its
writes to the KV store) belongs here.
"""
