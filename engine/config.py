"""The typed configuration of one engine instance, validated before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlparse

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.engine_args import EngineArgs
from engine.environment import KV_HASH_SEED, is_cpu_build
from engine.quantization import check_served_right
from engine.role_spec import COLOCATED, Role, RoleSpec


def _checked_otlp_endpoint(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
        raise ValueError(f"{url!r} is not an OTLP/gRPC endpoint: give http(s)://HOST:PORT")
    if parsed.username or parsed.password or parsed.query:  # argv and logs show it
        raise ValueError("an OTLP endpoint takes no credentials; put them in OTEL_EXPORTER_OTLP_TRACES_HEADERS")
    return url


OtlpEndpoint = Annotated[str, AfterValidator(_checked_otlp_endpoint)]
"""Where OpenTelemetry spans go, over OTLP/gRPC: http(s)://HOST:PORT."""
NIXL_KV_LEASE_S = 120
"""EngineConfig.kv_lease_s's default: vLLM's own 30 s is shorter than a loaded prefill instance may
take to answer (RouterConfig.prefill_timeout_s)."""
MIN_KV_LEASE_S = 12
"""The shortest lease: the router's wait for the prefill (75% of it, prefill/handoff.py) and the
decode engine's first heartbeat (vLLM sends them every sixth of the lease at most) leave a twelfth
of it as slack, 1 s at 12 s."""


class KVHashing(BaseModel):
    """How KV blocks are named, which the engines (their prefix caches and KV events), the store
    (LMCache keys) and the router (its index) must agree on, or every hit turns into a miss: set
    here once, read by all of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(32, ge=1)
    """KV block size in tokens; vLLM's CPU attention takes only multiples of 32."""
    seed: str = KV_HASH_SEED
    """The root of every block-hash chain (engines run with PYTHONHASHSEED set to it)."""
    algorithm: str = "sha256"
    """vLLM's `prefix_caching_hash_algo` (its default), passed to every engine explicitly."""


class TensorParallel(BaseModel):
    """How many devices (GPUs of one node; cores on the CPU build) each engine of a pool spans,
    as vLLM's `--tensor-parallel-size`: its ranks run in the engine actor's process tree under
    vLLM's multiprocessing executor. Per pool: `every_pool`'s unless the role gives its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_pool: int = Field(1, ge=1)
    prefill: int | None = Field(None, ge=1)
    decode: int | None = Field(None, ge=1)

    def for_role(self, role: Role) -> int:
        own = {Role.PREFILL: self.prefill, Role.DECODE: self.decode}.get(role)
        return own or self.every_pool

    def check_pd(self, direct: bool, model: Path) -> None:
        """P/D through the store hands KV over per rank: a store chunk holds one rank's KV heads and
        its key names the TP size and rank (kvstore/lmcache_engine.py), so a decode rank of another
        TP size would find no chunk to load; refused rather than served by recomputing every prompt.
        Directly, vLLM's NixlConnector maps ranks of sizes that divide one another (a decode rank
        reads its heads from the prefill rank that holds them, or from several), except into a
        smaller decode pool from prefill ranks that hold copies of `model`'s KV heads (vLLM asserts
        against it in the handshake, nixl/base_worker.py `_validate_remote_agent_handshake`; its
        exemption for Mamba hybrids is not followed here: refused); other pairs refused."""
        prefill, decode = self.for_role(Role.PREFILL), self.for_role(Role.DECODE)
        if prefill == decode:
            return
        if not direct:
            raise ValueError(f"prefill engines of tensor-parallel size {prefill} cannot hand KV to decode engines "
                             f"of size {decode} through the store: each rank stores and loads its own KV heads; "
                             "give both pools the same size, or hand KV over directly (--kv-transfer direct)")
        if max(prefill, decode) % min(prefill, decode):
            raise ValueError(f"prefill and decode tensor-parallel sizes {prefill} and {decode}: for direct KV "
                             "transfers one must divide the other (vLLM's NixlConnector splits KV heads between ranks)")
        if prefill > decode and replicates_kv_heads(model, prefill):
            raise ValueError(f"prefill engines of tensor-parallel size {prefill} hold copies of the model's KV heads "
                             f"(more ranks than heads), which vLLM's NixlConnector cannot read into decode engines "
                             f"of size {decode}")


class EngineConfig(BaseModel):
    """How to build one vLLM engine. Every field maps to a vLLM argument or a setting of ours."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path
    """Folder of a Hugging Face checkpoint (safetensors, config, tokenizer)."""
    served_model_name: str
    """The name clients put in `model`; also the name in vLLM's metrics."""
    role: RoleSpec = COLOCATED
    """What the instance does (engine/role_spec.py: its flags, environment, KV connector)."""
    max_model_len: int = Field(4096, ge=16)
    """Longest prompt plus completion, in tokens."""
    kv_hashing: KVHashing = KVHashing()
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The weights' and activations' type; auto: the checkpoint's (float32 makes a recomputed
    prefix equal to one computed step by step, tokens and all: tests/e2e/test_migration.py)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs (fast starts; slower steps on a GPU)."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """Host memory for the KV cache on the CPU build (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of GPU memory vLLM may take on a CUDA build."""
    gpu_share: float = Field(1.0, gt=0, le=1)
    """Share of a GPU Ray reserves for this engine: 1/K lets K engines (of several models) share one
    GPU; their memory is then gpu_memory_utilization's business, and sleep's."""
    sleep_mode: bool = False
    """CUDA only: the engine can sleep (vLLM's sleep mode, level 2: weights' and KV cache's memory
    given back): a standby sleeps once started, a ready engine when its pool puts it to sleep
    (EngineHost.sleep), and either wakes on activation. It offers no weights to peers (its memory,
    mapped by vLLM's CuMemAllocator, has no CUDA IPC handle): they load from another peer or disk."""
    cpu_cores: str | None = None
    """Cores the CPU build binds its threads to ("1", "2-3"); None lets vLLM choose."""
    gpu_ids: str | None = None
    """CUDA_VISIBLE_DEVICES of an engine started outside Ray ("0", "1"); None: what the process
    has (Ray sets it for the GPUs it placed the engine's actor on)."""
    kv_events: bool = False
    """Publish KV events (blocks stored and removed) on the engine's address, for every router of
    the cluster to subscribe to (engine/kv_event_publisher.py)."""
    kv_store_endpoints: tuple[str, ...] = ()
    """The KV store's shards (their control sockets, tcp://host:port; one per node): every
    instance then saves the prompts it computes to the LMCache-backed store (kvstore/) and loads
    what it holds, each chunk on the shard its key hashes to: prefill and decode instances hand KV
    over that way, colocated ones share prefixes. Empty: P/D hands KV directly from prefill to
    decode with vLLM's NixlConnector; colocated instances share nothing."""
    kv_store_timeout_s: float = Field(5.0, gt=0)
    """Longest one store call (lookup, read, write) may take before it counts as a miss."""
    kv_lease_s: int = Field(NIXL_KV_LEASE_S, ge=MIN_KV_LEASE_S)
    """P/D direct (no store): how long a prefill instance keeps a prompt's KV for the decode
    instance to read (vLLM NixlConnector's `kv_lease_duration`; the decode's heartbeats extend it
    once it has the request). A read after it ends is not an error: it returns whatever the blocks
    hold by then. The engine's description carries it (`direct_kv_lease_s`), and the router waits
    for its prefills only part of it (prefill/handoff.py)."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Longest a start may take before the instance is declared failed."""
    keep_host_weights: bool = True
    """Keep a host copy of the checkpoint (shared memory) that new instances can read from this
    one instead of from disk; costs the checkpoint's size in host memory per instance."""
    weights_dir: Path = Path("/dev/shm")
    """Folder of that host copy: shared memory, so peers on the node map it without a copy."""
    weight_transfer_timeout_s: float = Field(60.0, gt=0)
    """Longest a weight transfer from a peer may take before the instance falls back to disk."""
    log_dir: Path | None = None
    """Folder (on the engine's node) where each engine writes all its vLLM server printed, as
    <instance id>.log; None keeps only the last lines in memory (shown when a start fails)."""
    otlp_traces_endpoint: OtlpEndpoint | None = None
    """Export vLLM's request spans (`llm_request`, joined to the router's trace by the
    `traceparent` it sends) over OTLP/gRPC there; None exports none."""
    structured_migration: bool = False
    """Load the logits processor that continues a migrated structured stream in its grammar's
    state (engine/grammar_continuation.py). Off by default: vLLM 0.26 on CUDA runs any engine with
    a custom logits processor on its V1 model runner, not V2 (0.86x decode throughput at batch 128
    on an H200, docs/routing.md); without it such streams end with an error event when their
    engine dies, as any stream that cannot migrate."""
    tensor_parallel: TensorParallel = TensorParallel()
    """Devices per engine, per pool (`pdcluster serve --tensor-parallel-size`)."""
    engine_args: EngineArgs = EngineArgs()
    """vLLM serve flags the user gave the engine's pool (`pdcluster serve --engine-arg`), after ours:
    none the cluster owns (engine/engine_args.py)."""

    @property
    def runs_kv_connector(self) -> bool:
        """P/D roles always; a colocated engine when it shares a store (serve --shared-store)."""
        return self.role.kv_transfer or bool(self.kv_store_endpoints)

    @property
    def runs_nixl(self) -> bool:
        """It hands KV over directly with vLLM's NixlConnector: a P/D role without a store."""
        return self.runs_kv_connector and not self.kv_store_endpoints

    @property
    def direct_kv_lease_s(self) -> int | None:
        """How long it holds a prompt's KV for a decode engine's NIXL reads; None where it hands
        none over that way."""
        return self.kv_lease_s if self.runs_nixl else None

    @property
    def block_size(self) -> int:
        return self.kv_hashing.block_size

    @property
    def tensor_parallel_size(self) -> int:
        """This engine's devices: its role's pool's size."""
        return self.tensor_parallel.for_role(self.role.kind)

    @property
    def num_gpus(self) -> float:
        """GPUs Ray reserves for the engine's actor, all on one node (one actor's resources are
        one bundle): its share of one GPU, or a whole GPU per rank."""
        return self.gpu_share * self.tensor_parallel_size

    @model_validator(mode="after")
    def _shares_whole_gpus_only(self) -> EngineConfig:
        spans = max(self.tensor_parallel.for_role(role) for role in Role)
        if self.gpu_share < 1 and spans > 1:
            raise ValueError("engines sharing a GPU (--engines-per-gpu) span one device: "
                             "tensor parallelism needs whole GPUs")
        return self

    @model_validator(mode="after")
    def _served_right_when_quantized(self) -> EngineConfig:
        args = self.engine_args
        check_served_right(self.model, args.every_pool + args.prefill + args.decode, is_cpu_build())
        return self

    @field_validator("model")
    @classmethod
    def _model_folder_exists(cls, path: Path) -> Path:
        if not (path / "config.json").is_file():
            raise ValueError(
                f"{path} holds no config.json; build a model with `pdcluster model tiny|smollm2`"
            )
        return path.resolve()


def replicates_kv_heads(model: Path, tensor_parallel_size: int) -> bool:
    """Whether ranks of `tensor_parallel_size` hold copies of `model`'s KV heads (more ranks than KV
    heads), as vLLM reads the checkpoint's config (its attribute names per architecture, the text
    model's of a multimodal one). MLA's latent KV is the same on every rank by design: not counted."""
    import vllm.config  # noqa: F401  (the convertor module imports itself through it)
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    config = get_config(str(model), trust_remote_code=False)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(config.model_type, ModelArchConfigConvertorBase)(
        config, get_hf_text_config(config))
    return not convertor.is_deepseek_mla() and tensor_parallel_size > convertor.get_total_num_kv_heads()
