"""Run by test_ray_up.py inside a network namespace whose only interface is lo, and a PID
namespace of its own: sshd on 127.0.0.1-3 plays three hosts, `pdcluster up` brings the local
cluster YAML up on them with the tiny model (prefill on 127.0.0.2, decode on 127.0.0.3), a chat
completion goes through the router, a stranger at 127.0.0.9 attacks every listener
(tests/e2e/attacks.py), `pdcluster down` tears it down. Prints one JSON line.

Its cluster secret is the test session's (PDCLUSTER_SECRET); `pdcluster up` writes it and Ray's
token under a configuration folder of its own (XDG_CONFIG_HOME), which the YAML mounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import attacks
import httpx
import yaml

from security.credentials import ClusterCredentials

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def sh(*command: str, timeout_s: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout_s, **kwargs)


def start_sshd(workdir: Path) -> None:
    sh("ip", "link", "set", "lo", "up")
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / "host_key"))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / "client_key"))
    (workdir / "authorized_keys").write_text((workdir / "client_key.pub").read_text())
    env = {"PDCLUSTER_HOME": str(REPO), "PDCLUSTER_MODEL_ROOT": os.environ["PDCLUSTER_MODEL_ROOT"],
           "XDG_CONFIG_HOME": os.environ["XDG_CONFIG_HOME"],
           "PATH": f"{BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    config = [f"ListenAddress {h}" for h in HOSTS] + [
        f"HostKey {workdir / 'host_key'}", f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "UsePAM no", "StrictModes no",
        f"PidFile {workdir / 'sshd.pid'}", "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
    ]
    (workdir / "sshd_config").write_text("\n".join(config) + "\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    sh("/usr/sbin/sshd", "-f", str(workdir / "sshd_config"), "-E", str(workdir / "sshd.log"))


def cluster_yaml(workdir: Path) -> Path:
    """local.yaml with this run's name, key, and its credentials folder for ~/.config/pdcluster."""
    credentials_dir = str(Path(os.environ["XDG_CONFIG_HOME"]) / "pdcluster")
    text = (REPO / "deploy" / "clusters" / "local.yaml").read_text()
    config = yaml.safe_load(text.replace("$HOME/.config/pdcluster", credentials_dir))
    config["cluster_name"] = f"pdcluster-test-{os.getpid()}-{int(time.time())}"
    config["auth"]["ssh_private_key"] = str(workdir / "client_key")
    config["file_mounts"] = {credentials_dir: credentials_dir}
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def attack(base: str, admin: dict, seen: dict) -> None:
    """What a stranger at 127.0.0.9 gets from each listener (the endpoints read as the operator)."""
    listing = httpx.get(f"{base}/admin/instances", headers=admin, timeout=10).json()
    shards = [s["endpoint"] for s in httpx.get(f"{base}/admin/store", headers=admin, timeout=10).json()["shards"]]

    def batches() -> int:
        body = {"model": "tiny", "prompt": "count the batches"}
        return httpx.post(f"{base}/admin/explain", json=body, headers=admin, timeout=30).json()["kv_event_batches"]

    seen["attacks"] = {
        "engine_routes": attacks.engine_routes([i["url"] for i in listing["instances"]]),
        "store_shards": attacks.store_shards(shards),
        "kv_event_replay": attacks.kv_event_replay([i["kv_events_replay_endpoint"] for i in listing["instances"]]),
        "forged_kv_events": attacks.forged_kv_events(listing["kv_events_endpoint"], batches, batches),
        "ray_gcs_exit_code": attacks.ray_gcs("127.0.0.1:6379"),
        "router_edges": attacks.router_edges(base),
    }


def main() -> int:
    workdir = Path(sys.argv[1])
    os.environ["XDG_CONFIG_HOME"] = str(workdir / "config")
    start_sshd(workdir)
    path = cluster_yaml(workdir)
    seen: dict = {}
    started = time.monotonic()
    up = subprocess.run([BIN / "pdcluster", "up", str(path), "--port", "8000", "--model", "tiny", "--prefill", "1",
                         "--decode", "1", "--remote-prefill-min-tokens", "0", "--placement-timeout", "240"],
                        capture_output=True, text=True, timeout=900)
    seen["up_s"] = time.monotonic() - started
    seen["up_rc"] = up.returncode
    try:
        if up.returncode != 0:
            seen["up_output"] = (up.stdout + up.stderr)[-3000:]
            return 1
        base = "http://127.0.0.1:8000"
        admin = ClusterCredentials.load().admin_headers()
        seen["instances"] = httpx.get(f"{base}/admin/instances", headers=admin, timeout=10).json()["instances"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello, cluster!"}]})
        seen["chat_status"] = chat.status_code
        seen["chat"] = chat.json()
        seen["prefills"] = [line for line in httpx.get(f"{base}/metrics", headers=admin, timeout=10).text.splitlines()
                            if line.startswith("pdcluster_router_prefills_total")]
        attack(base, admin, seen)
    finally:
        down = subprocess.run(
            [BIN / "pdcluster", "down", str(path)], capture_output=True, text=True, timeout=300
        )
        seen["down_rc"] = down.returncode
        print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
