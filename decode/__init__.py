"""The decode pool's own code: its role (`role.DECODE`: Ray resource, vLLM flags, a KV consumer
that streams the answer to the client and prefills itself when the router's placement says so).
The stream itself is the router's (router/proxy.py); the engine is engine/'s `EngineHost`.
"""
