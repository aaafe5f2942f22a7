"""The KV plane: the LMCache-backed vLLM KV connector, the store shards (one Ray actor per node
holding KV chunks in host memory), the UCX transport through NIXL, and the store's block events
for the router's index.

Not built yet: today KV moves prefill -> decode directly through vLLM's NixlConnector (see
docs/pd.md); the router's `KVIndex` already accepts store shards as holders.
"""
