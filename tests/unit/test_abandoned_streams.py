"""A client that leaves before its stream's first byte (its timeout shorter than the time to the
first token) gives everything back (router/streaming.py): its admission slot, the instance's
request count, the engine's connection. Starlette cancels a streamed response whose client is
already gone before its body ever starts, so the body's own clean-up cannot be relied on: the
response runs it. Once as Starlette calls a response (the disconnect already known), once with
a real router and a stand-in engine (named so) over HTTP on loopback; no vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from engine.environment import free_port
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import AppStandIn
from router.app import build_app
from router.config import RouterConfig, ServedModel

KEY = "sk-abandoning-client"
FIRST_BYTE_S = 1.0


def stand_in_engine() -> Starlette:
    """Streams a completion whose first event takes FIRST_BYTE_S; the router forwards from there."""

    async def completions(request) -> StreamingResponse:
        await request.body()

        async def events():
            await asyncio.sleep(FIRST_BYTE_S)
            yield b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
            await asyncio.sleep(0.05)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@contextlib.contextmanager
def serving(app, port: int) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


async def test_a_response_whose_client_is_gone_before_it_starts_still_cleans_up():
    from router.streaming import EngineStream

    ran, cleaned = [], []

    async def body():
        try:
            ran.append("started")
            yield b"data: x\n\n"
        finally:
            cleaned.append("by the body")

    async def gone() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)  # a socket's write may wait (uvicorn drains a full buffer): cancelled there

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    abandoned = EngineStream(body(), abandon=lambda: cleaned.append("abandoned"))
    await abandoned(scope, gone, send)
    assert ran == [] and cleaned == ["abandoned"]  # the body never ran: the response cleaned up

    ran.clear(), cleaned.clear()
    stays = asyncio.Event()

    async def listening() -> dict:
        await stays.wait()  # the client stays until the body is done
        return {"type": "http.disconnect"}

    served = EngineStream(body(), abandon=lambda: cleaned.append("abandoned"))
    task = asyncio.create_task(served(scope, listening, send))
    await asyncio.sleep(0.1)
    stays.set()
    await task
    assert ran == ["started"] and cleaned == ["by the body"]  # once, by the body itself


def test_a_client_that_leaves_while_the_engine_computes_gives_its_slot_back():
    with AppStandIn(stand_in_engine(), "engine-0") as engine:
        registry = InstanceRegistry()
        instance = engine.instance()
        registry.add(instance)
        config = RouterConfig(models=(ServedModel(name="m", max_model_len=64),), health_interval_s=60,
                              api_keys={KEY: "t"}, max_concurrency_per_key=1, max_migrations=0)
        with serving(build_app(config, registry), free_port("127.0.0.1")) as router_url:
            body = {"model": "m", "prompt": "x", "stream": True}
            headers = {"Authorization": f"Bearer {KEY}"}
            try:  # leaves while the router waits for the engine's first byte
                httpx.post(f"{router_url}/v1/completions", json=body, headers=headers, timeout=FIRST_BYTE_S / 3)
            except httpx.TimeoutException:
                pass
            deadline = time.monotonic() + 3 * FIRST_BYTE_S
            while instance.inflight and time.monotonic() < deadline:
                time.sleep(0.05)
            assert instance.inflight == 0  # the instance's count is back
            again = httpx.post(f"{router_url}/v1/completions", json=body, headers=headers, timeout=10)
            assert again.status_code == 200, again.text  # not 429: the key's one slot is free again
