"""How a caller reaches one engine and knows it is that engine, and how the engine knows its caller.

At every start of an engine's server process its host draws a nonce and makes the process an
`EngineIdentity`: a TLS key pair with a self-signed certificate, and a token, HMAC of the
instance's key (`ClusterCredentials.engine_key`) over the nonce. The process gets them in its
environment (never argv) and serves only TLS with that certificate, to requests carrying that
token. The host publishes the `EngineEndpoint` (URL, certificate, nonce), sealed under the
instance's key; the router, which holds the cluster's secret, derives the key, checks the seal
and opens an `EngineAccess`: a TLS context that trusts that one certificate, and the token.

So a listener that is not that process (a local user who bound the port first, or took it after
the engine died; a host on the network answering for the address) cannot finish a handshake: it
never receives a token, a prompt or a cache salt. A stolen token opens one engine, and only until
its process restarts (a new nonce); the instance's key opens that instance only.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import ssl


class EngineAccessRefused(RuntimeError):
    """An endpoint whose seal does not hold: not published by the host of that instance."""


@dataclasses.dataclass(frozen=True)
class EngineEndpoint:
    """Where one engine process serves and the certificate it presents; nothing secret."""

    instance_id: str
    url: str
    certificate: str
    """PEM, made for this process alone."""
    nonce: str
    """What the process's token was derived from."""
    seal: str
    """HMAC of the instance's key over the rest: only that instance's host could have made it."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineEndpoint:
        return cls(**json.loads(text))


def engine_token(engine_key: bytes, nonce: str) -> str:
    """The bearer token of the engine process started with `nonce`."""
    return hmac.new(engine_key, f"token:{nonce}".encode(), hashlib.sha256).hexdigest()


def _seal(engine_key: bytes, instance_id: str, url: str, certificate: str, nonce: str) -> str:
    fields = json.dumps([instance_id, url, hashlib.sha256(certificate.encode()).hexdigest(), nonce])
    return hmac.new(engine_key, f"endpoint:{fields}".encode(), hashlib.sha256).hexdigest()


@dataclasses.dataclass(frozen=True)
class EngineIdentity:
    """What one engine process is given to prove it is the engine its host started."""

    token: str = dataclasses.field(repr=False)
    certificate: str
    private_key: str = dataclasses.field(repr=False)
    nonce: str

    @classmethod
    def new(cls, engine_key: bytes, instance_id: str, host: str) -> EngineIdentity:
        """A fresh identity: nonce, token, ECDSA P-256 key and a certificate naming the instance
        (and the host's address), valid for ten years: it is trusted by its exact bytes, never
        through a CA, so its dates guard nothing."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"pdcluster engine {instance_id}")])
        names: list[x509.GeneralName] = [x509.DNSName(f"{instance_id}.engine.pdcluster")]
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256())
        )
        nonce = secrets.token_hex(16)
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
        return cls(engine_token(engine_key, nonce), certificate.public_bytes(serialization.Encoding.PEM).decode(),
                   key_pem, nonce)

    def endpoint(self, engine_key: bytes, instance_id: str, url: str) -> EngineEndpoint:
        """What the host publishes of this identity, sealed under the instance's key."""
        return EngineEndpoint(instance_id, url, self.certificate, self.nonce,
                              _seal(engine_key, instance_id, url, self.certificate, self.nonce))

    def server_context(self) -> ssl.SSLContext:
        """The TLS server context of the engine's listener (TLS 1.3 only)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads keys from files only: an anonymous memory file, gone when closed, not disk.
        descriptor = os.memfd_create("pdcluster-engine-tls", os.MFD_CLOEXEC)
        try:
            os.write(descriptor, (self.private_key + self.certificate).encode())
            context.load_cert_chain(f"/proc/self/fd/{descriptor}")
        finally:
            os.close(descriptor)
        return context


def client_context(certificate: str) -> ssl.SSLContext:
    """A TLS client context that trusts `certificate` and nothing else (no system CAs, no names:
    the certificate's exact key is the proof)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=certificate)
    return context


@dataclasses.dataclass(frozen=True)
class EngineAccess:
    """What a caller holds to talk to one engine process: its pinned TLS context and its token."""

    endpoint: EngineEndpoint
    token: str = dataclasses.field(repr=False)
    ssl: ssl.SSLContext = dataclasses.field(repr=False, compare=False)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def open_endpoint(engine_key: bytes, endpoint: EngineEndpoint) -> EngineAccess:
    """The access to `endpoint`, once its seal proves the instance's host published it; raises
    EngineAccessRefused otherwise."""
    expected = _seal(engine_key, endpoint.instance_id, endpoint.url, endpoint.certificate, endpoint.nonce)
    if not hmac.compare_digest(expected, endpoint.seal):
        raise EngineAccessRefused(f"the endpoint of {endpoint.instance_id} is not sealed by its host")
    if not endpoint.url.startswith("https://"):
        raise EngineAccessRefused(f"the endpoint of {endpoint.instance_id} is not TLS")
    return EngineAccess(endpoint, engine_token(engine_key, endpoint.nonce), client_context(endpoint.certificate))
