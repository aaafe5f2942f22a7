"""`pdcluster up` with the local-provider YAML, really, on routable addresses: the YAML's three
hosts (10.77.0.1-3) on one end of a veth pair in a network namespace, sshd on each, Ray started
over SSH with token auth, pools placed by role, the router on the head with API keys, a chat
completion; then a stranger in a second namespace (10.77.0.9, the pair's other end: another host,
as far as the network goes) attacks every listener of the multi-node cluster and gets nothing
(docs/security.md); `pdcluster down`."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from machine import unless_ci

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("ray_up_scenario.py")
PROVIDER = yaml.safe_load((SCRIPT.parents[2] / "deploy" / "clusters" / "local.yaml").read_text())["provider"]
HOSTS = (PROVIDER["head_ip"], *PROVIDER["worker_ips"])
ATTACKER = "10.77.0.9"
SUBNET = ipaddress.ip_network(f"{HOSTS[0]}/24", strict=False)


def ensure_packages() -> None:
    """openssh-server and rsync, which `ray up` needs, installed from the distribution if missing."""
    if shutil.which("sshd") or Path("/usr/sbin/sshd").exists():
        if shutil.which("rsync"):
            return
    install = ["apt-get", "install", "-y", "-q", "openssh-server", "rsync"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600, check=True)
        subprocess.run(install, env=env, capture_output=True, timeout=600, check=True)


@contextlib.contextmanager
def two_hosts_apart(cluster: str, stranger: str) -> Iterator[None]:
    """Network namespaces `cluster` (HOSTS on its end of a veth pair) and `stranger` (ATTACKER on
    the other end), each with its own lo: the stranger reaches the cluster only over the pair."""
    ip = ("ip", "-n")
    subprocess.run(["ip", "netns", "add", cluster], check=True)
    subprocess.run(["ip", "netns", "add", stranger], check=True)
    try:
        for command in ([*ip, cluster, "link", "add", "pdc0", "type", "veth", "peer", "name", "pdc1", "netns", stranger],
                        *([*ip, cluster, "addr", "add", f"{host}/{SUBNET.prefixlen}", "dev", "pdc0"] for host in HOSTS),
                        [*ip, stranger, "addr", "add", f"{ATTACKER}/{SUBNET.prefixlen}", "dev", "pdc1"],
                        *([*ip, ns, "link", "set", device, "up"] for ns, device in
                          ((cluster, "lo"), (cluster, "pdc0"), (stranger, "lo"), (stranger, "pdc1")))):
            subprocess.run(command, check=True)
        yield
    finally:
        for namespace in (cluster, stranger):  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", namespace], check=False)


@pytest.mark.timeout(1500)
@unless_ci(os.geteuid() == 0 and all(map(shutil.which, ("ip", "unshare", "nsenter"))),
           "needs root, iproute2, unshare and nsenter")
def test_pdcluster_up_on_a_local_cluster_attacked_from_another_host(tmp_path, tiny_model):
    ensure_packages()
    cluster, stranger = f"pdcluster-{os.getpid()}", f"pdcluster-{os.getpid()}-stranger"
    with two_hosts_apart(cluster, stranger):
        command = ["ip", "netns", "exec", cluster, "unshare", "--pid", "--fork", "--mount-proc",
                   sys.executable, str(SCRIPT), str(tmp_path), stranger]
        env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=1500, env=env, cwd=SCRIPT.parents[2]
        )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert seen["up_rc"] == 0, seen.get("up_output")
    assert all(ipaddress.ip_address(host) in SUBNET and not ipaddress.ip_address(host).is_loopback for host in HOSTS)
    hosts = {i["role"]: i["url"].split("//")[1].split(":")[0] for i in seen["instances"]}
    assert hosts == {"prefill": HOSTS[1], "decode": HOSTS[2]}  # placed by the YAML's roles
    assert all(i["state"] == "ready" and i["url"].startswith("https://") for i in seen["instances"])
    assert seen["chat_status"] == 200 and seen["chat"]["usage"]["completion_tokens"] == 8
    assert any('where="remote"' in line and not line.endswith(" 0.0") for line in seen["prefills"])
    assert seen["down_rc"] == 0
    assert "attack_error" not in seen, seen["attack_error"]
    hit = seen["attacks"]
    assert "failed" not in hit, hit
    assert {status for codes in hit["client_routes"].values() for status in codes.values()} == {401}, hit
    assert set(hit["router_edges"].values()) == {401}, hit["router_edges"]
    assert all(code == 401 for codes in hit["engine_routes"].values() for code in codes), hit["engine_routes"]
    assert hit["store_shards"]["plain"] and not any(hit["store_shards"]["plain"] + hit["store_shards"]["own_curve_key"])
    assert hit["kv_event_replay"] and not any(hit["kv_event_replay"])  # no answer, no token ids
    # The tenant's requests stored blocks (events were published) while the stranger heard none.
    index = seen["index_blocks_while_attacked"]
    assert index["after"] > index["before"], index
    assert hit["kv_event_subscriptions"] == {"plain": [], "own_curve_key": []}, hit["kv_event_subscriptions"]
    assert hit["ray_gcs"] == "UNAUTHENTICATED" and hit["ray_client"] == "UNAUTHENTICATED", hit
    agents = hit["dashboard_agents"]
    assert agents and all(agent["submit_job"] in (401, "refused") for agent in agents.values()), agents
