"""router/analysis.py: a long prompt is tokenized in a process of the router's, with the same
tokens as on the event loop; a tokenizing process that dies costs a retry, not the router."""

from __future__ import annotations

import os
import signal

import pytest

from router.analysis import TOKENIZING_NICENESS, RequestAnalyzer
from router.config import RouterConfig, ServedModel
from router.errors import Overloaded
from router.openai_requests import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow  # seconds: each tokenizing process loads the tokenizer anew


@pytest.fixture(scope="module")
def analyzer(tiny_model):
    config = RouterConfig(models=(ServedModel(name="tiny", max_model_len=4096, tokenizer=tiny_model),))
    analyzer = RequestAnalyzer(config)
    analyzer.start()
    yield analyzer
    analyzer.close()


async def test_a_long_prompt_gets_the_tokens_it_would_get_on_the_event_loop(analyzer):
    text = "the river runs on " * 400  # well past INLINE_BYTES
    for request in (CompletionRequest(model="tiny", prompt=text),
                    ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": text}])):
        body_bytes = len(request.model_dump_json())
        assert body_bytes > RequestAnalyzer.INLINE_BYTES
        assert await analyzer._off_loop(request) == analyzer.token_ids(request)
        routed = await analyzer.analyze(request, body_bytes)
        assert routed.num_tokens == len(analyzer.token_ids(request))


async def test_a_long_prompt_sent_while_the_processes_start_waits_for_them_not_its_deadline(tiny_model):
    # A deadline far shorter than a process's start (a Python process loading a tokenizer: seconds).
    config = RouterConfig(models=(ServedModel(name="tiny", max_model_len=4096, tokenizer=tiny_model),),
                          tokenize_timeout_s=0.5)
    starting = RequestAnalyzer(config)
    starting.start()
    try:
        request = CompletionRequest(model="tiny", prompt="the river runs on " * 400)
        assert await starting._off_loop(request) == starting.token_ids(request)
    finally:
        starting.close()


async def test_a_tokenizing_process_that_dies_costs_one_retry(analyzer):
    request = CompletionRequest(model="tiny", prompt="the river runs on " * 400)
    await analyzer._off_loop(request)  # the process is up
    for pid in list(analyzer._pool._processes):  # killed, as an OOM killer would
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(Overloaded):
        await analyzer._off_loop(request)
    assert await analyzer._off_loop(request) == analyzer.token_ids(request)  # a new process serves


async def test_tokenizing_processes_yield_the_cpu_to_the_event_loop(analyzer):
    await analyzer._off_loop(CompletionRequest(model="tiny", prompt="the river runs on " * 400))
    router = os.getpriority(os.PRIO_PROCESS, 0)
    assert router + TOKENIZING_NICENESS <= 19, "run the tests at a priority the processes can go below"
    assert analyzer._pool._processes
    for pid in analyzer._pool._processes:
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(router + TOKENIZING_NICENESS, 19)


async def test_a_router_without_a_tokenizer_routes_on_load_and_starts_no_process():
    """An operator who gives no tokenizer (routing on load only) pays no tokenizing process."""
    analyzer = RequestAnalyzer(RouterConfig(models=(ServedModel(name="m", max_model_len=64),)))
    analyzer.start()
    try:
        request = CompletionRequest(model="m", prompt="x" * (2 * RequestAnalyzer.INLINE_BYTES))
        routed = await analyzer.analyze(request, len(request.model_dump_json()))
        assert routed.block_hashes == () and not analyzer._pool._processes
    finally:
        analyzer.close()
