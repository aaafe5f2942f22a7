"""GET /admin/instances lists, for each instance, the migratable streams the router relays from it
now (by the id their client sees, with the tokens sent so far), a migrated one under the instance
it went on to: how a fault run knows which streams its victim holds (loadtest.faults). A real
router and two stand-in engines (named so) over HTTP on loopback; no vLLM."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from test_abandoned_streams import serving

from engine.environment import free_port
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import AppStandIn
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)


def event(event_id: str, text: str, token_ids: list[int], finish: str | None = None,
          prompt: list[int] | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": token_ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    body = {"id": event_id, "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n".encode()


async def until(flag: threading.Event) -> None:
    while not flag.is_set():
        await asyncio.sleep(0.01)


def stand_in_engine(first_may_break: threading.Event, continuation_may_end: threading.Event,
                    continued: list[dict]) -> Starlette:
    """A first request (a text prompt) streams one token, then ends without [DONE] once
    `first_may_break` is set (a dead engine, as the router sees it); a continuation (token ids)
    streams one token, then its last once `continuation_may_end` is set."""

    async def completions(request) -> StreamingResponse:
        body = await request.json()

        async def first():
            yield event("cmpl-first", "a", [10], prompt=[1, 2, 3])
            await until(first_may_break)

        async def continuation():
            continued.append(body)
            yield event("cmpl-other", "b", [11], prompt=body["prompt"])
            await until(continuation_may_end)
            yield event("cmpl-other", "c", [12], finish="length")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(continuation() if isinstance(body["prompt"], list) else first(),
                                 media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_the_streams_an_instance_relays_are_listed_under_it_and_follow_a_migration():
    first_may_break, continuation_may_end, continued = threading.Event(), threading.Event(), []
    engine = stand_in_engine(first_may_break, continuation_may_end, continued)
    with AppStandIn(engine, "engine-a") as engine_a, AppStandIn(engine, "engine-b") as engine_b:
        registry = InstanceRegistry()
        for stand_in in (engine_a, engine_b):
            registry.add(stand_in.instance())
        config = RouterConfig(models=(ServedModel(name="m", max_model_len=64),), health_interval_s=60,
                              cluster_secret=CREDENTIALS.secret.hex())
        with serving(build_app(config, registry), free_port("127.0.0.1")) as router_url:

            def listed() -> dict[str, list[dict]]:
                answer = httpx.get(f"{router_url}/admin/instances", headers=CREDENTIALS.admin_headers(), timeout=5)
                return {i["instance_id"]: i["streams"] for i in answer.json()["instances"]}

            body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
            texts, ids = [], set()
            with httpx.stream("POST", f"{router_url}/v1/completions", json=body, timeout=10) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data: {"))

                def next_event() -> None:
                    got = json.loads(next(lines)[len("data: "):])
                    ids.add(got["id"])
                    texts.append(got["choices"][0]["text"])

                next_event()  # "a", from whichever instance took it
                during = listed()
                (first,) = [name for name, streams in during.items() if streams]
                assert during[first] == [{"id": "cmpl-first", "tokens_sent": 1}], during
                first_may_break.set()
                next_event()  # "b": the continuation, on the other instance, under the first stream's id
                during = listed()
                (other,) = {"engine-a", "engine-b"} - {first}
                assert during == {first: [], other: [{"id": "cmpl-first", "tokens_sent": 2}]}, during
                continuation_may_end.set()
                next_event()
            assert texts == ["a", "b", "c"] and ids == {"cmpl-first"}
            assert continued[0]["prompt"] == [1, 2, 3, 10] and continued[0]["max_tokens"] == 2
            deadline = time.monotonic() + 5  # the relay lets go once the client has read it all
            while any(listed().values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert listed() == {"engine-a": [], "engine-b": []}
            assert all(i.inflight == 0 for i in registry.all())
            # The recent placements show the request where it went, then its continuation.
            status = httpx.get(f"{router_url}/admin/status", headers=CREDENTIALS.admin_headers(), timeout=5).json()
            assert [(p["chosen"], p["migrated"]) for p in status["recent_placements"]] == [(first, False), (other, True)]
            assert [c["instance_id"] for c in status["recent_placements"][1]["candidates"]] == [other]
