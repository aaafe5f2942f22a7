"""Stand-ins for an engine (named as such: no vLLM runs), served as our engines are: TLS with a
fresh identity sealed under the instance's key (security/engine_access.py), the guarded listener,
the engine token checked on every route. For the router's tests and its overhead benchmark,
which need an engine's behaviour without an engine's cost.

- `AppStandIn(app)`: an ASGI app (a fixed SSE answer, a health switch) under uvicorn, in a thread;
- `SocketStandIn("crash" | "hang")`: reads a request over TLS, then drops the connection (an engine
  that crashed on it) or never answers (a hung one);
- `unreachable_instance()`: an instance whose port nothing listens on (a refused connection).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import uvicorn

from engine.environment import free_port, listening_socket
from engine.http_auth import EngineAuthMiddleware
from engine.lifecycle import EngineDescription, InstanceState
from engine.role_spec import COLOCATED, Role, RoleSpec
from fleet.instances import Instance
from security.credentials import ClusterCredentials, EngineKeys, bearer_matches
from security.engine_access import EngineAccess, EngineEndpoint, EngineIdentity, open_endpoint
from transport.listener_guard import ListenerLimits, guarded_protocol

HOST = "127.0.0.1"


class StandInIdentity:
    """An engine process's identity and endpoint as its host makes them, for instance `instance_id`
    of `credentials` (a secret of its own if not given)."""

    def __init__(self, instance_id: str, port: int, credentials: ClusterCredentials | None = None) -> None:
        self.instance_id = instance_id
        host_keys = (credentials or ClusterCredentials.generate()).engine_host_keys(instance_id)
        self.keys: EngineKeys = host_keys.new_process(HOST)
        self.endpoint: EngineEndpoint = host_keys.endpoint(self.keys, f"https://{HOST}:{port}")
        self.access: EngineAccess = open_endpoint(host_keys.engine_key, self.endpoint)

    @property
    def identity(self) -> EngineIdentity:
        return self.keys.identity

    @property
    def url(self) -> str:
        return self.endpoint.url

    def instance(self, role: RoleSpec = COLOCATED, state: InstanceState = InstanceState.READY,
                 model: str = "m") -> Instance:
        """The router's record of this stand-in."""
        return Instance(self.instance_id, role, self.url, state, model=model, access=self.access)

    def description(self, **fields) -> EngineDescription:
        """What an engine host would tell of this stand-in (a ready colocated engine of model
        "m" at /models/m unless `fields` say otherwise)."""
        described = {"instance_id": self.instance_id, "role": Role.COLOCATED, "model": "/models/m",
                     "served_model_name": "m", "max_model_len": 128, "state": InstanceState.READY, "url": self.url,
                     "endpoint": self.endpoint, "kv_events_endpoint": None, "kv_events_replay_endpoint": None,
                     "pid": 1, "exited": False, "last_stage": "api_server", "elapsed_s": 1.0}
        return EngineDescription(**{**described, **fields})


def unreachable_instance(instance_id: str = "dead-0", role: RoleSpec = COLOCATED) -> Instance:
    """An instance whose port nothing listens on: a real refused connection."""
    return StandInIdentity(instance_id, free_port(HOST)).instance(role)


class AppStandIn(StandInIdentity):
    """`app` (ASGI) served as an engine serves, in a thread of this process, until `stop()`
    (or the `with` block ends)."""

    def __init__(self, app, instance_id: str = "standin-0", credentials: ClusterCredentials | None = None,
                 limits: ListenerLimits | None = None) -> None:
        self._listener = listening_socket(HOST)
        super().__init__(instance_id, self._listener.getsockname()[1], credentials)
        token = self.keys.engine_token

        def proves(headers: list[tuple[bytes, bytes]]) -> bool:
            authorization = next((value for name, value in headers if name == b"authorization"), b"")
            return bearer_matches(authorization.decode("latin-1"), token)

        self.protocol = guarded_protocol(f"standin-{instance_id}", limits or ListenerLimits.for_engine(),
                                         tls=self.identity.server_context(), proves=proves)
        config = uvicorn.Config(EngineAuthMiddleware(app, token), http=self.protocol, log_level="error",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._listener]}, daemon=True)

    def start(self) -> AppStandIn:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._listener.close()

    def __enter__(self) -> AppStandIn:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


class SocketStandIn(StandInIdentity):
    """Reads each request (over TLS, as the router sends it), then drops the connection ("crash")
    or holds it unanswered ("hang"); counts the POSTs (the router's health checks are GETs)."""

    def __init__(self, behaviour: str, instance_id: str = "standin-0") -> None:
        self._server = socket.create_server((HOST, 0))
        super().__init__(instance_id, self._server.getsockname()[1])
        self.behaviour, self.requests = behaviour, 0
        self._tls = self.identity.server_context()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(raw,), daemon=True).start()

    def _answer(self, raw: socket.socket) -> None:
        try:
            raw.settimeout(10)
            connection = self._tls.wrap_socket(raw, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = connection.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (OSError, ssl.SSLError):
            raw.close()
            return
        self.requests += data.startswith(b"POST")
        if self.behaviour == "crash":
            connection.close()
        else:
            self._held.append(connection)

    def close(self) -> None:
        self._server.close()
        for connection in self._held:
            connection.close()
