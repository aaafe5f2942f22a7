"""vLLM engine arguments given to `pdcluster serve` (`--engine-arg`) reach the engines, and one that
vLLM's parser accepts but its engine fails on fails the serve with vLLM's error, in the serve
output and the start log, without a hang."""

from __future__ import annotations

import json

import httpx
import pytest

from loadtest.local_cluster import LocalServer

pytestmark = pytest.mark.slow


def test_an_engine_argument_reaches_the_engine_and_its_refusals_reach_the_client(served, served_max_logprobs):
    # the router takes top_logprobs up to 20; the engine, given --max-logprobs, fewer
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    allowed = httpx.post(f"{served.url}/v1/chat/completions", json=body | {"top_logprobs": served_max_logprobs},
                         timeout=60)
    assert allowed.status_code == 200, allowed.text
    refused = httpx.post(f"{served.url}/v1/chat/completions", json=body | {"top_logprobs": served_max_logprobs + 1},
                         timeout=60)
    assert refused.status_code == 400, refused.text
    assert f"greater than max allowed: {served_max_logprobs}" in refused.json()["error"]["message"]


def test_an_argument_the_engine_fails_on_fails_the_serve_with_vllms_error(artifacts, tmp_path):
    start_log = tmp_path / "starts.jsonl"
    server = LocalServer(["--model", "tiny", "--engine-arg=--max-num-seqs=0", "--start-log", str(start_log)],
                         artifacts / "serve-bad-engine-arg.log", start_timeout_s=300)
    with pytest.raises(RuntimeError, match="pdcluster serve exited"):
        server.start()
    server.stop()
    vllms_error = "max_num_seqs"  # vLLM's SchedulerConfig refuses 0 when the engine builds its config
    output = server.log_path.read_text()
    assert "pdcluster serve failed" in output and vllms_error in output
    failed = [json.loads(line) for line in start_log.read_text().splitlines()]
    assert [entry["path"] for entry in failed] == ["failed"]
    assert vllms_error in failed[0]["error"]
