"""`pdcluster up` with the local-provider YAML, really: sshd on three loopback addresses in a
network namespace with only lo, Ray started over SSH with token auth, pools placed by role, a chat
completion through the router; then a stranger at another address attacks every listener of the
multi-node cluster and gets nothing (docs/security.md); `pdcluster down`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("ray_up_scenario.py")


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


@pytest.mark.timeout(1500)
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
                    reason="needs root, iproute2 and unshare")
def test_pdcluster_up_on_a_local_cluster_in_a_network_namespace(tmp_path, tiny_model):
    ensure_packages()
    namespace = f"pdcluster-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        command = ["ip", "netns", "exec", namespace, "unshare", "--pid", "--fork", "--mount-proc",
                   sys.executable, str(SCRIPT), str(tmp_path)]
        env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=1500, env=env, cwd=SCRIPT.parents[2]
        )
    finally:
        subprocess.run(["ip", "netns", "del", namespace], check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    seen = json.loads(lines[-1])
    assert seen["up_rc"] == 0, seen.get("up_output")
    hosts = {i["role"]: i["url"].split("//")[1].split(":")[0] for i in seen["instances"]}
    assert hosts == {"prefill": "127.0.0.2", "decode": "127.0.0.3"}  # placed by the YAML's roles
    assert all(i["state"] == "ready" for i in seen["instances"])
    assert seen["chat_status"] == 200 and seen["chat"]["usage"]["completion_tokens"] == 8
    assert any('where="remote"' in line and not line.endswith(" 0.0") for line in seen["prefills"])
    assert seen["down_rc"] == 0
    hit = seen["attacks"]
    assert all(code == 401 for codes in hit["engine_routes"].values() for code in codes), hit["engine_routes"]
    assert hit["store_shards"]["plain"] and not any(hit["store_shards"]["plain"] + hit["store_shards"]["own_curve_key"])
    assert hit["kv_event_replay"] and not any(hit["kv_event_replay"])  # no answer, no token ids
    forged = hit["forged_kv_events"]
    assert forged["batches_after"] == forged["batches_before"]  # nothing the stranger sent was applied
    assert hit["ray_gcs_exit_code"] != 0
    assert set(hit["router_edges"].values()) == {401}
