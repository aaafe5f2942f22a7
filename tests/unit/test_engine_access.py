"""An engine proves it is ours before it gets a credential, a prompt or a salt (docs/security.md,
attacks 12.x): endpoints are sealed under the instance's key, engine processes serve TLS with a
certificate of their own, a token opens one engine process only; and a listener that is not the
engine (a local user who took the port: the stranger, another user of this machine) gets nothing
but a TLS greeting. Stand-in engines (named so; no vLLM) served as engines are."""

from __future__ import annotations

import dataclasses
import socket

import pytest
from fastapi.testclient import TestClient
from stranger import StrangerProcess, needs_stranger

from engine.environment import listening_socket
from fleet.instances import Instance, InstanceRegistry
from loadtest.engine_standin import AppStandIn, StandInIdentity
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccessRefused

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
SECRET_PROMPT = "the tenant's confidential prompt 7f3a"


def test_only_the_instances_host_can_seal_its_endpoint():
    genuine = StandInIdentity("decode-0", 20001, CREDENTIALS).endpoint
    assert CREDENTIALS.engine_access(genuine).url == genuine.url
    other_cluster = StandInIdentity("decode-0", 20001, ClusterCredentials.generate()).endpoint
    other_instance = dataclasses.replace(StandInIdentity("decode-1", 20001, CREDENTIALS).endpoint,
                                         instance_id="decode-0")
    impostor_certificate = StandInIdentity("decode-0", 20001, ClusterCredentials.generate()).endpoint.certificate
    for forged in (other_cluster, other_instance, dataclasses.replace(genuine, url="https://127.0.0.1:20002"),
                   dataclasses.replace(genuine, certificate=impostor_certificate),
                   dataclasses.replace(genuine, nonce="0" * 32), dataclasses.replace(genuine, seal="0" * 64)):
        with pytest.raises(EngineAccessRefused):
            CREDENTIALS.engine_access(forged)


def test_a_token_opens_one_engine_process_only():
    """Per instance and per start: a token stolen from one process opens neither another
    instance nor the next process of the same instance."""
    first, restarted, other = (StandInIdentity(name, 20001, CREDENTIALS).access
                               for name in ("decode-0", "decode-0", "decode-1"))
    assert len({first.token, restarted.token, other.token}) == 3


def test_the_hosts_socket_cannot_be_taken_by_another_user():
    """The engine's port is bound (and listening) by its host before the engine process exists:
    a local user watching for new engine processes can no longer bind it first."""
    listener = listening_socket("127.0.0.1")
    try:
        with socket.socket() as other:
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", listener.getsockname()[1]))
    finally:
        listener.close()


RECORDER = '''
import socket, threading, time
server = socket.create_server(("127.0.0.1", ARGS["port"]))
server.settimeout(0.2)
received, accepted, ends = b"", 0, time.monotonic() + 60
print("ready", flush=True)
while time.monotonic() < ends:  # until 3 s after its first caller, 60 s at most
    try:
        connection, _ = server.accept()
    except socket.timeout:
        continue
    accepted += 1
    ends = min(ends, time.monotonic() + 3)
    connection.settimeout(1)
    try:
        while chunk := connection.recv(65536):
            received += chunk
            # a TLS handshake's first flight answered with garbage: a client that sends the token in
            # the clear would send it now
            connection.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\n{}")
    except OSError:
        pass
    connection.close()
print(json.dumps({"accepted": accepted, "received": received.decode("latin-1")}))
'''


@pytest.mark.slow  # a process or engine of its own: ~3 s
@needs_stranger
def test_a_listener_on_a_dead_engines_port_gets_no_token_prompt_or_salt():
    """Attack 12.2 as it ran live: the engine at an instance's address is gone and another local
    user listens there. The router's request to it fails its TLS handshake (the listener cannot
    show that engine process's certificate), the instance leaves rotation, and the request is
    served by the other instance; the listener received a TLS greeting and nothing else."""
    spare = listening_socket("127.0.0.1")
    port = spare.getsockname()[1]
    spare.close()  # the port the dead engine served on, free for anyone to take
    taken = StrangerProcess(RECORDER, {"port": port})
    taken.ready()

    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"choices": [{"index": 0, "text": "ok"}]}'})

    dead = StandInIdentity("colocated-0", port, CREDENTIALS)
    with AppStandIn(answer, "colocated-1", CREDENTIALS) as alive:
        registry = InstanceRegistry()
        victim = dead.instance()
        registry.add(victim)
        registry.add(alive.instance())
        config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), policy="round_robin",
                              api_keys={"key-a": "tenant-a"}, health_interval_s=60,
                              cluster_secret=CREDENTIALS.secret.hex())
        with TestClient(build_app(config, registry)) as router:
            for _ in range(2):  # round robin: one of them goes to the dead engine's address first
                response = router.post("/v1/completions", json={"model": "m", "prompt": SECRET_PROMPT},
                                       headers={"authorization": "Bearer key-a"})
                assert response.status_code == 200, response.text
    got = taken.result()
    assert got["accepted"] >= 1  # the router did knock
    for secret in (SECRET_PROMPT, dead.access.token, alive.access.token, CREDENTIALS.tenant_salt("tenant-a"),
                   "Bearer", "authorization"):
        assert secret not in got["received"]
    assert victim.state.value == "failed"  # out of rotation until a health check passes


def test_an_instance_registered_without_a_sealed_endpoint_is_never_sent_to():
    registry = InstanceRegistry()
    registry.add(Instance("colocated-0", StandInIdentity("c", 1).instance().role, "https://127.0.0.1:1", model="m"))
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), health_interval_s=60, queue_timeout_s=0)
    with TestClient(build_app(config, registry), raise_server_exceptions=False) as router:
        assert router.post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code >= 500
