"""What prefill and decode instances share: one vLLM engine per instance, built from a typed
config, hosted by a Ray actor, with its lifecycle (standby, loading, warming, ready, draining),
its start-up timeline and its health. Also the local model builders (`pdcluster model`)."""
