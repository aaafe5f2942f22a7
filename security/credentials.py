"""The cluster's credentials: one secret, and every key a component needs derived from it.

A cluster has one secret of 32 random bytes. Each use gets its own key, HMAC-SHA256 of the
secret over a label, so the values that must agree (the token the router presents and the one
every engine checks, a store shard's CURVE keys and its clients') come from one place and cannot
drift apart, and knowing one derived key reveals neither the secret nor another key:

- `engine_key(instance_id)`: one engine instance's key; each start of its server process derives
  that process's token and seals its TLS certificate with it (security/engine_access.py), so the
  router reaches only the process its host started, and a stolen token opens one engine process;
- `admin_token`: the router's /admin/* and /metrics;
- `weights_key`: signs weight manifests and CUDA IPC handles between engines;
- `tenant_salt(tenant)`: the cache salt of a tenant's requests, which no one without the secret
  can compute for another tenant (a hash of the tenant's name could be);
- `curve(plane)`: ZMQ CURVE key pairs (server and client) for the store's control sockets and
  the KV event sockets (transport/zmq_curve.py);
- `ray_token`: Ray's own token authentication (every Ray process of the cluster presents it).

An engine's vLLM process, the part that parses what comes over the network, never holds the
secret: it gets `EngineKeys` (its own token and TLS identity, the weights key, the KV-event
plane's keys and the store plane's client keys; not its instance's key, the store's server key,
the admin token, Ray's token or the tenant salts) in PDCLUSTER_ENGINE_KEYS. A store shard gets `ShardKeys` (the store plane's server key
pair, the client key it admits, and the key that proves it is the cluster's) as its Ray actor's
argument, which Ray keeps in its GCS: the secret itself is never an actor's argument there.

The secret comes from the environment (PDCLUSTER_SECRET, hex) or a file (PDCLUSTER_SECRET_FILE,
default ~/.config/pdcluster/secret, mode 0600). `pdcluster serve` on one machine creates the file
when there is none; on a cluster the head's launcher reads it and hands the components what they
need through Ray (itself behind Ray's token auth), never on a command line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path

from security.engine_access import EngineAccess, EngineEndpoint, EngineIdentity, open_endpoint

SECRET_ENV = "PDCLUSTER_SECRET"
SECRET_FILE_ENV = "PDCLUSTER_SECRET_FILE"
ENGINE_KEYS_ENV = "PDCLUSTER_ENGINE_KEYS"
SECRET_BYTES = 32


class CredentialsError(RuntimeError):
    """No usable cluster secret."""


def runtime_dir() -> Path:
    """A folder of this user's alone for files derived from the secret (0700): under
    XDG_RUNTIME_DIR or the temp folder; under ~/.cache if someone else holds that name there."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    for path in (base / f"pdcluster-{os.getuid()}", Path.home() / ".cache" / "pdcluster" / "run"):
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            status = os.lstat(path)
        except OSError:  # e.g. a dangling link of someone else's in that place
            continue
        if stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid() and not status.st_mode & 0o077:
            return path
    raise CredentialsError(f"no folder of this user's alone under {base} or ~/.cache/pdcluster")


def write_private(path: Path, text: str) -> Path:
    """`path` holding `text`, readable by its owner only (kept if it already holds it)."""
    if path.exists() and path.read_text() == text:
        return path
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    temporary.replace(path)
    return path


def read_private(path: Path) -> str:
    """The text of a file of secrets (the cluster's secret, the API keys): refused unless it is
    this user's own, readable by no one else, and not a link."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor) as handle:
        status = os.fstat(handle.fileno())
        if status.st_uid != os.getuid():
            raise CredentialsError(f"{path} belongs to another user")
        if status.st_mode & 0o077:
            raise CredentialsError(f"{path} is readable by others: chmod 600 {path}")
        return handle.read()


def default_secret_file() -> Path:
    configured = os.environ.get(SECRET_FILE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "pdcluster" / "secret"


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """A plane's CURVE key pairs (z85): the server's, and the one every client of the plane uses."""

    server_public: bytes
    server_secret: bytes = dataclasses.field(repr=False)
    client_public: bytes
    client_secret: bytes = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class ClusterCredentials:
    secret: bytes = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < SECRET_BYTES:
            raise CredentialsError(f"the cluster secret must be at least {SECRET_BYTES} bytes")

    @classmethod
    def generate(cls) -> ClusterCredentials:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str) -> ClusterCredentials:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise CredentialsError("the cluster secret is not hex") from None

    @classmethod
    def load(cls, path: Path | None = None, create: bool = False) -> ClusterCredentials:
        """From PDCLUSTER_SECRET, else from `path` (default: default_secret_file()). With
        `create`, a missing file is made (random secret, 0600, its folder 0700)."""
        if os.environ.get(SECRET_ENV):
            return cls.from_hex(os.environ[SECRET_ENV])
        path = path or default_secret_file()
        if not path.exists():
            if not create:
                raise CredentialsError(f"no cluster secret: set {SECRET_ENV} or create {path} "
                                       "(`pdcluster secret`)")
            return cls.generate().save(path)
        return cls.from_hex(read_private(path))

    def save(self, path: Path) -> ClusterCredentials:
        """Write the secret to `path`, readable by its owner only; never overwrites."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(self.secret.hex() + "\n")
        return self

    def shard_keys(self) -> ShardKeys:
        from transport.zmq_curve import STORE_PLANE

        return ShardKeys(dataclasses.replace(self.curve(STORE_PLANE), client_secret=b""), self.proof_key("store-shard"))

    def engine_host_keys(self, instance_id: str) -> EngineHostKeys:
        """What the host of engine `instance_id` holds (an engine actor's config carries it)."""
        from transport.zmq_curve import KV_EVENTS_PLANE, STORE_PLANE

        store = dataclasses.replace(self.curve(STORE_PLANE), server_secret=b"")
        return EngineHostKeys(instance_id, self.engine_key(instance_id), self.weights_key,
                              self.curve(KV_EVENTS_PLANE), store, self.proof_key("engine"))

    def engine_key(self, instance_id: str) -> bytes:
        """The key of one engine instance: its processes' tokens and endpoint seals come from it."""
        return self.derive(f"engine:{instance_id}")

    def engine_access(self, endpoint: EngineEndpoint) -> EngineAccess:
        """How to reach the engine process that published `endpoint` (its seal checked: raises
        EngineAccessRefused for one its instance's host did not make)."""
        return open_endpoint(self.engine_key(endpoint.instance_id), endpoint)

    def proof_key(self, kind: str) -> bytes:
        """The key an actor of `kind` ("engine", "store-shard") proves it is the cluster's with:
        one per kind, so that the one a kind is given proves nothing else."""
        return self.derive(f"proof:{kind}")

    def derive(self, label: str, size: int = 32) -> bytes:
        return hmac.new(self.secret, f"pdcluster:{label}".encode(), hashlib.sha256).digest()[:size]

    @property
    def admin_token(self) -> str:
        return self.derive("admin-token").hex()

    @property
    def weights_key(self) -> str:
        return self.derive("weights-key").hex()

    @property
    def ray_token(self) -> str:
        return self.derive("ray-token").hex()

    def ray_auth_env(self) -> dict[str, str]:
        """Ray's token authentication for a process of this cluster (set before `import ray`):
        the mode, and a file of this user's alone holding the token."""
        name = f"ray-token-{hashlib.sha256(self.ray_token.encode()).hexdigest()[:12]}"
        path = write_private(runtime_dir() / name, self.ray_token + "\n")
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def prove(self, kind: str, challenge: str) -> str:
        """The answer to `challenge` that only the cluster's actors of `kind` can give (adoption;
        docs/security.md, "One secret, keys derived per use"): HMAC under that kind's proof key."""
        return _proof(self.proof_key(kind), challenge)

    def tenant_salt(self, tenant: str) -> str:
        return hmac.new(self.derive("tenant-salt"), tenant.encode(), hashlib.sha256).hexdigest()[:32]

    def curve(self, plane: str) -> CurveKeys:
        import zmq
        from zmq.utils import z85

        server_secret = z85.encode(self.derive(f"curve:{plane}:server"))
        client_secret = z85.encode(self.derive(f"curve:{plane}:client"))
        return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret),
                         client_secret)


@dataclasses.dataclass(frozen=True)
class EngineKeys:
    """What an engine's vLLM process needs of the cluster's credentials, and nothing more: its own
    identity (the token it admits, its TLS key and certificate), the weights key it signs and
    checks weights with, the KV-event plane's server keys, and the store plane's client keys
    (never the server's)."""

    identity: EngineIdentity
    weights_key: str = dataclasses.field(repr=False)
    kv_events: CurveKeys
    store: CurveKeys

    @property
    def engine_token(self) -> str:
        return self.identity.token

    def as_env(self) -> dict[str, str]:
        """How the engine's host hands them over: the environment, never argv."""
        return {ENGINE_KEYS_ENV: self.to_json()}

    def to_json(self) -> str:
        planes = {name: {f.name: getattr(keys, f.name).decode() for f in dataclasses.fields(keys)}
                  for name, keys in (("kv_events", self.kv_events), ("store", self.store))}
        return json.dumps({"identity": dataclasses.asdict(self.identity), "weights_key": self.weights_key, **planes})

    @classmethod
    def from_json(cls, text: str) -> EngineKeys:
        fields = json.loads(text)
        planes = {name: CurveKeys(**{k: v.encode() for k, v in fields[name].items()})
                  for name in ("kv_events", "store")}
        return cls(EngineIdentity(**fields["identity"]), fields["weights_key"], **planes)

    @classmethod
    def load(cls) -> EngineKeys:
        """This engine process's keys (set by its host); a process without them is not an
        engine of ours."""
        text = os.environ.get(ENGINE_KEYS_ENV)
        if not text:
            raise CredentialsError(f"no {ENGINE_KEYS_ENV}: not an engine started by pdcluster")
        return cls.from_json(text)

    @staticmethod
    def present() -> bool:
        return bool(os.environ.get(ENGINE_KEYS_ENV))


@dataclasses.dataclass(frozen=True)
class ShardKeys:
    """What a store shard needs of the cluster's credentials, and nothing more: it is the store
    plane's server (its key pair; of the clients' pair, the public key it admits) and proves to a
    launcher that would adopt it that it is the cluster's."""

    store: CurveKeys
    proof_key: bytes = dataclasses.field(repr=False)

    def prove(self, challenge: str) -> str:
        """ClusterCredentials.prove's answer, from the proof key alone."""
        return _proof(self.proof_key, challenge)


@dataclasses.dataclass(frozen=True)
class EngineHostKeys:
    """What one engine's host (its Ray actor) holds: its instance's key, from which it makes each
    server process's identity and seals its endpoint, the keys it hands that process, and the key
    that proves to a launcher that would adopt it that it is the cluster's engine. An engine
    actor's config carries these, never the secret (Ray keeps actors' arguments in its GCS)."""

    instance_id: str
    engine_key: bytes = dataclasses.field(repr=False)
    weights_key: str = dataclasses.field(repr=False)
    kv_events: CurveKeys
    store: CurveKeys
    proof_key: bytes = dataclasses.field(repr=False)

    def prove(self, challenge: str) -> str:
        return _proof(self.proof_key, challenge)

    def new_process(self, host: str) -> EngineKeys:
        """The keys of a new server process of this engine: a fresh identity (engine_access)."""
        return EngineKeys(EngineIdentity.new(self.engine_key, self.instance_id, host), self.weights_key,
                          self.kv_events, self.store)

    def endpoint(self, keys: EngineKeys, url: str) -> EngineEndpoint:
        """What a router needs to reach the process given `keys`, at `url`, sealed."""
        return keys.identity.endpoint(self.engine_key, self.instance_id, url)

    def to_json(self) -> str:
        planes = {name: {f.name: getattr(keys, f.name).decode() for f in dataclasses.fields(keys)}
                  for name, keys in (("kv_events", self.kv_events), ("store", self.store))}
        return json.dumps({"instance_id": self.instance_id, "engine_key": self.engine_key.hex(),
                           "weights_key": self.weights_key, "proof_key": self.proof_key.hex(), **planes})

    @classmethod
    def from_json(cls, text: str) -> EngineHostKeys:
        fields = json.loads(text)
        planes = {name: CurveKeys(**{k: v.encode() for k, v in fields[name].items()})
                  for name in ("kv_events", "store")}
        return cls(fields["instance_id"], bytes.fromhex(fields["engine_key"]), fields["weights_key"],
                   planes["kv_events"], planes["store"], bytes.fromhex(fields["proof_key"]))


def _proof(proof_key: bytes, challenge: str) -> str:
    return hmac.new(proof_key, challenge.encode(), hashlib.sha256).hexdigest()


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` as its Bearer credential (constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
