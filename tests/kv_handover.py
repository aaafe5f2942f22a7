"""That a P/D decode engine really got a prompt's KV from the prefill engine, from vLLM's own
metrics. vLLM counts external prefix hits when it schedules a request, before any read, and
recomputes whatever a failed read should have brought (`kv_load_failure_policy=recompute`): the
answers are then the oracle's own, so neither they nor the hits show that KV moved. Directly, the
NixlConnector's transfer metrics do."""

from __future__ import annotations

from oracle import PROMPTS
from transformers import AutoTokenizer
from waiting import until

from engine.config import KVHashing
from engine.models import default_model_root
from loadtest.scrape import scrape_engine
from security.engine_access import EngineAccess

HITS = "vllm:external_prefix_cache_hits_total"
NIXL_READS = "vllm:nixl_bytes_transferred_count"  # a histogram's count: one per read
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"  # reads, handshakes and notifications


def kv_counts(decode: EngineAccess) -> dict[str, float]:
    """The decode engine's counts, taken before the requests under test."""
    return scrape_engine(decode, (HITS, "vllm:nixl_"))


def assert_long_prompt_handed_over(decode: EngineAccess, before: dict[str, float], model: str, direct: bool,
                                   within_s: float = 30.0) -> None:
    """PROMPTS' long completion found every whole block but the one holding its last token outside
    the decode engine, and, `direct`, the engine read over NIXL with no read or handshake failed."""
    prompt = AutoTokenizer.from_pretrained(default_model_root() / model)(PROMPTS["completion-long"]["prompt"])
    block = KVHashing().block_size
    now = kv_counts(decode)
    assert now[HITS] - before.get(HITS, 0.0) >= (len(prompt.input_ids) - 1) // block * block
    if not direct:
        return

    def after_a_read() -> dict[str, float] | None:
        counts = kv_counts(decode)
        return counts if counts.get(NIXL_READS, 0.0) > before.get(NIXL_READS, 0.0) else None

    # The connector's stats reach vLLM's metrics with the engine core's next outputs.
    now = until(after_a_read, "a NIXL read counted", timeout_s=within_s, every_s=0.5)
    assert now.get(NIXL_FAILED, 0.0) == before.get(NIXL_FAILED, 0.0), now
