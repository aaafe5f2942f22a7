"""Colocated instances sharing the KV store (`serve --shared-store`) answer as plain vLLM does,
with a prompt one instance computed loaded from the store by the other."""

from __future__ import annotations

import pytest
from conftest import TINY_ENGINE_ARGS
from oracle import PROMPTS, ask, ask_all, differences
from transformers import AutoTokenizer

from engine.config import KVHashing
from engine.models import default_model_root
from loadtest.local_cluster import LocalServer
from loadtest.scrape import scrape_engine

pytestmark = [pytest.mark.slow, pytest.mark.oracles("tiny")]
HITS = "vllm:external_prefix_cache_hits_total"


def test_colocated_instances_sharing_the_store_answer_as_plain_vllm(oracle, artifacts):
    want = oracle("tiny")
    args = ["--model", "tiny", "--instances", "2", "--shared-store", "--policy", "round_robin",
            *(f"--engine-arg={a}" for a in TINY_ENGINE_ARGS)]
    with LocalServer(args, artifacts / "serve-conformance-shared-store.log") as server:
        engines = [server.engine_access(i["instance_id"]) for i in server.instances()]
        first = ask_all(server.url, "tiny")  # each prompt computed by one instance, and stored
        if len(PROMPTS) % 2 == 0:  # round robin then sends each prompt to the other instance
            ask(server.url, "tiny", PROMPTS["completion-short"])
        second, loaded = {}, {}
        for name, body in PROMPTS.items():
            hits = external_hits(engines)
            second[name] = ask(server.url, "tiny", body)
            loaded[name] = external_hits(engines) - hits
        found = differences(first, want) + differences(second, want)
        assert not found, "\n".join(found)
        # The long completion's KV came from the store: every whole block but the one holding its
        # last token, at least.
        prompt = AutoTokenizer.from_pretrained(default_model_root() / "tiny")(PROMPTS["completion-long"]["prompt"])
        block = KVHashing().block_size
        assert loaded["completion-long"] >= (len(prompt.input_ids) - 1) // block * block, loaded


def external_hits(engines) -> float:
    return sum(scrape_engine(engine, (HITS,)).get(HITS, 0.0) for engine in engines)
