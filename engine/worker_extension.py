"""Methods pdcluster adds to every vLLM worker (`--worker-extension-cls`), called through vLLM's
`/collective_rpc` endpoint: load weights into a running engine from disk or from a warm peer, and
offer this worker's weights to peers.

An engine of ours starts with `load_format=dummy` (everything but the weights is built: runtime,
KV cache, graphs) and then gets its weights here, through vLLM's in-place `reload_weights`, which
keeps every tensor's address (captured CUDA graphs stay valid). Two planes:

- CPU build: checkpoint tensors in a host buffer (engine/weights.py): shared memory on the node,
  NIXL across nodes; vLLM re-runs its weight processing (the CPU build repacks linear weights
  outside the parameters, so only checkpoint tensors can travel).
- CUDA: the peer's live parameters, opened by CUDA IPC and copied device to device (same GPU or
  over NVLink) into ours in kernel format, checked with on-device checksums; the disk path streams
  safetensors through pinned slots to the device. An engine that sleeps keeps a pinned host copy
  of its parameters (`pdc_keep_host_copy`) and wakes from it when no peer offers its weights:
  one host-to-device copy at the link's speed, no weight processing.

Tied layers: vLLM's in-place reload re-processes a layer once its own checkpoint tensors have
arrived. A layer whose parameters are another layer's (the output head tied to the input
embeddings) receives none, so state derived from its weights is not rebuilt: on the CPU build the
head keeps multiplying by a copy packed from the dummy weights, and the engine answers nonsense.
`reprocess_tied_layers` rebuilds it after every checkpoint-format reload (docs/conformance.md).

Tensor parallelism: the endpoint calls every rank's worker with the same arguments and returns
their results in rank order. On CUDA each rank offers and loads its own shard (kernel format, rank
r from the peer's rank r, which the signed descriptor names); from disk each rank reads the
checkpoint one tensor at a time in host memory and keeps its shard. On the CPU build rank 0 keeps
the host copy of the whole checkpoint that peers are offered; every rank of a new engine takes its
shard from it (mapped, on the peer's node; across nodes each rank reads it over NIXL, rank 0 into
its own host copy, the others into memory they drop once loaded).

Arguments and results are JSON, as the endpoint passes only strings.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import time
from pathlib import Path

from engine.checkpoint import host_tensors, read_from_disk, stream_to_device
from engine.cuda_ipc import IpcTensor
from engine.quantization import keep_int8_handle_scales
from engine.weights import (
    WEIGHTS_DIR_ENV,
    WEIGHTS_FILE_ENV,
    WeightExporter,
    WeightIntegrityError,
    WeightSet,
    WeightTransferError,
    check_signature,
    fetch_from_peer,
    model_id,
    sign,
)
from security.credentials import EngineKeys
from transport.listener_warden import seal_tcp_listeners
from transport.nixl import quiet_progress_threads

# vLLM loads this module when it builds the worker, before the worker's KV connector makes its
# NIXL agents: from here on they do not spin a core each (transport/nixl.py says why).
if importlib.util.find_spec("nixl") is not None:
    quiet_progress_threads()


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) in this worker process.
    vLLM 0.32's CPU attention picks its AMX kernel wherever the CPU has AMX but never asks for
    it; until something else does (oneDNN does, for GEMMs large enough to use AMX), its first
    tile instruction kills the worker with SIGILL: a small model's first short prompt did, on
    every start (docs/conformance.md)."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()


_allow_amx()
keep_int8_handle_scales()  # before this worker's first in-place reload of an int8 checkpoint


@functools.cache
def _weights_key() -> str:
    """The cluster's weights key, from the keys the engine's host put in this process's
    environment."""
    return EngineKeys.load().weights_key


def _tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _tensor_parallel_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def _own_file() -> Path | None:
    return Path(os.environ[WEIGHTS_FILE_ENV]) if os.environ.get(WEIGHTS_FILE_ENV) else None


def _node_host() -> str:
    return os.environ.get("VLLM_HOST_IP", "127.0.0.1")


def reprocess_tied_layers(model) -> list[str]:
    """Re-run weight processing on every layer that shares a parameter with another layer; returns
    their names. Only unquantized embeddings and heads are known to be safe to process twice: a
    quantized tied layer raises rather than serve weights nobody checked."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list] = {}
    for name, module in model.named_modules():
        for parameter in module.parameters(recurse=False):
            holders.setdefault(id(parameter), []).append((name, module))
    reprocessed: list[str] = []
    for name, module in {n: m for group in holders.values() if len(group) > 1 for n, m in group}.items():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if not isinstance(method, UnquantizedEmbeddingMethod):
            raise WeightTransferError(f"{name} shares its weights with another layer and is processed by "
                                      f"{type(method).__name__}: reloading it in place is not supported")
        method.process_weights_after_loading(module)
        reprocessed.append(name)
    return reprocessed


class WeightPlaneExtension:
    """Mixed into vLLM's worker class by vLLM itself; `self` is the worker."""

    _pdc_weights: WeightSet | None = None
    _pdc_exporter: WeightExporter | None = None
    _pdc_host_params: dict | None = None

    def pdc_load_weights(self, request_json: str) -> dict:
        """Load weights from `peers` (signed descriptors of a peer's `pdc_export_weights`, one per
        rank: this rank's is used) or, when there are none or that fails, from disk. Returns where
        they came from and what each step took."""
        request = json.loads(request_json)
        record: dict = {"source": "disk", "fallback_reason": None}
        started = time.perf_counter()
        import torch

        with torch.no_grad():  # vLLM's in-place reload copies into parameters
            if request.get("peers"):
                try:
                    record.update(self._pdc_load_from_peer(request["peers"], float(request.get("timeout_s", 60.0))))
                except Exception as exc:  # any failure of the peer path: disk rewrites every weight
                    record["fallback_reason"] = f"{type(exc).__name__}: {exc}"
            if record["source"] == "disk" and self._pdc_host_params is not None:
                record.update(self._pdc_load_from_host())
            if record["source"] == "disk":
                record.update(self._pdc_load_from_disk())
        record["total_s"] = time.perf_counter() - started
        return record

    def pdc_export_weights(self, request_json: str) -> dict | None:
        """A signed descriptor peers pass to `pdc_load_weights`: CUDA IPC handles of the
        parameters on a GPU, this worker's host copy on the CPU build (rank 0's: the others,
        None, share it)."""
        request = json.loads(request_json)
        if self._pdc_on_cuda():
            return self._pdc_ipc_descriptor()
        if _tensor_parallel_rank() > 0:
            return None
        if self._pdc_weights is None:
            raise RuntimeError("this worker keeps no host copy of its weights to offer")
        if self._pdc_exporter is None:
            self._pdc_exporter = WeightExporter(self._pdc_weights, _node_host(), _weights_key())
        return self._pdc_exporter.descriptor(bool(request.get("use_nixl", True)), bool(request.get("offer_file", True)))

    def pdc_keep_host_copy(self, request_json: str) -> dict:
        """Copy this worker's parameters, as they serve (kernel format), into pinned host memory,
        before the engine sleeps: what it wakes from when no peer offers weights. Its weights
        never change while it lives, so only the first call copies."""
        import torch

        if not self._pdc_on_cuda():
            raise RuntimeError("a host copy to wake from is for CUDA engines (the CPU build has no sleep mode)")
        started = time.perf_counter()
        copied = self._pdc_host_params is None
        if copied:
            self._pdc_host_params = {
                name: torch.empty_like(t, device="cpu", pin_memory=True).copy_(t)
                for name, t in self._pdc_parameters().items()
            }
        nbytes = sum(t.numel() * t.element_size() for t in self._pdc_host_params.values())
        return {"copied": copied, "bytes": nbytes, "seconds": time.perf_counter() - started}

    def pdc_seal_listeners(self, request_json: str = "{}") -> dict:
        """Make this worker's TCP listeners whose peers have all connected take no connection
        again (transport/listener_warden.py): its torch.distributed groups' (a gloo listener
        each, the TCPStore's on every address), which keep every connection a stranger closed and
        end the process at its descriptor limit. Called by the engine's host once the engine
        serves. Returns the sealed ports."""
        return {"sealed_ports": seal_tcp_listeners()}

    def pdc_prepare_transfers(self, request_json: str = "{}") -> dict:
        """Pay the first use of the weight checksum now, while the engine waits, not on the first
        activation or export it verifies: on CUDA, Triton's import and the kernel's compile (0.6-0.7 s
        of the first activation on the H200, 0.04-0.06 s afterwards). It runs over this engine's
        own parameters (dummy or real: the values do not matter), so every shape, dtype and
        specialization a transfer will meet has run once (a small region of each kind left the
        first activation's checksum at 0.20 s on the H200)."""
        started = time.perf_counter()
        if self._pdc_on_cuda():
            from engine.device_checksum import region_checksum

            for tensor in self._pdc_parameters().values():
                region_checksum(tensor)
        return {"seconds": time.perf_counter() - started}

    def pdc_release_weights(self) -> None:
        """Drop the host copy (and stop offering it)."""
        if self._pdc_exporter is not None:
            self._pdc_exporter.close()
        elif self._pdc_weights is not None:
            self._pdc_weights.close()
        self._pdc_exporter = self._pdc_weights = None

    # --- the two planes ---------------------------------------------------------------------

    def _pdc_on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _pdc_model_dir(self) -> Path:
        return Path(self.vllm_config.model_config.model)

    def _pdc_load_from_disk(self) -> dict:
        started = time.perf_counter()
        if self._pdc_on_cuda() and _tensor_parallel_size() > 1:
            sizes: list[int] = []

            def counted():  # one tensor in host memory at a time, its shard copied, then dropped
                for name, tensor in host_tensors(self._pdc_model_dir()):
                    sizes.append(tensor.numel() * tensor.element_size())
                    yield name, tensor

            self._pdc_reload(counted())
            read, nbytes = started, sum(sizes)
        elif self._pdc_on_cuda():
            tensors = stream_to_device(self._pdc_model_dir(), self.device)
            read = time.perf_counter()
            self._pdc_reload(iter(tensors))
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            del tensors  # the staging device buffer
        else:
            own_file = self._pdc_release_own_file()
            weights = read_from_disk(self._pdc_model_dir(), own_file)
            read = time.perf_counter()
            self._pdc_reload(weights.tensors())
            nbytes = weights.manifest.total_bytes
            self._pdc_keep(weights if own_file is not None else None)
        return {"source": "disk", "read_s": read - started, "reload_s": time.perf_counter() - read,
                "bytes": nbytes}

    def _pdc_load_from_peer(self, peers: list[dict], timeout_s: float) -> dict:
        if len(peers) != _tensor_parallel_size():
            raise WeightTransferError(f"{len(peers)} descriptors for {_tensor_parallel_size()} ranks")
        peer = peers[_tensor_parallel_rank()]
        if peer.get("kind") == "cuda_ipc":
            return self._pdc_load_ipc(peer)
        own_file = self._pdc_release_own_file()
        weights, fetched = fetch_from_peer(
            peer, model_id(self._pdc_model_dir()), _weights_key(), _node_host(),
            Path(os.environ.get(WEIGHTS_DIR_ENV, "/dev/shm")), timeout_s, own_file=own_file,
        )
        started = time.perf_counter()
        self._pdc_reload(weights.tensors())
        reloaded = time.perf_counter() - started
        self._pdc_keep(weights)
        return {"source": "peer", "transport": fetched.transport, "transfer_s": fetched.transfer_s,
                "verify_s": fetched.verify_s, "reload_s": reloaded, "bytes": fetched.nbytes}

    def _pdc_load_from_host(self) -> dict:
        """The parameters back from the pinned host copy into the same device addresses (vLLM's
        wake-up maps its weights' memory where it was; level-2 sleep restores the buffers itself)."""
        import torch

        started = time.perf_counter()
        params = self._pdc_parameters()
        if params.keys() != self._pdc_host_params.keys():
            raise WeightIntegrityError("the host copy does not name this model's parameters")
        for name, host in self._pdc_host_params.items():
            params[name].copy_(host, non_blocking=True)
        torch.cuda.synchronize(self.device)
        nbytes = sum(t.numel() * t.element_size() for t in self._pdc_host_params.values())
        return {"source": "host", "transfer_s": time.perf_counter() - started, "bytes": nbytes}

    def _pdc_reload(self, tensors) -> None:
        """vLLM's in-place reload of checkpoint tensors, then the tied layers it leaves stale."""
        self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
        reprocess_tied_layers(self.model_runner.get_model())

    def _pdc_keep(self, weights: WeightSet | None) -> None:
        self.pdc_release_weights()
        if weights is not None and _tensor_parallel_rank() > 0:  # rank 0's copy is the engine's
            weights.close()
            weights = None
        self._pdc_weights = weights

    def _pdc_release_own_file(self) -> Path | None:
        """This worker's weights file, free to be created afresh (a previous copy is dropped, and
        what a failed transfer left of one: the disk fallback creates the file again); None on
        ranks past the first, which keep no copy."""
        self.pdc_release_weights()
        if _tensor_parallel_rank() > 0 or (own := _own_file()) is None:
            return None
        own.unlink(missing_ok=True)
        return own

    def _pdc_parameters(self) -> dict:
        return {name: p.data for name, p in self.model_runner.get_model().named_parameters()}

    def _pdc_ipc_descriptor(self) -> dict:
        from engine.device_checksum import region_checksum

        if self.vllm_config.model_config.enable_sleep_mode:
            # Its memory is mapped by vLLM's CuMemAllocator, which the driver gives no IPC handle
            # (seen on the H200: cudaErrorInvalidValue); peers load from another peer or disk.
            raise WeightTransferError("an engine in sleep mode cannot offer its weights over CUDA IPC")

        params = self._pdc_parameters()
        described = {
            "kind": "cuda_ipc", "host": _node_host(), "model_id": model_id(self._pdc_model_dir()),
            "rank": _tensor_parallel_rank(), "tensor_parallel_size": _tensor_parallel_size(),
            "tensors": {n: dataclasses.asdict(IpcTensor.of(t)) for n, t in params.items()},
            "checksums": {n: list(region_checksum(t)) for n, t in params.items()},
        }
        return described | {"signature": sign(_weights_key(), described)}

    def _pdc_load_ipc(self, peer: dict) -> dict:
        import torch

        from engine.device_checksum import region_checksum

        check_signature(_weights_key(), peer)
        mine = (_tensor_parallel_rank(), _tensor_parallel_size())
        if (peer.get("rank"), peer.get("tensor_parallel_size")) != mine:
            raise WeightTransferError(f"the peer's descriptor is rank {peer.get('rank')} of "
                                      f"{peer.get('tensor_parallel_size')}, this worker rank {mine[0]} of {mine[1]}")
        if peer["host"] != _node_host():
            raise WeightTransferError("CUDA IPC reaches only peers on this node")
        if peer["model_id"] != model_id(self._pdc_model_dir()):
            raise WeightTransferError("the peer holds another model")
        started = time.perf_counter()
        handles = {name: IpcTensor.from_json(raw) for name, raw in peer["tensors"].items()}
        opened = [(name, handle.open()) for name, handle in handles.items()]
        self.reload_weights(weights_iterator=iter(opened), is_checkpoint_format=False)
        torch.cuda.synchronize(self.device)
        copied = time.perf_counter()
        expected = {n: tuple(v) for n, v in peer["checksums"].items()}
        mine = {n: region_checksum(t) for n, t in self._pdc_parameters().items()}
        bad = [n for n in expected if mine.get(n) != expected[n]]
        if bad or mine.keys() != expected.keys():
            raise WeightIntegrityError(
                f"{len(bad)} parameters differ from the peer's after the copy: {bad[:3]}"
            )
        nbytes = sum(t.numel() * t.element_size() for _, t in opened)
        return {"source": "peer", "transport": "cuda_ipc", "transfer_s": copied - started,
                "verify_s": time.perf_counter() - copied, "bytes": nbytes}
