"""Who may talk to whom: the cluster's one secret and every key derived from it
(`credentials`). transport/zmq_curve.py admits only holders of the CURVE keys; the engine token
guards every engine route (engine/http_auth.py). docs/security.md has the threat model."""
