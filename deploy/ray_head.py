"""The connection to Ray: join a cluster, or start the one-node head on loopback that pdcluster
runs when it is given none.

That head is started two ways: in this process by `start_ray` (`pdcluster serve` without
`--address`), and as `ray start --head` by loadtest/local_cluster.py's `RayHead`, which
outlives the processes using it (a router restart's tests). Both take its settings from `LoopbackHead`, so the
two heads are the same. Ray is imported only inside `start_ray`: it reads the environment
`engine.environment.use_ray()` sets when first imported.

Ray's files (its sockets, logs, session folders) live in a folder of this user's alone,
`private_ray_root()`: Ray makes its temp dir and everything it creates there mode 0777, without
the sticky bit, so that users may share /tmp/ray; in /tmp/ray another local user renamed a
raylet's socket and planted files in its logs. The cluster YAMLs start every node's Ray the same
way (`RAY_TMPDIR`, checked by tests/unit/test_ray_private_dir.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import stat
import tempfile
from pathlib import Path

from engine.environment import RAY_LOOPBACK_ENV, UCX_LOOPBACK_ENV

log = logging.getLogger(__name__)
RAY_NAMESPACE = "pdcluster"
PRIVATE_RAY_ROOT_PREFIX = "/tmp/pdcluster-ray-"
"""`/tmp/pdcluster-ray-<uid>`: short, as Ray's Unix socket paths (107 bytes at most) lie under it."""
RAY_TEMP_DIR_NAME = "ray"
"""Ray's temp dir inside the private root: where Ray puts it given `RAY_TMPDIR=<root>`."""
RAY_FD_LIMIT = 65536
"""File descriptors for Ray's processes. Ray's gRPC servers keep every connection they accept,
with no cap and no idle timeout (none configurable in Ray 2.60), so each idle connection of a
stranger costs one; at its limit a GCS registers no new worker and a raylet starts none, or
aborts (20,000 idle connections at a 20,000 limit did: tests/unit/test_ray_listener_floods.py).
Where the hard limit allows, this leaves room for 20,000 and more; it bounds nothing."""


class RayTempDirError(RuntimeError):
    """No folder of this user's alone for Ray's files."""


def private_ray_root(path: Path | None = None) -> Path:
    """`/tmp/pdcluster-ray-<uid>` (or `path`), made 0700 if missing; refused if it is a link,
    another user's, or open to others (anything may have been planted in it then)."""
    path = path or Path(f"{PRIVATE_RAY_ROOT_PREFIX}{os.getuid()}")
    try:
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    status = os.lstat(path)
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid():
        raise RayTempDirError(f"{path} is not a folder of this user's: remove it")
    if status.st_mode & 0o077:
        mode = stat.S_IMODE(status.st_mode)
        raise RayTempDirError(f"{path} is open to other users (mode {mode:o}): remove it")
    return path


def ray_temp_dir() -> Path:
    """Ray's temp dir on this node (`--temp-dir`, `_temp_dir`): Ray makes it 0777, the private
    root above it keeps everyone else out."""
    return private_ray_root() / RAY_TEMP_DIR_NAME


def _own_ray_temp_dir() -> Path:
    """`ray_temp_dir()`, or when another user holds its root's name, a fresh private root of this
    process's (so that a planted folder cannot stop `pdcluster serve`)."""
    try:
        return ray_temp_dir()
    except (RayTempDirError, OSError) as exc:
        prefix = f"{Path(PRIVATE_RAY_ROOT_PREFIX).name}{os.getuid()}-"
        root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        log.warning("%s; Ray's files go to %s instead", exc, root)
        return private_ray_root(root) / RAY_TEMP_DIR_NAME


def raise_fd_limit(target: int = RAY_FD_LIMIT) -> int:
    """This process's descriptor limit raised to `target` (the hard limit too where allowed:
    root), else to the hard limit; the Ray processes it starts inherit it. `ray.init` raises
    only the soft limit, and `ray start` nothing. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= target or soft == resource.RLIM_INFINITY:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))
    except (ValueError, OSError):  # not allowed past the hard limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def local_cluster_address() -> str:
    """The address of the cluster whose node `ray start` started on this machine, as it wrote it
    in our private temp dir (`--address auto`). Never Ray's own discovery: that reads
    /tmp/ray/ray_current_cluster, which any local user may write, or takes any GCS process
    running here, a stranger's too, and Ray's token would go to it."""
    address_file = ray_temp_dir() / "ray_current_cluster"
    try:
        return address_file.read_text().strip()
    except FileNotFoundError:
        raise ConnectionError(f"no Ray cluster started on this machine ({address_file} is missing): "
                              "start one with the cluster YAML's command, or pass --address") from None


@dataclasses.dataclass(frozen=True)
class LoopbackHead:
    """A one-node Ray head on loopback: no dashboard, a small object store (tokens and KV never
    pass through Ray), UCX kept on loopback."""

    num_cpus: int
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    node_ip_address: str = "127.0.0.1"
    object_store_bytes: int = 256 * 1024**2
    env: dict[str, str] = dataclasses.field(default_factory=lambda: {**RAY_LOOPBACK_ENV, **UCX_LOOPBACK_ENV})
    """For the head's processes (Ray's token: inherited from the starting process)."""

    def init_kwargs(self) -> dict:
        """The head as `ray.init` starts it in this process."""
        return {"_node_ip_address": self.node_ip_address, "include_dashboard": False, "num_cpus": self.num_cpus,
                "resources": self.resources, "object_store_memory": self.object_store_bytes,
                "runtime_env": {"env_vars": self.env}}

    def start_flags(self) -> list[str]:
        """The head as `ray start --head` starts it (ports and temp dir are the caller's: under
        `private_ray_root()`)."""
        return [f"--node-ip-address={self.node_ip_address}", "--include-dashboard=false",
                f"--num-cpus={self.num_cpus}", f"--resources={json.dumps(self.resources)}",
                f"--object-store-memory={self.object_store_bytes}"]


def start_ray(address: str | None, resources: dict[str, float] | None = None) -> bool:
    """Join the Ray cluster at `address`, or start a one-node head on loopback (the caller ran
    `engine.environment.use_ray()` first: token auth, loopback).

    Returns True when this call started the head (and so should stop it).
    """
    import ray

    if ray.is_initialized():
        return False
    if address == "auto" and not os.environ.get("RAY_ADDRESS"):  # Ray's own lookup: see local_cluster_address
        address = local_cluster_address()
    if address:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        return False
    head = LoopbackHead(num_cpus=max(4, os.cpu_count() or 1), resources=resources or {})
    raise_fd_limit()
    # address "local": a head of its own, never another Ray found on this machine.
    ray.init(address="local", namespace=RAY_NAMESPACE, log_to_driver=False,
             _temp_dir=str(_own_ray_temp_dir()), **head.init_kwargs())
    return True
