"""The KV plane: the LMCache-backed vLLM KV connector, the store shards (one Ray actor per node
holding KV chunks in host memory), the UCX transport through NIXL, and block events for the
router's index. (Built with the P/D topology in its own issue.)"""
