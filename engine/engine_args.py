"""vLLM's engine arguments that a user gives a pool's engines (`pdcluster serve --engine-arg`):
refused where the cluster owns the flag, and checked by vLLM's own argument parser before any
engine starts, so a bad flag or value fails `serve` at once with vLLM's message.

The check runs vLLM's parser in a child process (`python -m engine.engine_args`, the arguments
as JSON on stdin): importing it takes seconds and most of vLLM, which the serving process
otherwise never loads. It is only paid when engine arguments are given.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from engine.environment import is_cpu_build
from engine.quantization import QUANTIZATION_CONFIG, online_refusal
from engine.role_spec import Role

_ROUTER_AGREES = "the router and the store hash prompts as the engines do: "
OWNED_FLAGS: dict[str, str] = {
    "model": "pdcluster serve --model",
    "served-model-name": "pdcluster serve --served-model-name",
    "tokenizer": "the checkpoint's own tokenizer (the router hashes prompts with it)",
    "chat-template": "the checkpoint's own template (the router renders chats with it to find their cached "
                     "prefix): put the template in the checkpoint's tokenizer_config.json",
    "host": "the engine's host (it binds the engine's socket itself)",
    "port": "the engine's host (it binds the engine's socket itself)",
    "uds": "the engine's host (it binds the engine's socket itself)",
    "api-key": "the cluster's credentials (every engine has its own)",
    "ssl-keyfile": "the engine's TLS identity, made from the cluster's secret",
    "ssl-certfile": "the engine's TLS identity, made from the cluster's secret",
    "ssl-ca-certs": "the engine's TLS identity, made from the cluster's secret",
    "ssl-cert-reqs": "the engine's TLS identity, made from the cluster's secret",
    "max-model-len": "pdcluster serve --max-model-len (the router refuses longer prompts by it)",
    "block-size": _ROUTER_AGREES + "the cluster's KV hashing sets it",
    "prefix-caching-hash-algo": _ROUTER_AGREES + "the cluster's KV hashing sets it",
    "enable-prefix-caching": _ROUTER_AGREES + "every engine caches prefixes",
    "load-format": "the weight plane (engines start with dummy weights and are given theirs)",
    "worker-extension-cls": "the weight plane's worker extension",
    "middleware": "the engine's access check",
    "logits-processors": "pdcluster serve --structured-migration",
    "kv-transfer-config": "the pool's role and pdcluster serve --kv-transfer",
    "kv-events-config": "the router's KV events",
    "additional-config": "the engine's startup plan",
    "enable-server-load-tracking": "the router's load counting",
    "dtype": "pdcluster serve --dtype",
    "enforce-eager": "pdcluster serve --no-eager",
    "gpu-memory-utilization": "pdcluster serve --gpu-memory-utilization",
    "enable-sleep-mode": "pdcluster serve --sleep-when-idle / --sleeping-standbys",
    "otlp-traces-endpoint": "pdcluster serve --otlp-traces-endpoint",
    "tensor-parallel-size": "pdcluster serve --tensor-parallel-size (per pool: --prefill-/--decode-tensor-parallel-size), "
                            "which the pool's placement reserves devices by",
    "pipeline-parallel-size": "the pool's placement: an engine spans one node's devices, by --tensor-parallel-size",
    "distributed-executor-backend": "the engine's host (vLLM's multiprocessing executor runs an engine's ranks "
                                    "in its actor's process tree)",
    "data-parallel-size": "the pool's placement: more engines are more instances (--instances, --prefill, --decode)",
}
"""Flags the cluster sets on every engine, and what sets them."""


def flag_name(arg: str) -> str | None:
    """The flag `arg` names as vLLM reads it ("--max_num_seqs=8" -> "max-num-seqs", a JSON
    option's "--kv-transfer-config.kv_role" -> "kv-transfer-config"); None for a value."""
    if not arg.startswith("--"):
        return None
    name = arg[2:].partition("=")[0].partition(".")[0].replace("_", "-")
    return name.removeprefix("no-") if name.removeprefix("no-") in OWNED_FLAGS else name


class EngineArgs(BaseModel):
    """vLLM serve flags that a user gives the engines, per pool: `every_pool`'s to each engine,
    then its role's own (colocated engines take `every_pool`'s only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_pool: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()

    @field_validator("every_pool", "prefill", "decode")
    @classmethod
    def _not_owned(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        for arg in args:
            name = flag_name(arg)
            if name in OWNED_FLAGS:
                raise ValueError(f"--{name} is the cluster's to set ({OWNED_FLAGS[name]}); it cannot be an engine argument")
        return args

    @classmethod
    def from_flags(cls, every_pool: list[str], prefill: list[str], decode: list[str]) -> EngineArgs:
        """From `--engine-arg` values, each one flag with or without its value ("--max-num-seqs=64",
        "--tool-call-parser hermes"), split as a shell would."""
        def split(values: list[str]) -> tuple[str, ...]:
            return tuple(arg for value in values for arg in shlex.split(value))
        return cls(every_pool=split(every_pool), prefill=split(prefill), decode=split(decode))

    def for_role(self, role: Role) -> tuple[str, ...]:
        return self.every_pool + {Role.PREFILL: self.prefill, Role.DECODE: self.decode}.get(role, ())

    def check(self, model: Path, roles: list[Role]) -> None:
        """Parse each role's arguments with vLLM's own parser; raise ValueError with vLLM's
        message for each set it refuses. Free when none are given."""
        sets = sorted({tuple(self.for_role(role)) for role in roles} - {()})
        if found := refusals(model, [list(s) for s in sets]):
            raise ValueError("vLLM refuses the engine arguments: " + "; ".join(found))


def refusals(model: Path, sets: list[list[str]], timeout_s: float = 300.0) -> list[str]:
    """What vLLM's parser (in a child process) refuses of each set of `vllm serve` arguments, one
    line per refused set, naming it; empty when it takes them all."""
    if not sets:
        return []
    request = json.dumps({"model": str(model), "sets": sets})
    try:
        done = subprocess.run([sys.executable, "-m", "engine.engine_args"], input=request, text=True,
                              capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"vLLM's argument parser did not answer within {timeout_s:g} s"]
    try:  # the last line: vLLM's imports may print before it
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return [f"vLLM's argument parser failed: {(done.stderr.strip() or 'no output').splitlines()[-1]}"]


def vllm_serve_cli() -> tuple[Callable, Callable]:
    """vLLM's `make_arg_parser` and `validate_parsed_serve_args` of `vllm serve`, wherever this
    vLLM keeps them."""
    try:  # vLLM 0.32 (the CPU build)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:  # vLLM 0.26 (the gpu extra's)
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    return make_arg_parser, validate_parsed_serve_args


def _vllm_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser, raising ArgumentError instead of exiting."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, _ = vllm_serve_cli()

    class Parser(FlexibleArgumentParser):
        def error(self, message: str):
            raise argparse.ArgumentError(None, message)

    return make_arg_parser(Parser())


def _refusal(parser: argparse.ArgumentParser, defaults: dict, model: str, args: list[str]) -> str | None:
    """vLLM's refusal of `args`, or the owned flag they set; None if it takes them. What they
    change is judged on the parsed values, so an abbreviation of an owned flag ("--max-model=8")
    is caught too."""
    _, validate_parsed_serve_args = vllm_serve_cli()
    try:
        parsed = parser.parse_args(["--model", model, *args])
        validate_parsed_serve_args(parsed)
    except Exception as exc:  # vLLM's checks raise ArgumentError, ValueError, TypeError, KeyError...
        return f"{shlex.join(args)}: {exc}"
    changed = {dest.replace("_", "-") for dest, value in vars(parsed).items() if defaults.get(dest) != value}
    owned = sorted(changed & OWNED_FLAGS.keys())
    if owned:
        return f"{shlex.join(args)}: --{owned[0]} is the cluster's to set ({OWNED_FLAGS[owned[0]]})"
    online = ([parsed.quantization] if "quantization" in changed else []) + \
        ([QUANTIZATION_CONFIG] if QUANTIZATION_CONFIG.removeprefix("--") in changed else [])
    if refusal := online_refusal(online, is_cpu_build()):
        return f"{shlex.join(args)}: {refusal}"
    return None


if __name__ == "__main__":
    asked = json.loads(sys.stdin.read())
    vllms = _vllm_parser()
    defaults = vars(vllms.parse_args(["--model", asked["model"]]))
    found = [_refusal(vllms, defaults, asked["model"], args) for args in asked["sets"]]
    print(json.dumps([refusal for refusal in found if refusal]))
