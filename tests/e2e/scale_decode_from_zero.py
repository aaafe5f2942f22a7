"""Run by test_autoscaling.py in its own PID namespace (so `ray stop` there ends only this cluster):
a Ray head with the fake multi-node provider, a decode node type with min 0 / max 2 workers, the
launcher's KV store (a shard per node), two actors placed like decode engines, then nothing.
Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def cluster_config() -> dict:
    return {
        "cluster_name": "pdcluster-fake",
        "max_workers": 2,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "decode_node": {"resources": {"CPU": 1, "decode": 1}, "node_config": {}, "min_workers": 0,
                            "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


def wait_for(condition, timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError
        time.sleep(1)
    return time.monotonic() - started


def main() -> int:
    config = Path(tempfile.mkdtemp()) / "fake.json"
    config.write_text(json.dumps(cluster_config()))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    subprocess.run([BIN / "ray", "start", "--head", "--num-cpus=1", "--include-dashboard=false",
                    "--object-store-memory=100000000", f"--autoscaling-config={config}"],
                   env=env, check=True, capture_output=True)
    try:
        import ray

        ray.init("auto", log_to_driver=False, namespace="pdcluster")
        print(json.dumps(scale_up_and_down()))
        ray.shutdown()
        return 0
    finally:
        subprocess.run([BIN / "ray", "stop", "--force"], env=env, capture_output=True)


def decode_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("decode"))


def scale_up_and_down() -> dict:
    """Two decode slots placed (the autoscaler adds their nodes), the store's shards reconciled
    to them, the slots gone (the nodes idle and are removed): what was seen at each step."""
    import asyncio

    import ray

    from decode.role import DECODE
    from deploy.actor_placement import placement_options
    from deploy.launcher import Launcher
    from fleet.instances import InstanceRegistry
    from kvstore.settings import StoreSettings
    from kvstore.sharded_store import ShardedStore
    from security.credentials import ClusterCredentials
    from transport.zmq_curve import STORE_PLANE

    credentials = ClusterCredentials.generate()
    launcher = Launcher(InstanceRegistry(), credentials)
    shards = asyncio.run(launcher.start_store_shards(32 * 1024**2))
    # a client from before the scale-up, as an engine's would be
    store = ShardedStore(StoreSettings(tuple(shards)), credentials.curve(STORE_PLANE))
    seen = {"decode_nodes_at_start": decode_nodes(), "store_shards_at_start": len(shards)}

    @ray.remote
    class DecodeSlot:  # holds a decode engine's placement; the engine is not the subject here
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    started = time.monotonic()
    slots = [DecodeSlot.options(**placement_options(DECODE, gpus=0)).remote() for _ in range(2)]
    nodes = ray.get([s.node.remote() for s in slots], timeout=180)
    seen.update(scale_up_s=time.monotonic() - started, decode_nodes_in_use=decode_nodes(),
                distinct_nodes=len(set(nodes)))
    # The slots stand for engines: the launcher is told their nodes instead of asking engines.
    shards = asyncio.run(launcher.store.reconcile(60, engine_nodes=set(nodes)))
    seen["store_shards_after_scale_up"] = len(shards)
    store.contains(["any"])  # a reply names the new member list's epoch
    store.contains(["any"])  # followed before this call
    seen["client_shards_after_scale_up"] = len(store.shards)
    for slot in slots:
        ray.kill(slot)
    # No engine left there: their shards end, or the nodes would never be idle.
    seen["store_shards_after_engines_left"] = len(asyncio.run(launcher.store.reconcile(engine_nodes=set())))
    seen["scale_down_s"] = wait_for(lambda: decode_nodes() == 0, 180)
    seen["decode_nodes_at_end"] = decode_nodes()
    store.close()
    asyncio.run(launcher.shutdown())
    return seen


if __name__ == "__main__":
    sys.exit(main())
