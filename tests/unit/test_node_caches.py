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
import time
from pathlib import Path

import pytest

from deploy.node_caches import CachePeer, EngineKind, peers_in_turn
from engine import node_caches
from engine.node_caches import CacheFile, CacheKey, CacheUnit, NodeCaches

KEY = "the cluster's weights key"
PEER_FILES = {
    ("vllm", "startup_plan/startup_plan_0123456789abcdef.json"): b'{"kv_cache_memory_bytes": 1}',
    ("vllm", "torch_compile_cache/5f3a/rank_0_0/backbone/artifact"): b"graph" * 1000,
    ("vllm", "torch_compile_cache/5f3a/rank_0_0/backbone/vllm_compile_cache.py"): b"{(1, 0): 'artifact'}",
    ("vllm", "torch_compile_cache/torch_aot_compile/85e4/rank_0_0/model"): b"aot" * 300,
    ("vllm", "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"): b'{"hash": "1f"}',
    ("triton", "Q2XK/kernel.cubin"): bytes(range(256)) * 40,
    ("triton", "Q2XK/kernel.json"): b'{"name": "kernel"}',
}
NOT_SHIPPED = {  # the node's own GPUs' probe, and what an operator put beside the caches
    ("vllm", "gpu_p2p_access_cache_for_0,1.json"): b'{"0->1": true}',
    ("vllm", "media/tenant-image.png"): b"a tenant's image",
}


def cache_env(root: Path) -> dict[str, str]:
    return {spec.variable: str(root / name) for name, spec in node_caches.CACHES.items()}


def filled(root: Path, files: dict[tuple[str, str], bytes]) -> dict[str, Path]:
    dirs = node_caches.cache_dirs(cache_env(root))
    for (cache, path), data in files.items():
        target = dirs[cache] / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return dirs


def contents(dirs: dict[str, Path]) -> dict[tuple[str, str], bytes]:
    return {(cache, file.relative_to(root).as_posix()): file.read_bytes()
            for cache, root in dirs.items() for file in root.rglob("*") if file.is_file()}


def exported(peer: dict[str, Path], new: dict[str, Path], **limits) -> NodeCaches:
    return node_caches.export(peer, node_caches.manifest(new), KEY, min_age_s=0, **limits)


def crafted(units: list[tuple[str, str, list[tuple[str, bytes]]]], key: str = KEY) -> NodeCaches:
    """Units as a member of the cluster could send them (signed with its key)."""
    return NodeCaches(CacheKey.here(), tuple(
        CacheUnit(cache, name, tuple(CacheFile(path, hashlib.sha256(data).hexdigest(), data) for path, data in files))
        for cache, name, files in units)).signed(key)


def test_a_new_node_gets_the_units_it_lacks_whole_and_keeps_its_own(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES | NOT_SHIPPED)
    own_plan = ("vllm", "startup_plan/startup_plan_0123456789abcdef.json")
    new = filled(tmp_path / "new", {own_plan: b'{"kv_cache_memory_bytes": 2}'})

    caches = exported(peer, new)
    assert {(u.cache, u.name) for u in caches.units} == {
        ("vllm", "torch_compile_cache/5f3a"), ("vllm", "torch_compile_cache/torch_aot_compile/85e4"),
        ("vllm", "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"),
        ("triton", "Q2XK")}  # not the plan it has, nor the P2P probe or the media
    installed = node_caches.install(caches, new, KEY)

    assert (installed.units, installed.refused) == (4, 0)
    assert installed.bytes == sum(len(d) for k, d in PEER_FILES.items() if k != own_plan)
    assert contents(new) == {**PEER_FILES, own_plan: b'{"kv_cache_memory_bytes": 2}'}  # its own plan kept
    assert exported(peer, new).units == ()  # nothing left to give
    assert not list(tmp_path.rglob(f"{node_caches.STAGING_PREFIX}*"))


def test_caches_not_signed_by_the_cluster_or_of_another_gpu_type_or_version_are_not_taken(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES)
    new = node_caches.cache_dirs(cache_env(tmp_path / "new"))
    caches = exported(peer, new)
    here = CacheKey.here()
    for other in (dataclasses.replace(here, device="NVIDIA H200"), dataclasses.replace(here, vllm="0.0.1")):
        assert node_caches.export(peer, dataclasses.replace(node_caches.manifest(new), key=other), KEY) is None
        foreign = dataclasses.replace(caches, key=other).signed(KEY)
        assert node_caches.install(foreign, new, KEY).refused == len(caches.units)
    for unsigned in (dataclasses.replace(caches, signature=""), caches.signed("a stranger's key"),
                     dataclasses.replace(caches, units=caches.units[:1] + crafted([
                         ("triton", "EVIL", [("launcher.so", b"code")])]).units)):
        assert node_caches.install(unsigned, new, KEY) == node_caches.InstalledCaches(0, 0, len(unsigned.units))
    assert contents(new) == {}


def test_no_unit_lands_outside_its_cache_over_another_or_in_part(tmp_path):
    new = filled(tmp_path / "new", {("triton", "MINE/kernel.cubin"): b"mine", ("vllm", "modelinfos"): b"a file"})
    (new["triton"] / "EMPTY").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    new["vllm"].mkdir(parents=True, exist_ok=True)
    (new["vllm"] / "torch_compile_cache").symlink_to(outside)  # a link inside the cache leading out
    good = [("kernel.cubin", b"k")]
    attacks = [("triton", str(outside / "abs"), good), ("triton", "../outside", good), ("triton", "a/../..", good),
               ("vllm", "torch_compile_cache/5f3a", good),  # through the link
               ("vllm", "gpu_p2p_access_cache_for_0,1.json", [("", b"{}")]),  # not a unit we ship
               ("vllm", "startup_plan", [("startup_plan_x.json", b"{}")]),  # a folder of units, not one
               ("vllm", "torch_compile_cache/torch_aot_compile", [("85e4/rank_0_0/model", b"x")]),  # the same
               ("triton", "EMPTY", good),  # an empty folder of the node's: its own, even empty
               ("vllm", "modelinfos/over-a-file.json", [("", b"{}")]),  # modelinfos is a file here
               ("triton", "DOTS", [("../../outside/up", b"x")]), ("triton", "ABS", [(str(outside / "x"), b"x")]),
               ("triton", "NUL", [("a\0b", b"x")]), ("nowhere", "X", good),
               ("triton", "HALF", [("good.cubin", b"written first"), ("../bad", b"x")]),  # nothing of it stays
               ("triton", "MINE", [("kernel.cubin", b"theirs")])]  # the node has it: kept
    caches = crafted(attacks)
    tampered = dataclasses.replace(caches.units[0], name="TAMPERED", files=(
        dataclasses.replace(caches.units[0].files[0], data=b"evil"),))
    caches = dataclasses.replace(caches, units=(*caches.units, tampered)).signed(KEY)

    installed = node_caches.install(caches, new, KEY)

    assert installed == node_caches.InstalledCaches(0, 0, len(attacks) + 1 - 2)  # + TAMPERED; MINE, EMPTY: kept
    assert list(outside.iterdir()) == [] and list((new["triton"] / "EMPTY").iterdir()) == []
    assert contents(new) == {("triton", "MINE/kernel.cubin"): b"mine", ("vllm", "modelinfos"): b"a file"}
    assert not list(tmp_path.rglob(f"{node_caches.STAGING_PREFIX}*"))


def test_what_is_not_one_unit_is_refused_where_it_could_land(tmp_path):
    new = node_caches.cache_dirs(cache_env(tmp_path / "new"))
    caches = crafted([("vllm", "torch_compile_cache/torch_aot_compile", [("85e4/rank_0_0/model", b"x")]),
                      ("vllm", "torch_compile_cache/torch_aot_compile", [("", b"a file where units go")]),
                      ("vllm", "startup_plan", [("startup_plan_x.json", b"{}")])])
    assert node_caches.install(caches, new, KEY) == node_caches.InstalledCaches(0, 0, 3)
    assert contents(new) == {}


def test_a_peer_offers_whole_settled_regular_units_within_its_limit(tmp_path):
    peer = filled(tmp_path / "peer", PEER_FILES)
    new = node_caches.cache_dirs(cache_env(tmp_path / "new"))
    secret = tmp_path / "secret"
    secret.write_text("not a cache file")
    (peer["triton"] / "LINKED").mkdir()
    (peer["triton"] / "LINKED" / "kernel.cubin").symlink_to(secret)
    (peer["triton"] / "LINKED-FOLDER").symlink_to(tmp_path, target_is_directory=True)
    (peer["triton"] / "FIFO").mkdir()
    os.mkfifo(peer["triton"] / "FIFO" / "kernel.cubin")  # read, it would block for ever

    every = exported(peer, new)
    assert {(u.cache, u.name) for u in every.units} == {
        ("vllm", "startup_plan/startup_plan_0123456789abcdef.json"), ("vllm", "torch_compile_cache/5f3a"),
        ("vllm", "torch_compile_cache/torch_aot_compile/85e4"),
        ("vllm", "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"), ("triton", "Q2XK")}
    assert node_caches.export(peer, node_caches.manifest(new), KEY).units == ()  # all written just now
    for file in (f for root in peer.values() for f in root.rglob("*") if f.is_file() and not f.is_symlink()):
        os.utime(file, (time.time() - 100, time.time() - 100))
    newest = peer["vllm"] / "torch_compile_cache/5f3a/rank_0_0/backbone/artifact"
    os.utime(newest, (time.time() - 50, time.time() - 50))
    limited = exported(peer, new, max_bytes=6000)  # newest first, whole units only, within the limit
    assert [(u.name, len(u.files)) for u in limited.units][:1] == [("torch_compile_cache/5f3a", 2)]
    assert sum(len(f.data) for u in limited.units for f in u.files) <= 6000
    assert ("triton", "Q2XK") not in {(u.cache, u.name) for u in limited.units}  # 10 kB: over what is left


TWO_NODES = textwrap.dedent("""
    import asyncio, json, os, shutil, signal, sys, tempfile, time
    from pathlib import Path
    from engine.environment import use_ray
    from security.credentials import ClusterCredentials
    use_ray(ClusterCredentials.load().ray_auth_env(), loopback=True)
    import ray
    from ray.cluster_utils import Cluster
    from deploy.node_caches import CacheCourier, CachePeer, EngineKind
    from deploy.ray_head import private_ray_root
    from engine.config import EngineConfig
    from engine.host import EngineHost

    envs = json.loads(sys.argv[1])
    temp_dir = tempfile.mkdtemp(prefix="caches-", dir=private_ray_root())  # not the shared /tmp/ray
    # Cluster writes "the current cluster" at RAY_TMPDIR/ray: here, not where a later ray.init() looks
    os.environ["RAY_TMPDIR"] = temp_dir
    os.mkdir(os.path.join(temp_dir, "ray"))
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False, "temp_dir": temp_dir}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"a": 1}, "env_vars": envs["a"]})
    try:
        cluster.add_node(**node, resources={"b": 1}, env_vars=envs["b"])
        ray.init(address=cluster.address, namespace="pdc-node-caches", log_to_driver=False)
        config = EngineConfig(model=Path(sys.argv[2]), served_model_name="tiny", keep_host_weights=False)
        ours = ClusterCredentials.generate()

        def engine(name, node, credentials=ours):
            return ray.remote(EngineHost).options(num_cpus=0, resources={node: 0.1}).remote(
                config, name, host="127.0.0.1", keys=credentials.engine_host_keys(name))

        peer, beside, dead, frozen = (engine(name, "a") for name in ("peer", "beside", "dead", "frozen"))
        ray.get(dead.node_id.remote())
        ray.kill(dead)
        frozen_pid = ray.get(frozen.__ray_call__.remote(lambda host: os.getpid()))
        os.kill(frozen_pid, signal.SIGSTOP)  # a peer that never answers
        stranger = engine("stranger", "a", ClusterCredentials.generate())  # another cluster's: signs with its key
        new, also_new = engine("new", "b"), engine("also-new", "b")
        courier = CacheCourier(timeout_s=60, step_timeout_s=5)

        async def steps():
            kind = EngineKind("tiny", "colocated", 1)

            def bring(courier, engine, peers):
                return courier.bring(engine, kind, [CachePeer(peer, kind) for peer in peers], 60)

            beside_got = await bring(CacheCourier(timeout_s=60, step_timeout_s=5), beside, [peer])
            # `courier`'s first bring asks its peers in the order given: the frozen one first
            both = await asyncio.gather(bring(courier, new, [frozen, dead, stranger, beside, peer]),
                                        bring(courier, also_new, [peer]))
            nothing_new = await bring(courier, new, [peer])
            unit = Path(envs["a"]["TRITON_CACHE_DIR"], "NEW")
            unit.mkdir()
            (unit / "kernel.cubin").write_bytes(b"new")
            os.utime(unit / "kernel.cubin", (time.time() - 60, time.time() - 60))
            return [beside_got, *both, nothing_new, await bring(courier, new, [peer])]
        print(json.dumps([None if r is None else [r.units, r.bytes, r.refused] for r in asyncio.run(steps())]))
    finally:
        os.kill(frozen_pid, signal.SIGCONT)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
""")


def test_a_new_engines_node_asks_the_peers_of_its_kind_first_and_new_nodes_start_apart():
    """A peer of another model, role or size offers units too (its kernels, its own compile), and
    the first peer that sends any ends the bring: the peers of the engine's kind are asked, alone,
    while any is ready, else those of its model; each bring starts one further along them, so new
    nodes do not all ask the first."""
    decode, prefill = EngineKind("model-a", "decode", 1), EngineKind("model-a", "prefill", 1)
    other_model, other_size = EngineKind("model-b", "decode", 1), EngineKind("model-a", "decode", 2)
    peers = [CachePeer("a1", decode), CachePeer("b1", other_model), CachePeer("a2", decode), CachePeer("a3", decode),
             CachePeer("p1", prefill)]
    assert [peers_in_turn(peers, decode, turn) for turn in range(4)] == [
        ["a1", "a2", "a3"], ["a2", "a3", "a1"], ["a3", "a1", "a2"], ["a1", "a2", "a3"]]
    assert peers_in_turn(peers, prefill, 1) == ["p1"]
    assert peers_in_turn(peers, other_size, 1) == ["a2", "a3", "p1", "a1"]  # none of its size: its model's
    assert peers_in_turn(peers, EngineKind("model-c", "decode", 1), 0) == ["a1", "b1", "a2", "a3", "p1"]
    assert peers_in_turn([], decode, 3) == []


@pytest.mark.slow
def test_between_two_ray_nodes_a_new_node_gets_a_ready_peers_caches_once(tmp_path, tiny_model):
    a = filled(tmp_path / "a", PEER_FILES | NOT_SHIPPED)
    for file in (f for root in a.values() for f in root.rglob("*")):
        os.utime(file, (time.time() - 60, time.time() - 60), follow_symlinks=False)  # settled
    envs = {"a": cache_env(tmp_path / "a"), "b": cache_env(tmp_path / "b")}
    result = subprocess.run([sys.executable, "-c", TWO_NODES, json.dumps(envs), str(tiny_model)],
                            capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    beside, new, also_new, nothing_new, one_new = json.loads(result.stdout.strip().splitlines()[-1])
    assert beside is None  # a peer on its own node: the same caches already
    # past a frozen peer, a dead one and another cluster's (refused), from ours; one bring for two starts
    assert sorted([new, also_new], key=str) == [None, [5, sum(map(len, PEER_FILES.values())), 0]]
    assert nothing_new is None and one_new == [1, 3, 0]  # then only what it lacks
    assert contents(node_caches.cache_dirs(envs["b"])) == {**PEER_FILES, ("triton", "NEW/kernel.cubin"): b"new"}
