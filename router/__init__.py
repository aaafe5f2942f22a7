"""The OpenAI-compatible HTTP front: validates requests, picks an instance (routing policies),
forwards to it and streams the answer back; health checks and Prometheus metrics."""
