"""What prefill and decode instances share: one vLLM engine per instance, built from a typed config
(`config`, with the role's record from `roles`), hosted by a Ray actor (`host`: the server
process, its API (`server_api`), what it prints (`server_output`), its start-up timeline, its
health, the engine token on every route via `http_auth`, KV events on the cluster's keys via
`kv_event_publisher`, a compile cache key alike across engines via `compile_key`, each CPU rank kept
on its own cores and waiting for work without spinning via `rank_cores`); the weight plane that
fills an engine from disk (`checkpoint`) or from a warm peer (`weights`, `cuda_ipc`,
`device_checksum`), inside the worker (`worker_extension`; `quantization`: which quantized
formats are served, and what their reload needs); a node's start caches, exported to and installed
from a peer (`node_caches`); the local model builders (`models`)."""
