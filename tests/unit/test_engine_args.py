"""engine/engine_args.py: the vLLM flags a user gives a pool's engines reach those engines' command
lines after ours, never replace what the cluster sets, and a bad one fails `pdcluster serve` at
once with vLLM's own message, before any engine starts."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from decode.role import DECODE
from engine.config import EngineConfig
from engine.engine_args import OWNED_FLAGS, EngineArgs, refusals
from engine.role_spec import COLOCATED, Role
from engine.server_command import server_command
from prefill.role import PREFILL


@pytest.mark.parametrize("arg", ["--max-model-len=8", "--max_model_len=8", "--dtype float16",
                                 "--kv-transfer-config.kv_role kv_both", "--no-enable-prefix-caching",
                                 "--port=9", "--api-key=mine", "--load-format safetensors"])
def test_a_flag_the_cluster_sets_is_refused_naming_what_sets_it(arg):
    with pytest.raises(ValidationError) as refused:
        EngineArgs.from_flags([arg], [], [])
    name = arg[2:].split("=")[0].split(" ")[0].split(".")[0].replace("_", "-").removeprefix("no-")
    assert OWNED_FLAGS[name] in str(refused.value)


def test_each_pool_gets_every_pools_flags_then_its_own_after_the_clusters(tiny_model):
    args = EngineArgs.from_flags(["--max-num-seqs=64", "--tool-call-parser hermes"], ["--max-num-batched-tokens=512"],
                                 ["--max-num-seqs 8"])
    assert args.every_pool == ("--max-num-seqs=64", "--tool-call-parser", "hermes")
    config = EngineConfig(model=tiny_model, served_model_name="tiny", engine_args=args)
    commands = {role.kind: server_command(config.model_copy(update={"role": role}), "127.0.0.1", 8000, "e-0")
                for role in (COLOCATED, PREFILL, DECODE)}
    assert commands[Role.COLOCATED][-3:] == ["--max-num-seqs=64", "--tool-call-parser", "hermes"]
    assert commands[Role.PREFILL][-4:] == ["--max-num-seqs=64", "--tool-call-parser", "hermes",
                                           "--max-num-batched-tokens=512"]
    # the decode pool's own value comes last: vLLM's parser keeps the last
    assert commands[Role.DECODE][-2:] == ["--max-num-seqs", "8"]


@pytest.mark.slow  # seconds: vLLM's parser is imported in a child process, once for every set
def test_vllms_parser_refuses_each_bad_set_with_its_own_message_and_takes_good_ones(tiny_model):
    refused = {  # set -> vLLM's message, or ours for an owned flag vLLM's parser expanded
        "--max-num-seqs=abc": "invalid int value: 'abc'",
        "--no-such-flag": "unrecognized arguments: --no-such-flag",
        "--enable-auto-tool-choice": "--enable-auto-tool-choice requires --tool-call-parser",
        "--max-model=8": "--max-model-len is the cluster's to set",
        "-tp 2": "--tensor-parallel-size is the cluster's to set",
        # judged on the parsed values too, where an abbreviation would pass our own reading
        "--quantization-config.linear fp8_per_token": "online quantization --quantization-config is not verified",
    }
    taken = ["--enable-auto-tool-choice --tool-call-parser hermes", "--max-num-seqs=4"]
    found = refusals(tiny_model, [shlex.split(s) for s in [*refused, *taken]])
    assert len(found) == len(refused), found
    for (flags, message), refusal in zip(refused.items(), found, strict=True):
        assert refusal.startswith(flags) and message in refusal, refusal


@pytest.mark.slow
def test_serve_with_a_bad_engine_flag_fails_at_once_and_starts_nothing(tiny_model, tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--model", str(tiny_model),
                           "--secret-file", str(tmp_path / "secret"), "--engine-arg=--max-num-seqs=abc"],
                          capture_output=True, text=True, timeout=300)
    output = " ".join((done.stdout + done.stderr).split())  # the console wraps long lines
    assert done.returncode == 2, output
    assert "vLLM refuses the engine arguments: --max-num-seqs=abc: argument --max-num-seqs: invalid int value: 'abc'" in output
    assert "Ray" not in output
    print(f"refused in {time.monotonic() - started:.1f} s")


def test_pool_flags_on_a_colocated_topology_are_refused(tiny_model, tmp_path):
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--model", str(tiny_model),
                           "--secret-file", str(tmp_path / "secret"), "--prefill-engine-arg=--max-num-seqs=4"],
                          capture_output=True, text=True, timeout=120)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert "--prefill-engine-arg and --decode-engine-arg are for a P/D topology" in output
