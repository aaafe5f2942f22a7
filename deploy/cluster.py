"""`ray up` clusters: validating their YAML offline, bringing them up with pdcluster on them,
reporting, tearing down.

`pdcluster up CLUSTER.yaml [serve flags]` writes the cluster's secret and Ray's token (derived
from it) into ~/.config/pdcluster (0600; the YAMLs mount that folder on every node: Ray starts
with the token, the head's launcher reads the secret), runs `ray up`, then starts `pdcluster
launch` on the head (detached, logging to ~/pdcluster-launch.log) and waits until the router
answers /health there. No secret is ever put on a command line. pdcluster is expected in
$PDCLUSTER_HOME (default ~/pdcluster) on every host. The YAMLs start every node's Ray with its files
in a folder of the cluster user's alone (deploy/ray_head.py), where `launch` finds the head's address.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from deploy.ray_head import private_ray_root
from security.credentials import ClusterCredentials, CredentialsError, default_secret_file, write_private

REMOTE_BIN = "${PDCLUSTER_HOME:-$HOME/pdcluster}/.venv/bin"
REMOTE_PDCLUSTER = f"{REMOTE_BIN}/pdcluster"
RAY_UP_ENV = {"RAY_UP_enable_autoscaler_v2": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class ClusterConfigError(ValueError):
    pass


def validate_cluster_yaml(path: Path) -> dict:
    """Ray's own checks (its JSON schema, defaults filled in), offline; errors name the file."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        config = yaml.safe_load(path.read_text())
        config = prepare_config(config)
        validate_config(config)
    except Exception as exc:  # jsonschema, yaml and Ray's own ValueErrors alike
        raise ClusterConfigError(f"{path}: {exc}") from exc
    return config


def _ray(*args: str, timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
    ray = str(Path(sys.executable).with_name("ray"))
    # Ray's files on this machine (the local provider's node state and its lock) in our private
    # folder, not in /tmp/ray, where any local user may plant or rewrite them.
    env = {**os.environ, **RAY_UP_ENV, "RAY_TMPDIR": str(private_ray_root())}
    return subprocess.run([ray, *args], env=env, timeout=timeout_s, check=check, text=True,
                          capture_output=True)


def head_exec(cluster_yaml: Path, command: str, timeout_s: float = 120, check: bool = True):
    return _ray("exec", str(cluster_yaml), command, timeout_s=timeout_s, check=check)


def cluster_credentials_dir(credentials: ClusterCredentials) -> Path:
    """The folder the YAMLs mount on every node, holding `secret` and `ray-token` (0600). A
    secret file already there must be this cluster's: it is never overwritten."""
    path = default_secret_file()
    if path.exists() and ClusterCredentials.from_hex(path.read_text()) != credentials:
        raise CredentialsError(f"{path} holds another cluster's secret")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, credentials.secret.hex() + "\n")
    write_private(path.with_name("ray-token"), credentials.ray_token + "\n")
    return path.parent


def up(cluster_yaml: Path, launch_args: list[str], port: int, timeout_s: float = 900) -> str:
    """`ray up`, then pdcluster on the head with `launch_args` (which set the router's `port`);
    returns the router's URL as seen from the head."""
    validate_cluster_yaml(cluster_yaml)
    cluster_credentials_dir(ClusterCredentials.load(create=True))
    result = _ray("up", "-y", str(cluster_yaml), timeout_s=timeout_s, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ray up failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    launch = " ".join([REMOTE_PDCLUSTER, "launch", "--address", "auto", *map(shlex.quote, launch_args)])
    head_exec(cluster_yaml, f"setsid nohup {launch} > ~/pdcluster-launch.log 2>&1 < /dev/null &")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probe = head_exec(cluster_yaml, f"curl -sf http://127.0.0.1:{port}/health", check=False)
        if probe.returncode == 0:
            return f"http://127.0.0.1:{port}"
        time.sleep(5)
    log = head_exec(cluster_yaml, "tail -50 ~/pdcluster-launch.log", check=False).stdout
    raise TimeoutError(f"the router did not become healthy in {timeout_s} s; launch log:\n{log}")


def down(cluster_yaml: Path, timeout_s: float = 300) -> None:
    """Stop the router and engines, the head's Ray (its autoscaler would relaunch the workers
    `ray down` terminates), then `ray down`. `ray down` alone runs a bare `ray stop` through a
    login shell, whose PATH need not hold the venv's `ray`."""
    from deploy.serve import SHUTDOWN_DRAIN_S

    # "[p]" keeps pkill from matching the shell that runs it. The launcher drains first (its
    # streams end whole, SHUTDOWN_DRAIN_S at most), then stops its engines: wait until it has gone.
    head_exec(cluster_yaml, "pkill -INT -f '[p]dcluster launch'", check=False)
    wait_s = int(SHUTDOWN_DRAIN_S) + 60
    try:
        head_exec(cluster_yaml, f"for i in $(seq {wait_s}); do pgrep -f '[p]dcluster launch' >/dev/null || exit 0; "
                  "sleep 1; done; exit 1", timeout_s=wait_s + 60, check=False)
    except subprocess.TimeoutExpired:  # the head no longer answers: `ray down` still runs
        pass
    head_exec(cluster_yaml, f"{REMOTE_BIN}/ray stop", check=False)
    _ray("down", "-y", str(cluster_yaml), timeout_s=timeout_s)
