"""A new node's start caches from a peer (engine/node_caches.py, deploy/node_caches.py): what a
node lacks arrives byte for byte; what it has is kept; nothing lands outside a cache, under a
wrong digest or from a node of another GPU type or versions; and between two Ray nodes the
launcher's step brings them from a ready engine elsewhere, not from one on the same node."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import node_caches
from engine.node_caches import CacheFile, CacheKey, NodeCaches

PEER_FILES = {
    ("vllm", "startup_plan/startup_plan_0123456789abcdef.json"): b'{"kv_cache_memory_bytes": 1}',
    ("vllm", "torch_compile_cache/5f3a/rank_0_0/backbone/artifact"): b"graph" * 1000,
    ("triton", "Q2XK/kernel.cubin"): bytes(range(256)) * 40,
    ("triton", "Q2XK/kernel.json"): b'{"name": "kernel"}',
    ("cuda", "index"): b"\x00\x01",
}


def cache_env(root: Path) -> dict[str, str]:
    return {variable: str(root / name) for name, (variable, _) in node_caches.CACHES.items()}


def filled(root: Path, files: dict[tuple[str, str], bytes]) -> dict[str, Path]:
    dirs = node_caches.cache_dirs(cache_env(root))
    for (cache, path), data in files.items():
        target = dirs[cache] / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dirs


def contents(dirs: dict[str, Path]) -> dict[tuple[str, str], bytes]:
    return {(cache, path): file.read_bytes() for cache, path, file in node_caches._walk(dirs)}


def offer(files: list[tuple[str, str, bytes]], key: CacheKey | None = None) -> NodeCaches:
    return NodeCaches(key or CacheKey.here(), tuple(
        CacheFile(cache, path, hashlib.sha256(data).hexdigest(), data) for cache, path, data in files))


def test_a_new_node_gets_what_it_lacks_and_keeps_what_it_has(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES)
    own_plan = ("vllm", "startup_plan/startup_plan_0123456789abcdef.json")
    new = filled(tmp_path / "new", {own_plan: b'{"kv_cache_memory_bytes": 2}'})

    caches = node_caches.export(peer, node_caches.manifest(new))
    assert {(f.cache, f.path) for f in caches.files} == set(PEER_FILES) - {own_plan}  # not what it has
    installed = node_caches.install(caches, new)

    assert (installed.files, installed.refused) == (len(PEER_FILES) - 1, 0)
    assert installed.bytes == sum(len(d) for k, d in PEER_FILES.items() if k != own_plan)
    assert contents(new) == {**PEER_FILES, own_plan: b'{"kv_cache_memory_bytes": 2}'}  # its own plan kept
    assert node_caches.export(peer, node_caches.manifest(new)).files == ()  # nothing left to give


def test_a_peer_of_another_gpu_type_or_version_gives_nothing_and_nothing_of_its_is_taken(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES)
    new = node_caches.cache_dirs(cache_env(tmp_path / "new"))
    here = CacheKey.here()
    for other in (dataclasses.replace(here, device="NVIDIA H200"), dataclasses.replace(here, vllm="0.0.1")):
        wanted = dataclasses.replace(node_caches.manifest(new), key=other)
        assert node_caches.export(peer, wanted) is None
        foreign = dataclasses.replace(node_caches.export(peer, node_caches.manifest(new)), key=other)
        assert node_caches.install(foreign, new) == node_caches.InstalledCaches(0, 0, len(PEER_FILES))
    assert contents(new) == {}


def test_no_file_lands_outside_its_cache_or_under_a_wrong_digest(tmp_path):
    new = filled(tmp_path / "new", {("triton", "existing/kernel.cubin"): b"mine"})
    outside = tmp_path / "outside"
    outside.mkdir()
    (new["triton"] / "escape").symlink_to(outside)  # a link inside the cache leading out
    attacks = [("triton", f"{outside}/absolute", b"x"), ("triton", "../outside/up", b"x"),
               ("triton", "a/../../outside/up-again", b"x"), ("triton", "escape/through-link", b"x"),
               ("triton", "a//b", b"x"), ("triton", "./dot", b"x"), ("triton", "nul\0byte", b"x"),
               ("nowhere", "unknown-cache", b"x"), ("triton", "", b"x")]
    tampered = dataclasses.replace(offer([("triton", "tampered/kernel.cubin", b"good")]).files[0], data=b"evil")
    caches = offer(attacks)
    caches = dataclasses.replace(caches, files=(*caches.files, tampered,
                                                *offer([("triton", "existing/kernel.cubin", b"theirs")]).files))

    installed = node_caches.install(caches, new)

    assert installed.refused == len(attacks) + 1 and installed.files == 0
    assert list(outside.iterdir()) == [] and not (tmp_path / "new" / "outside").exists()
    assert contents(new) == {("triton", "existing/kernel.cubin"): b"mine"}  # never written over


def test_a_peer_offers_no_links_and_at_most_its_limit_smallest_first(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES)
    secret = tmp_path / "secret"
    secret.write_text("not a cache file")
    (peer["vllm"] / "link-to-secret").symlink_to(secret)
    (peer["triton"] / "linked-folder").symlink_to(tmp_path, target_is_directory=True)
    new = node_caches.manifest(node_caches.cache_dirs(cache_env(tmp_path / "new")))

    every = node_caches.export(peer, new)
    assert {(f.cache, f.path) for f in every.files} == set(PEER_FILES)
    limited = node_caches.export(peer, new, max_bytes=100)
    assert [len(f.data) for f in limited.files] == sorted(len(d) for d in PEER_FILES.values() if len(d) <= 30)


TWO_NODES = textwrap.dedent("""
    import asyncio, json, shutil, sys, tempfile
    from pathlib import Path
    from engine.environment import use_ray
    from security.credentials import ClusterCredentials
    use_ray(ClusterCredentials.load().ray_auth_env(), loopback=True)
    import ray
    from ray.cluster_utils import Cluster
    from deploy.node_caches import bring_caches
    from deploy.ray_head import private_ray_root
    from engine.config import EngineConfig
    from engine.host import EngineHost

    envs = json.loads(sys.argv[1])
    temp_dir = tempfile.mkdtemp(prefix="caches-", dir=private_ray_root())  # not the shared /tmp/ray
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"a": 1}, "env_vars": envs["a"]})
    try:
        cluster.add_node(**node, resources={"b": 1}, env_vars=envs["b"])
        ray.init(address=cluster.address, namespace="pdc-node-caches", log_to_driver=False)
        config = EngineConfig(model=Path(sys.argv[2]), served_model_name="tiny", keep_host_weights=False)
        actor = ray.remote(EngineHost)
        peer, beside = (actor.options(num_cpus=0, resources={"a": 0.1}).remote(config, n, host="127.0.0.1")
                        for n in ("p", "s"))
        new = actor.options(num_cpus=0, resources={"b": 1}).remote(config, "n", host="127.0.0.1")

        async def steps():
            return [await bring_caches(beside, [peer]), await bring_caches(new, [beside, peer]),
                    await bring_caches(new, [peer])]
        print(json.dumps([None if r is None else [r.files, r.bytes, r.refused] for r in asyncio.run(steps())]))
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
""")


@pytest.mark.slow
def test_between_two_ray_nodes_a_new_node_gets_a_ready_peers_caches(tmp_path, tiny_model):
    filled(tmp_path / "a", PEER_FILES)
    envs = {"a": cache_env(tmp_path / "a"), "b": cache_env(tmp_path / "b")}
    result = subprocess.run([sys.executable, "-c", TWO_NODES, json.dumps(envs), str(tiny_model)],
                            capture_output=True, text=True, timeout=180, cwd=Path(__file__).parents[2],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    beside, new, again = json.loads(result.stdout.strip().splitlines()[-1])
    assert beside is None  # a peer on its own node: the same caches already
    assert new == [len(PEER_FILES), sum(map(len, PEER_FILES.values())), 0]
    assert again is None  # nothing left that it lacks
    assert contents(node_caches.cache_dirs(envs["b"])) == PEER_FILES
