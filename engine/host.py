"""EngineHost: owns one vLLM OpenAI server process and its lifecycle.

The host runs inside a Ray actor (`EngineActor`), so Ray places it (GPUs, role resources) and
the router finds it by handle; tokens flow over HTTPS straight from the vLLM server to the router,
not through Ray. The host binds the server's socket on the node's address and hands it to the
process it starts, gives each process an identity of its own (a TLS certificate and token,
security/engine_access.py) and publishes its sealed endpoint, follows its log to time each
start-up stage, sends a warm-up request before it reports READY, answers health checks and stops
the whole process group on `stop()` or when the actor dies (PR_SET_PDEATHSIG).

Every engine is built with `load_format=dummy` and gets its weights afterwards through the weight
plane (engine/weights.py, engine/worker_extension.py): from a warm peer when one is named, else
from disk. So one engine can wait as a STANDBY (process, runtime, KV cache and graphs ready, no
weights) and `activate()` in well under a second when capacity is needed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import time
from pathlib import Path

from engine import node_caches
from engine.config import EngineConfig
from engine.environment import (
    COMPILE_KEY_PLUGIN,
    KV_EVENTS_PLUGIN,
    RANK_CORES_PLUGIN,
    is_cpu_build,
    listening_socket,
)
from engine.lifecycle import EngineDescription, EngineStartError, InstanceState, StartTimeline
from engine.process import group_shared_memory, spawn_group, terminate_group
from engine.server_api import ServerAPI
from engine.server_command import (
    LISTEN_FD_ENV,
    compile_key_plugin_installed,
    kv_events_plugin_installed,
    rank_cores_plugin_installed,
    server_command,
    server_env,
)
from engine.server_output import ServerOutput
from engine.weights import PeerWeights, new_weights_file, remove_orphaned_weights
from security.credentials import ClusterCredentials, EngineHostKeys
from security.engine_access import EngineAccess, EngineEndpoint, open_endpoint
from transport.address import node_address

log = logging.getLogger(__name__)

START_ATTEMPTS = 3
"""Starts tried before one fails for a port in use: vLLM binds some ports itself (the NIXL side
channel of `--kv-transfer direct`), which another process may hold; each try draws new ones."""


class SleepRefused(RuntimeError):
    """The engine could not keep a host copy of its weights: it stays awake and ready."""


class EngineHost:
    """One vLLM server process. Methods are async so a Ray actor serves them concurrently."""

    def __init__(self, config: EngineConfig, instance_id: str, host: str | None = None,
                 keys: EngineHostKeys | None = None):
        """`keys`: the instance's, derived from the cluster's secret (the launcher's); without, keys
        of a secret of its own, which shut out everyone but this host (`access`)."""
        self.config = config
        self.instance_id = instance_id
        self.host = host or node_address()
        self.keys = keys or ClusterCredentials.generate().engine_host_keys(instance_id)
        self._listener: socket.socket | None = listening_socket(self.host)
        self.port: int = self._listener.getsockname()[1]
        self.endpoint: EngineEndpoint | None = None
        """Where the current server process serves, and its certificate (sealed): what a router needs."""
        self.access: EngineAccess | None = None
        """This host's own way into that process."""
        self.weights_file = new_weights_file(config.weights_dir) if config.keep_host_weights else None
        """Where the engine keeps the host copy of its weights that its node's peers may map."""
        if config.keep_host_weights:
            remove_orphaned_weights(config.weights_dir)
        self.state = InstanceState.STOPPED
        self.timeline = StartTimeline()
        self.weights_record: dict = {}
        self._process: subprocess.Popen[str] | None = None
        self._shared_memory: set[Path] = set()
        """vLLM's shared-memory files that the server's process group maps (engine/process.py)."""
        self._output: ServerOutput | None = None

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def node_id(self) -> str | None:
        """The Ray node this instance runs on (None outside Ray): the launcher keeps a KV store
        shard on every node that hosts an engine."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def prove(self, nonce: str) -> str:
        """That this actor is the cluster's engine (a launcher adopts only engines that prove it)."""
        return self.keys.prove(nonce)

    def describe(self) -> EngineDescription:
        """What the router, a launcher and the progress table need to know about this instance."""
        return EngineDescription(
            instance_id=self.instance_id, role=self.config.role.kind, model=str(self.config.model),
            served_model_name=self.config.served_model_name, max_model_len=self.config.max_model_len,
            state=self.state, url=self.url, endpoint=self.endpoint,
            kv_events_endpoint=self._output.kv_events_endpoint if self._output else None,
            kv_events_replay_endpoint=self._output.kv_events_replay_endpoint if self._output else None,
            pid=self._process.pid if self._process else None,
            exited=self._process is not None and self._process.poll() is not None,
            last_stage=self.timeline.marks[-1][0] if self.timeline.marks else "",
            elapsed_s=time.time() - self.timeline.started_at,
            tensor_parallel_size=self.config.tensor_parallel_size, kv_store=bool(self.config.kv_store_endpoints),
            kv_lease_s=self.config.direct_kv_lease_s,
        )

    async def preimport(self) -> dict:
        """Start the server process only up to its imports (engine/preimport.py): it holds no GPU
        memory and waits as PREIMPORTED until `start()` or `activate()`. Returns the timeline."""
        self._check_startable()
        self.timeline = StartTimeline()
        self.state = InstanceState.LOADING
        self._launch()

        async def imported() -> None:
            while not any(stage == "preimport" for stage, _ in self.timeline.marks):
                if self._process is None or self._process.poll() is not None:
                    raise EngineStartError("the vLLM server process exited during its imports")
                await asyncio.sleep(0.05)
            self.state = InstanceState.PREIMPORTED

        await self._guarded(imported(), self.config.start_timeout_s, "pre-import")
        return self.timeline.as_record()

    async def start(self, standby: bool = False, peer: PeerWeights | None = None) -> dict:
        """Start the server (or let a PREIMPORTED one go on) and wait for /health. Then, unless
        `standby`, load the weights (from `peer`, a descriptor of `export_weights()`, else from
        disk) and send a warm-up request. Returns the timeline. A start that fails for a port in
        use is tried again (START_ATTEMPTS in all), from a new process."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return await self._start_once(standby, peer)
            except EngineStartError as exc:
                if attempt == START_ATTEMPTS or "Address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    async def _start_once(self, standby: bool, peer: PeerWeights | None) -> dict:
        preimported = self.state == InstanceState.PREIMPORTED
        if not preimported:
            self._check_startable()
        self.timeline = StartTimeline()
        self.state = InstanceState.LOADING
        if not preimported:
            self._launch()

        async def bring_up() -> None:
            assert self._process is not None and self._process.stdin is not None
            self._process.stdin.write("start\n")  # engine/preimport.py goes on from its imports
            self._process.stdin.flush()
            await self._wait_until_healthy()
            self._shared_memory = group_shared_memory(self._process.pid)  # removed at stop, even if killed
            # every peer of the worker's distributed groups has connected: no one else may
            sealed = await self._server.worker_call("pdc_seal_listeners", {}, timeout_s=30)
            self.timeline.details["sealed_listeners"] = sum(len(rank["sealed_ports"]) for rank in sealed)
            prepared = await self._server.worker_call("pdc_prepare_transfers", {}, timeout_s=60)
            self.timeline.details["checksum_warmup_s"] = round(max(rank["seconds"] for rank in prepared), 4)
            if standby:
                # Lazy first-request work does not depend on the weights: pay it now, not on activation.
                await self._server.warm_up()
                self.state = InstanceState.STANDBY
                if self.config.sleep_mode:
                    await self._server.post("/sleep", {"level": "2"})  # weights and KV cache: none to keep
                    self.timeline.mark("sleep")
                    self.state = InstanceState.SLEEPING
            else:
                await self._load_and_warm(peer)

        await self._guarded(bring_up(), self.config.start_timeout_s, "start")
        return self.timeline.as_record()

    def _check_startable(self) -> None:
        if self.state not in (InstanceState.STOPPED, InstanceState.FAILED):
            raise EngineStartError(f"{self.instance_id} is {self.state.value}; cannot start")
        if self.config.sleep_mode and (is_cpu_build() or self.config.runs_kv_connector):
            # A KV connector registers the KV cache's memory, which sleep unmaps.
            raise EngineStartError("sleep mode needs a CUDA GPU and no KV connector "
                                   "(a colocated role without a shared store)")
        if self.config.kv_events and not kv_events_plugin_installed():
            raise EngineStartError(f"vLLM's plugin {KV_EVENTS_PLUGIN} is not installed (reinstall pdcluster): "
                                   "vLLM's own KV event publisher would serve the engine's prompts to anyone")
        if self.config.runs_nixl and is_cpu_build() and not rank_cores_plugin_installed():
            log.warning("vLLM's plugin %s is not installed (reinstall pdcluster): %s will compute on the node's "
                        "last core, not on its own", RANK_CORES_PLUGIN, self.instance_id)
        if not self.config.enforce_eager and not compile_key_plugin_installed():
            log.warning("vLLM's plugin %s is not installed (reinstall pdcluster): %s keys its compile by its "
                        "own port and cores, and no other start will read it", COMPILE_KEY_PLUGIN, self.instance_id)

    def _launch(self) -> None:
        """The server process, with the engine's whole environment and a new identity, on the
        socket this host bound (handed over, then closed here: once the process is gone its port
        refuses connections), stopped after its imports until a line on its stdin
        (engine/preimport.py)."""
        listener = self._listener or listening_socket(self.host)
        self._listener, self.port = None, listener.getsockname()[1]
        keys = self.keys.new_process(self.host)
        self.endpoint = self.keys.endpoint(keys, self.url)
        self.access = open_endpoint(self.keys.engine_key, self.endpoint)
        env = server_env(self.config, self.host, self.instance_id, keys, self.weights_file)
        env[LISTEN_FD_ENV] = str(listener.fileno())
        command = server_command(self.config, self.host, self.port, self.instance_id)
        with listener:
            self._popen(command, env, listener.fileno())

    def _popen(self, command: list[str], env: dict[str, str], listener_fd: int) -> None:
        self._process = spawn_group(command, env, (listener_fd,))
        log_path = self.config.log_dir / f"{self.instance_id}.log" if self.config.log_dir is not None else None
        self._output = ServerOutput(self._process, log_path, lambda: self.timeline, self.config.kv_events)

    async def activate(self, peer: PeerWeights | None = None) -> dict:
        """Turn a standby (awake, asleep or only imported) into a READY instance: started if only
        imported, its memory back if it sleeps, weights (from `peer`, else the host copy a ready
        engine kept when it went to sleep, else disk), a warm-up request. Returns the
        activation's timeline."""
        if not self.state.is_standby:
            raise EngineStartError(f"{self.instance_id} is {self.state.value}, not standby")
        if self.state == InstanceState.PREIMPORTED:
            return await self.start(peer=peer)
        self.timeline = StartTimeline()

        async def wake_and_load() -> None:
            if self.state == InstanceState.SLEEPING:
                # All tags at once: the weights' memory comes back empty and is filled next; the
                # KV cache's is needed by the warm-up anyway.
                await self._server.post("/wake_up", {})
                self.timeline.mark("wake_up")
            await self._load_and_warm(peer)

        await self._guarded(wake_and_load(), self.config.start_timeout_s, "activation")
        return self.timeline.as_record()

    async def sleep(self) -> dict:
        """Put a ready engine to sleep (vLLM's sleep mode, level 2; the caller drained it first):
        it keeps a pinned host copy of its weights (made at its first sleep: 7-9 s for 16 GB on an
        H200, since the pinned allocation is slow; the copy is made on the engine's step loop, so
        not while it serves), gives back all GPU memory but ~2 GiB, and `activate()` wakes it with
        a peer's weights or that copy. Raises SleepRefused, the engine still awake and ready, if
        the host copy fails; any other failure stops the engine (it may be half asleep). Returns
        the timeline."""
        if self.state not in (InstanceState.READY, InstanceState.DRAINING) or not self.config.sleep_mode:
            raise EngineStartError(f"{self.instance_id} is {self.state.value} (sleep mode: "
                                   f"{self.config.sleep_mode}); only a ready engine in sleep mode sleeps")
        timeline = StartTimeline()
        self.state = InstanceState.DRAINING  # no health check calls it ready halfway
        try:
            ranks = await self._server.worker_call("pdc_keep_host_copy", {}, timeout_s=self.config.start_timeout_s)
        except Exception as exc:
            self.state = InstanceState.READY
            raise SleepRefused(f"{self.instance_id} keeps no host copy of its weights: {exc}") from None
        timeline.mark("host_copy")
        try:
            await self._server.post("/sleep", {"level": "2"})
        except Exception:
            self.state = InstanceState.FAILED
            await asyncio.to_thread(self._terminate, 5)
            raise
        timeline.mark("sleep")
        self.state = InstanceState.SLEEPING
        timeline.details.update(host_copy_bytes=sum(rank["bytes"] for rank in ranks),
                                host_copy_made=str(any(rank["copied"] for rank in ranks)))
        return timeline.as_record()

    def set_draining(self, draining: bool) -> None:
        """Out of rotation (its launcher drains it) or back: what `describe()` tells every router."""
        if draining and self.state == InstanceState.READY:
            self.state = InstanceState.DRAINING
        elif not draining and self.state == InstanceState.DRAINING:
            self.state = InstanceState.READY

    async def requests_in_flight(self) -> int:
        """Requests the engine runs or queues, whichever router sent them (vLLM's own gauges)."""
        return await self._server.requests_in_flight()

    async def export_weights(self, use_nixl: bool = True, offer_file: bool = True) -> PeerWeights:
        """How a peer reads this instance's weights (shared memory on this node unless not
        `offer_file`, NIXL anywhere): a descriptor per rank, signed with the cluster's weights key
        (a CPU engine's ranks all offer rank 0's host copy)."""
        if self.state != InstanceState.READY:
            raise EngineStartError(f"{self.instance_id} is {self.state.value}; no weights to offer")
        request = {"use_nixl": use_nixl, "offer_file": offer_file}
        ranks = await self._server.worker_call("pdc_export_weights", request, timeout_s=30)
        return PeerWeights(self.instance_id, tuple(rank or ranks[0] for rank in ranks))

    async def cache_manifest(self) -> node_caches.CacheManifest:
        """What this node's start caches hold (engine/node_caches.py; the engine's are this
        process's, whose environment it inherits): a ready peer elsewhere sends the rest."""
        return await asyncio.to_thread(node_caches.manifest, node_caches.cache_dirs(os.environ))

    async def export_caches(self, wanted_by: node_caches.CacheManifest) -> node_caches.NodeCaches | None:
        return await asyncio.to_thread(node_caches.export, node_caches.cache_dirs(os.environ), wanted_by,
                                       self.keys.weights_key)

    async def install_caches(self, caches: node_caches.NodeCaches) -> node_caches.InstalledCaches:
        return await asyncio.to_thread(node_caches.install, caches, node_caches.cache_dirs(os.environ),
                                       self.keys.weights_key)

    async def _guarded(self, work, timeout_s: float, what: str) -> None:
        """Run a start-up step; on failure or timeout stop the process and raise with its log."""
        try:
            await asyncio.wait_for(work, timeout_s)
        except Exception as exc:
            self.state = InstanceState.FAILED
            await asyncio.to_thread(self._terminate, 5)
            reason = (
                "timed out (raise EngineConfig.start_timeout_s)"
                if isinstance(exc, asyncio.TimeoutError)
                else str(exc)
            )
            tail = "\n".join(self.log_tail()[-40:])
            raise EngineStartError(f"{self.instance_id} {what} failed: {reason}\n{tail}") from None
        if not self.state.is_standby:
            self.state = InstanceState.READY

    async def _load_and_warm(self, peer: PeerWeights | None) -> None:
        self.state = InstanceState.LOADING
        peers, unusable = self._peer_ranks(peer)
        request = {"peers": peers, "timeout_s": self.config.weight_transfer_timeout_s}
        ranks = await self._server.worker_call("pdc_load_weights", request, self.config.start_timeout_s)
        self.weights_record = record = ranks[0]
        # the checksum of what a peer sent is its own stage (the slowest rank's)
        self.timeline.mark_split("weights", "weights_checksum", max(rank.get("verify_s", 0.0) for rank in ranks))
        source = record["source"] + (f"/{record['transport']}" if "transport" in record else "")
        self.timeline.details.update(weights_source=source, weights_bytes=record["bytes"])
        if len(ranks) > 1:  # each rank loads its own shard: where each one's came from, and when
            self.timeline.details["weights_ranks"] = "; ".join(
                f"{r}: {rank['source']}/{rank.get('transport', 'read')} {rank['total_s']:.2f} s"
                for r, rank in enumerate(ranks))
        fallbacks = [rank["fallback_reason"] for rank in ranks if rank["fallback_reason"]]
        if unusable or fallbacks:
            self.timeline.details["weights_fallback_reason"] = unusable or fallbacks[0]
        await self._server.post("/reset_prefix_cache", {})  # blocks cached before the weights hold wrong KV
        self.state = InstanceState.WARMING
        await self._server.warm_up()
        self.timeline.mark("warmup_request")

    def _peer_ranks(self, peer: PeerWeights | None) -> tuple[list[dict] | None, str | None]:
        """Each rank's descriptor of `peer`, or none and why: shards (CUDA) go rank to rank and
        need a peer of this engine's size; a whole checkpoint's host copy serves every rank."""
        size = self.config.tensor_parallel_size
        if peer is None:
            return None, None
        if not peer.sharded:
            return [peer.ranks[0]] * size, None
        if peer.tensor_parallel_size != size:
            return None, (f"peer {peer.instance_id} has tensor-parallel size {peer.tensor_parallel_size}, "
                          f"this engine {size}: its ranks hold other shards")
        return list(peer.ranks), None

    def log_tail(self) -> list[str]:
        """The last lines the current vLLM server process printed."""
        return list(self._output.tail) if self._output else []

    async def _wait_until_healthy(self) -> None:
        assert self._process is not None
        await self._server.wait_until_healthy(self._process.poll)
        self.timeline.mark("api_server")

    async def stop(self, grace_s: float = 10.0) -> EngineDescription:
        """Stop the server: SIGTERM to its process group, SIGKILL after `grace_s`."""
        if self.state != InstanceState.STOPPED:
            self.state = InstanceState.DRAINING
            await asyncio.to_thread(self._terminate, grace_s)
            self.state = InstanceState.STOPPED
        return self.describe()

    def _terminate(self, grace_s: float) -> None:
        try:
            if self._process is not None:
                terminate_group(self._process, grace_s, self._shared_memory)
                self._shared_memory = set()
        finally:
            if self.weights_file is not None:
                self.weights_file.unlink(missing_ok=True)

    @property
    def _server(self) -> ServerAPI:
        """The current server process's API."""
        if self.access is None:
            raise EngineStartError(f"{self.instance_id} has no server process")
        return ServerAPI(self.url, self.access, self.config.served_model_name)
