"""Who may talk to whom: the cluster's one secret and the keys derived from it (`credentials`),
and ZMQ sockets that admit only holders of the cluster's CURVE keys (`zmq_curve`). The engine
token guards every engine route (engine/http_auth.py); docs/security.md has the threat model."""
