"""A process with the TCP listeners of a vLLM worker of ours, for attacks on them
(tests/unit/test_nixl_listener_floods.py). Run as a script, with the engines' UCX environment:

    python tests/nixl_holder.py SHARD_METADATA_B64 SHARD_ADDRESS NBYTES

Its NIXL agents: the weight plane's (memory registered, metadata handed out: engine/weights.py),
the KV connector's (connected to the shard-like agent named on the command line, one read done:
kvstore/shard_client.py) and one as vLLM's NixlConnector makes it (`num_threads=4`), NIXL quieted first
as engine/worker_extension.py does. Its torch.distributed state as vLLM's (one rank, a TCPStore and
gloo groups), sealed once made (transport.listener_warden.seal_tcp_listeners). It prints one JSON line (what
a peer needs to read its weights), then answers each line on stdin: "read" with the checksum of
another read from the shard, "gloo" with an all-reduce on each group, "warden" with what
transport.nixl's listener warden did.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import uuid
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from transport.listener_warden import WARDEN, seal_tcp_listeners  # noqa: E402
from transport.nixl import add_peer, new_agent, quiet_progress_threads, transfer  # noqa: E402

GLOO_GROUPS = 4  # vLLM 0.32's distributed state made 15 gloo listeners; a few show the same


def distributed_groups() -> list:
    """One rank's torch.distributed state as a vLLM worker's: a TCPStore and gloo groups."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as vLLM's on loopback (VLLM_HOST_IP)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return [dist.new_group([0], backend="gloo") for _ in range(GLOO_GROUPS)]


def all_reduced(groups: list) -> bool:
    import torch
    import torch.distributed as dist

    sums = [torch.ones(4) for _ in groups]
    for total, group in zip(sums, groups, strict=True):
        dist.all_reduce(total, group=group)
    return all(total.tolist() == [1.0] * 4 for total in sums)


def main() -> None:
    shard_metadata, shard_address, nbytes = base64.b64decode(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    quiet_progress_threads()  # as engine/worker_extension.py, before vLLM makes its agent
    from nixl._api import nixl_agent, nixl_agent_config

    connector = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    weights = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    weight_plane = new_agent("pdc-weights")
    weight_plane.register_memory([(weights.ctypes.data, weights.nbytes, 0, "")], "DRAM")
    staging = np.zeros(nbytes, dtype=np.uint8)
    kv = new_agent("pdc-kv")
    kv.register_memory([(staging.ctypes.data, staging.nbytes, 0, "")], "DRAM")
    shard = add_peer(kv, shard_metadata)

    def read_from_shard() -> int:
        staging[:] = 0
        transfer(kv, "READ", [(staging.ctypes.data, nbytes)], [(shard_address, nbytes)], shard, timeout_s=20)
        return zlib.crc32(staging)

    read_from_shard()
    groups = distributed_groups()
    sealed = seal_tcp_listeners()
    print(json.dumps({"weights": base64.b64encode(weight_plane.get_agent_metadata()).decode(),
                      "address": weights.ctypes.data, "crc": zlib.crc32(weights),
                      "agents": [connector.name, weight_plane.name, kv.name],
                      "ucx_ports": sorted(port for _, port in WARDEN.listeners.values()),
                      "sealed_ports": sorted(sealed)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "read":
            print(json.dumps({"crc": read_from_shard()}), flush=True)
        elif line.strip() == "gloo":
            print(json.dumps({"all_reduced": all_reduced(groups)}), flush=True)
        elif line.strip() == "warden":
            print(json.dumps({"shed": WARDEN.shed, "pauses": WARDEN.pauses}), flush=True)


if __name__ == "__main__":
    main()
