"""The flags of `pdcluster serve` and `pdcluster launch` (deploy/cli.py adds the parser; deploy/serve.py
reads what they set)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from engine.config import NIXL_KV_LEASE_S
from prefill.handoff import HANDOVER_LEASE_SHARE
from router.config import DEFAULT_CONCURRENCY_PER_KEY
from router.placement import DEFAULT_REMOTE_PREFILL_MIN_TOKENS
from router.policies import DEFAULT_REQUEST_COST_TOKENS


def env_default(name: str, default: str) -> str:
    """A flag's default from env PDCLUSTER_<name>, else `default`."""
    return os.environ.get(f"PDCLUSTER_{name}", default)


def add_serve_parser(subparsers, command, name: str = "serve", help: str = "serve a model through the OpenAI API"):
    """The parser of `pdcluster serve` (or `launch`, `name`), whose args go to `command`."""
    parser = subparsers.add_parser(name, help=help)
    _add_topology_flags(parser)
    _add_engine_flags(parser)
    _add_cold_start_flags(parser)
    _add_admission_flags(parser)
    _add_routing_flags(parser)
    _add_kv_store_flags(parser)
    _add_observability_flags(parser)
    parser.set_defaults(func=command)
    return parser


def _add_topology_flags(parser: argparse.ArgumentParser) -> None:
    """Which models, in which pools, on which Ray cluster."""
    parser.add_argument(
        "--model",
        default=env_default("MODEL", "smollm2"),
        help="tiny, smollm2, or a checkpoint folder; several, comma-separated, each get the pools the other "
        "flags describe and are served by their own names (env PDCLUSTER_MODEL)",
    )
    parser.add_argument("--served-model-name", help="name clients send (default: the model's; one model only)")
    parser.add_argument("--instances", type=int, default=1, help="colocated engine instances")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="colocated engines, each prefilling and decoding its own requests (the default without "
        "--prefill/--decode; --instances sets how many)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="prefill instances (P/D topology)")
    parser.add_argument("--decode", type=int, default=0, help="decode instances (P/D topology)")
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="join this Ray cluster instead of starting a head on loopback",
    )
    parser.add_argument(
        "--router-only",
        action="store_true",
        help="with --address: only a router more, for the engines another launcher on that cluster owns "
        "(it shares their KV events and the per-key limits; it starts and stops no engine)",
    )


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """What each engine is given, and how long its start may take."""
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--no-eager", action="store_true", help="allow compilation / CUDA graphs")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                        help="the engines' weights and activations (auto: the checkpoint's)")
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM serve flag for every engine, with its value (--engine-arg=--max-num-seqs=64, "
        "--engine-arg='--tool-call-parser hermes'); repeatable; checked by vLLM's own parser before any engine "
        "starts. Flags the cluster sets (model, ports, max model len, block size, dtype, ...) are refused",
    )
    parser.add_argument("--prefill-engine-arg", action="append", default=[], metavar="FLAG",
                        help="as --engine-arg, for the prefill pool's engines only (after --engine-arg's)")
    parser.add_argument("--decode-engine-arg", action="append", default=[], metavar="FLAG",
                        help="as --engine-arg, for the decode pool's engines only (after --engine-arg's)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="devices each engine spans (GPUs of one node; cores on the CPU build), as vLLM's flag")
    parser.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="as --tensor-parallel-size, for the prefill pool's engines (the decode pool's must match)")
    parser.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="as --tensor-parallel-size, for the decode pool's engines")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="per engine, once placed")
    parser.add_argument(
        "--placement-timeout",
        type=float,
        default=900.0,
        help="longest wait for Ray to place the engines (autoscaling included)",
    )


def _add_cold_start_flags(parser: argparse.ArgumentParser) -> None:
    """Standbys, sleeping engines, engines sharing a GPU, and when the pools grow."""
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        help="standby instances per pool (started without weights, activated in < 1 s)",
    )
    parser.add_argument(
        "--preimported",
        type=int,
        default=0,
        help="pre-imported server processes per pool (vLLM imported, no GPU memory held): a start from one "
        "skips the imports; used after the standbys",
    )
    parser.add_argument(
        "--sleeping-standbys",
        action="store_true",
        help="standbys sleep until activated (vLLM sleep mode; CUDA, colocated): ~2 GiB of GPU memory each",
    )
    parser.add_argument(
        "--sleep-when-idle",
        action="store_true",
        help="idle instances sleep instead of stopping, down to none awake for a model nobody asks for (weights "
        "kept in host memory, ~2 GiB of GPU memory held; CUDA, colocated); one wakes in well under a second "
        "when its model is asked for again",
    )
    parser.add_argument(
        "--max-awake",
        type=int,
        help="with --sleep-when-idle and --engines-per-gpu: instances awake at most, across the cluster (one GPU's "
        "worth); a request for a sleeping model puts an idle one of another model to sleep and wakes its own (a "
        "swap: ~0.5 s for an 8B on an H200, plus 7-9 s the first time an engine sleeps, for its host copy)",
    )
    parser.add_argument(
        "--engines-per-gpu",
        type=int,
        default=1,
        help="engines Ray places on one GPU (several models' engines sharing it; set --gpu-memory-utilization "
        "to what one awake engine may take)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of its GPU's memory one engine may take while awake (CUDA)")
    parser.add_argument(
        "--max-instances",
        type=int,
        default=0,
        help="ready instances per pool at most when scaling up (default: the initial count)",
    )
    parser.add_argument(
        "--target-ttft",
        type=float,
        default=None,
        help="grow the pool that prefills (prefill, else colocated) while the p90 time to first "
        "token of streamed requests over the last 30 s is above this (s)",
    )


def _add_admission_flags(parser: argparse.ArgumentParser) -> None:
    """Where the router listens, who may send it requests, and how many."""
    parser.add_argument("--host", default=env_default("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env_default("PORT", "8000")))
    parser.add_argument(
        "--secret-file",
        type=Path,
        help="the cluster's secret (default: env PDCLUSTER_SECRET, else ~/.config/pdcluster/secret, "
        "made by `pdcluster serve` when missing); every credential is derived from it",
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        help="a file of KEY:TENANT lines (or env PDCLUSTER_API_KEYS=KEY:TENANT,...); none: an open "
        "endpoint, on loopback only. Keys never go on the command line (`ps` shows it)",
    )
    parser.add_argument("--rate-limit", type=float, help="requests/s per API key")
    parser.add_argument("--max-concurrency-per-key", type=int,
                        help=f"requests in flight per API key (default with API keys: {DEFAULT_CONCURRENCY_PER_KEY})")
    parser.add_argument("--max-connections-per-address", type=int, default=1024,
                        help="client connections the router holds from one address (raise it behind a balancer)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="longest a client may take to send a request's headers (s)")
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="longest a request waits for an instance to become ready (s)",
    )


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """Where requests run: the policy, remote or local prefill, migrations."""
    parser.add_argument("--policy", default="kv_aware", help="routing policy (router.policies.POLICIES)")
    parser.add_argument(
        "--request-cost-tokens",
        type=float,
        default=DEFAULT_REQUEST_COST_TOKENS,
        help="kv_aware: what a request in flight on an instance costs a new one there, in prompt tokens "
        "computed (0: queued prefill work and cache hits alone decide)",
    )
    parser.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
        help="below this many uncached prompt tokens, decode prefills locally",
    )
    parser.add_argument(
        "--remote-prefill-max-queued-tokens",
        type=int,
        default=None,
        help="P/D: when the prefill instance has more prompt tokens queued, decode prefills locally "
        "(shorter TTFT while prefill is the bottleneck; decode steps wait behind those prefills)",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=1,
        help="times a stream whose engine died goes on from its sent tokens on another instance "
        "(0: it ends with an error event)",
    )
    parser.add_argument("--structured-migration", action="store_true",
                        help="streams under a grammar (JSON schema, regex...) migrate too; every engine then loads a "
                        "logits processor, which costs vLLM 0.26 on CUDA its V2 model runner (0.86x decode "
                        "throughput at batch 128 on an H200)")
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds without an event from an engine mid-stream before it counts as broken (and the stream "
        "goes on elsewhere)",
    )
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="longest wait for an engine's next bytes of an answer (s; raise it for very long "
                        "generations that stream nothing)")


def _add_kv_store_flags(parser: argparse.ArgumentParser) -> None:
    """How KV moves between instances: P/D's hand-over, the store shards, the shared store."""
    parser.add_argument(
        "--kv-transfer",
        choices=("store", "direct"),
        default=env_default("KV_TRANSFER", "store"),
        help="P/D: hand KV over through the LMCache-backed store shards, or directly prefill -> decode (NIXL)",
    )
    parser.add_argument(
        "--store-gib", type=float, default=2.0, help="host memory of each node's KV store shard"
    )
    parser.add_argument(
        "--shared-store",
        action="store_true",
        help="colocated instances too save the prompts they compute to the store shards and load what "
        "the store holds (a prefix one instance computed is fetched, not recomputed, by another); "
        "like P/D engines they then run vLLM's synchronous scheduler (no async scheduling)",
    )
    parser.add_argument("--store-timeout", type=float, default=5.0,
                        help="longest one KV store call (lookup, read, write) may take before it counts as a miss (s)")
    parser.add_argument("--kv-lease", type=int, default=NIXL_KV_LEASE_S,
                        help="P/D direct: how long a prefill instance keeps a prompt's KV for its decode instance "
                        f"(s); the router waits for a prefill at most {HANDOVER_LEASE_SHARE * 100:.0f}%% of it")


def _add_observability_flags(parser: argparse.ArgumentParser) -> None:
    """What a start, a request and an engine leave behind to look at."""
    parser.add_argument(
        "--start-log",
        type=Path,
        default=Path(env_default("START_LOG", "results/starts.jsonl")),
        help="one JSON line per engine start, stage by stage, or per failed start (path \"failed\", its error) "
        "(env PDCLUSTER_START_LOG)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        help="export one OpenTelemetry trace per request (the router's spans and the engines' vLLM "
        "spans) over OTLP/gRPC to http(s)://HOST:PORT; off by default",
    )
    parser.add_argument(
        "--engine-log-dir",
        type=Path,
        help="write each engine's whole vLLM output to DIR/<instance id>.log on its node",
    )
