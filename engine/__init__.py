"""What prefill and decode instances share: one vLLM engine per instance, built from a typed
config, hosted by a Ray actor, with its lifecycle (standby, loading, warming, ready, draining),
its start-up timeline and its health; the weight plane that fills an engine from disk or from a
warm peer (`weights`, `device_weights`, `worker_extension`); the local model builders."""
