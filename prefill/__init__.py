"""The prefill pool's own code: its role (`role.PREFILL`: Ray resource, vLLM flags, a KV
producer that no client streams from) and the prefill half of a disaggregated request
(`handoff`: the one-token request, the typed `KVHandoff` the decode instance gets, the hop that
runs it, books it on its instance and keeps that instance's circuit). The router's placement step
(router/placement.py) decides when a request goes through here; the engine itself is engine/'s
`EngineHost`.
"""
