"""Run by test_ray_up.py inside the cluster's network namespace (the hosts of deploy/clusters/
local.yaml on one veth end, a stranger's namespace on the other) and a PID namespace of its own:
sshd on the YAML's three addresses plays three hosts, `pdcluster up` brings the YAML up on them
as it is with the tiny model (prefill on the second host, decode on the third; the router on
every address of the head, with API keys), a chat completion goes through the router, a stranger
in the other namespace attacks every listener (tests/e2e/attacks.py), `pdcluster down` tears it
down. Prints one JSON line.

Its cluster secret is the test session's (PDCLUSTER_SECRET); `pdcluster up` writes it and Ray's
token under a configuration folder of its own (XDG_CONFIG_HOME), which the YAML mounts. The
stranger gets none of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from security.credentials import ClusterCredentials, write_private

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CLUSTER_YAML = REPO / "deploy" / "clusters" / "local.yaml"
PROVIDER = yaml.safe_load(CLUSTER_YAML.read_text())["provider"]
HOSTS = (PROVIDER["head_ip"], *PROVIDER["worker_ips"])
ROUTER_PORT = 8000
TENANT_KEY = "sk-ray-up-tenant"
LISTEN_S = 8.0
"""How long the stranger listens to the engines' KV events while a tenant's requests run."""
# Each node's dashboard agent (HTTP): Ray's default on the head, P + 3 on a worker (local.yaml: P
# from the address's last digit).
DASHBOARD_AGENT_PORT = {HOSTS[0]: 52365, **{host: 30000 + 200 * (int(host.rsplit(".", 1)[1]) % 10) + 3
                                            for host in HOSTS[1:]}}


def sh(*command: str, timeout_s: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout_s, **kwargs)


def start_sshd(workdir: Path) -> None:
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
    text = CLUSTER_YAML.read_text()
    config = yaml.safe_load(text.replace("$HOME/.config/pdcluster", credentials_dir))
    config["cluster_name"] = f"pdcluster-test-{os.getpid()}-{int(time.time())}"
    config["auth"]["ssh_private_key"] = str(workdir / "client_key")
    config["file_mounts"] = {credentials_dir: credentials_dir}
    path = workdir / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def attack(base: str, admin: dict, attacker_namespace: str, workdir: Path, seen: dict) -> None:
    """What a stranger in `attacker_namespace` gets from each listener: the endpoints are read as
    the operator (a port scan would find them too), the attacks run there without any credential;
    the cluster serves a tenant's requests meanwhile (its engines publish KV events)."""
    shards = [s["endpoint"] for s in httpx.get(f"{base}/admin/store", headers=admin, timeout=10).json()["shards"]]
    time.sleep(3)  # the chat's speculative index entries expire (2 s): only events change the index from here
    listing = httpx.get(f"{base}/admin/instances", headers=admin, timeout=10).json()["instances"]
    head = HOSTS[0]
    targets = {
        "router": f"http://{head}:{ROUTER_PORT}",
        "engines": [i["url"] for i in listing],
        "store_shards": shards,
        "kv_event_replay": [i["kv_events_replay_endpoint"] for i in listing],
        "kv_events": [i["kv_events_endpoint"] for i in listing],
        "listen_s": LISTEN_S,
        "ray_gcs": f"{head}:6379",
        "ray_client": f"{head}:10001",
        "dashboard_agents": [f"http://{host}:{port}" for host, port in DASHBOARD_AGENT_PORT.items()],
    }
    stranger_env = {"PATH": os.environ["PATH"], "HOME": "/nonexistent"}  # no secret, no Ray token, no config
    targets_file = workdir / "targets.json"
    targets_file.write_text(json.dumps(targets))
    stranger = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{attacker_namespace}", sys.executable, str(REPO / "tests/e2e/attacks.py"),
         str(targets_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=stranger_env, cwd="/",
    )
    tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
    blocks_before = sum(i["index_blocks"] for i in listing)
    deadline = time.monotonic() + LISTEN_S
    while time.monotonic() < deadline:  # new prompts: blocks stored, events published
        httpx.post(f"{base}/v1/completions", headers=tenant, timeout=60,
                   json={"model": "tiny", "max_tokens": 2, "prompt": f"A prompt of {time.time()} " * 20})
    time.sleep(3)  # the last requests' speculative entries expire
    listing = httpx.get(f"{base}/admin/instances", headers=admin, timeout=10).json()["instances"]
    seen["index_blocks_while_attacked"] = {"before": blocks_before, "after": sum(i["index_blocks"] for i in listing)}
    out, err = stranger.communicate(timeout=300)
    seen["attacks"] = json.loads(out) if stranger.returncode == 0 else {"failed": err[-3000:]}


def main() -> int:
    workdir, attacker_namespace = Path(sys.argv[1]), sys.argv[2]
    os.environ["XDG_CONFIG_HOME"] = str(workdir / "config")
    start_sshd(workdir)
    path = cluster_yaml(workdir)
    keys_file = workdir / "api-keys"
    write_private(keys_file, f"{TENANT_KEY}:tenant-a\n")  # 0600: else refused
    seen: dict = {"hosts": HOSTS}
    started = time.monotonic()
    up = subprocess.run([BIN / "pdcluster", "up", str(path), "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
                         "--api-keys-file", str(keys_file), "--model", "tiny", "--prefill", "1", "--decode", "1",
                         "--remote-prefill-min-tokens", "0", "--placement-timeout", "240"],
                        capture_output=True, text=True, timeout=900)
    seen["up_s"] = time.monotonic() - started
    seen["up_rc"] = up.returncode
    try:
        if up.returncode != 0:
            seen["up_output"] = (up.stdout + up.stderr)[-3000:]
            return 1
        base = f"http://127.0.0.1:{ROUTER_PORT}"
        admin = ClusterCredentials.load().admin_headers()
        seen["instances"] = httpx.get(f"{base}/admin/instances", headers=admin, timeout=10).json()["instances"]
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {TENANT_KEY}"},
                          json={"model": "tiny", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Hello, cluster!"}]})
        seen["chat_status"] = chat.status_code
        seen["chat"] = chat.json()
        seen["prefills"] = [line for line in httpx.get(f"{base}/metrics", headers=admin, timeout=10).text.splitlines()
                            if line.startswith("pdcluster_router_prefills_total")]
        try:
            attack(base, admin, attacker_namespace, workdir, seen)
        except Exception as exc:  # the test shows it, beside what was seen before
            seen["attack_error"] = repr(exc)
    finally:
        down = subprocess.run(
            [BIN / "pdcluster", "down", str(path)], capture_output=True, text=True, timeout=300
        )
        seen["down_rc"] = down.returncode
        print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
