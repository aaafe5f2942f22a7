"""Two routers, active-active, behind a real HTTP balancer (Debian's nginx): the one that owns the
fleet (`pdcluster launch`) and one more (`--router-only`) on the same Ray cluster. Each keeps its
own KV index from the engines' events; a key's concurrency limit holds across both (the
cluster's admission ledger); one router killed under load costs no new request, a client that
retries a cut stream once gets the whole answer, and the other router's index is unaffected."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import httpx
import pytest
from machine import unless_ci
from waiting import until

from loadtest.balancer import balancer
from loadtest.local_cluster import LocalServer, RayHead
from security.credentials import write_private

pytestmark = [pytest.mark.slow, unless_ci(shutil.which("nginx") is not None, "needs Debian's nginx (make test)")]
KEYS = [f"sk-two-routers-{k}" for k in range(12)]
PROMPT = " ".join(f"Line {k}: two routers read the same engines' events." for k in range(24))
# SmolLM2: its streams take seconds on these cores (the tiny model's end in a fraction of one, before
# any fault could hit them).
MODEL, MAX_TOKENS = "smollm2", 96
LONG_TOKENS = 200  # streams still running while the limit is tried (~7 s each here; tried at once)


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(prompt: str, max_tokens: int = MAX_TOKENS, stream: bool = True) -> dict:
    whole = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {**whole, "stream": True, "stream_options": {"include_usage": True}} if stream else whole


class Stream:
    """A streamed completion read on a thread: its text, whether it ended whole, the events seen."""

    def __init__(self, url: str, key: str, prompt: str, max_tokens: int = MAX_TOKENS) -> None:
        self.url, self.key, self.prompt, self.max_tokens = url, key, prompt, max_tokens
        self.text, self.events, self.completion_tokens, self.error = "", 0, None, None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body(self.prompt, self.max_tokens),
                              headers=headers(self.key),
                              timeout=120) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}"
                    return
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        self.text += "".join(c.get("text") or "" for c in event.get("choices", []))
                        self.events += 1
                        if event.get("usage"):
                            self.completion_tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    @property
    def whole(self) -> bool:
        return self.error is None and self.completion_tokens == self.max_tokens

    def join(self) -> Stream:
        self.thread.join(180)
        return self


def matched(router: LocalServer, prompt: str, tenant: str) -> dict[str, int]:
    """Which instances `router`'s index says hold how many of `prompt`'s blocks, for `tenant`."""
    explained = httpx.post(f"{router.url}/admin/explain?tenant={tenant}", json={"model": MODEL, "prompt": prompt},
                           headers=router.credentials.admin_headers(), timeout=10)
    explained.raise_for_status()
    return explained.json()["matched_blocks"]


@pytest.mark.timeout(900)
def test_two_routers_share_events_and_limits_and_one_can_die(model_dir, artifacts, tmp_path):
    model_dir(MODEL)
    keys_file = tmp_path / "api-keys"
    write_private(keys_file, "".join(f"{key}:tenant-{k}\n" for k, key in enumerate(KEYS)))  # 0600: else refused
    common = ["--model", MODEL, "--kv-cache-gib", "1", "--api-keys-file", str(keys_file),
              "--max-concurrency-per-key", "2"]
    with RayHead() as head:
        owner = LocalServer(["--address", head.address, "--instances", "2", *common], artifacts / "serve-router-a.log")
        other = LocalServer(["--address", head.address, "--router-only", *common], artifacts / "serve-router-b.log")
        try:
            owner.start()
            other.start()
            until(lambda: sum(i["state"] == "ready" for i in other.instances()) == 2, "the second router's fleet")

            # The second router's index follows the engines' events of a request it never saw.
            complete = httpx.post(f"{owner.url}/v1/completions", headers=headers(KEYS[0]), timeout=60,
                                  json=body(PROMPT, 4, stream=False))
            assert complete.status_code == 200, complete.text
            blocks = len(PROMPT.split()) // 32
            held = until(lambda: {h: n for h, n in matched(other, PROMPT, "tenant-0").items() if n >= blocks},
                         "the second router seeing the first router's blocks", timeout_s=10)

            # One key, two streams in flight (one through each router): its limit of 2 is the cluster's.
            # The second router's first stream has taken 15 s to start (CI): it goes first, so that
            # the other stream cannot have ended before the limit is tried.
            streams = []
            for router, part in ((other, "one"), (owner, "two")):
                streams.append(Stream(router.url, KEYS[1], f"A long story, part {part}.", LONG_TOKENS))
                until(lambda: streams[-1].events, f"stream {part} under way", timeout_s=60)
            third = httpx.post(f"{other.url}/v1/completions", headers=headers(KEYS[1]), json=body("x", 2), timeout=30)
            in_flight = [s.completion_tokens is None for s in streams]
            assert third.status_code == 429 and third.headers.get("retry-after"), (in_flight, third.text)
            other_key = httpx.post(f"{other.url}/v1/completions", headers=headers(KEYS[2]),
                                   json=body("x", 2, stream=False), timeout=30)
            assert other_key.status_code == 200, other_key.text
            assert all(s.join().whole for s in streams)

            with balancer([owner.url, other.url], tmp_path / "nginx") as front:
                load = [Stream(front, KEYS[3 + k], f"Story {k}: once upon a time") for k in range(8)]
                until(lambda: all(s.events >= 3 for s in load), "every stream under way", timeout_s=60)
                owner.kill()  # the router that owns the fleet; its engines live on
                cut = [s for s in (s.join() for s in load) if not s.whole]
                retried = [r.join() for r in [Stream(front, s.key, s.prompt) for s in cut]]  # once each, together
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    new = list(pool.map(lambda k: httpx.post(
                        f"{front}/v1/completions", headers=headers(KEYS[3 + k]),
                        json=body(f"After the fault, request {k}", 8, stream=False), timeout=60).status_code,
                        range(8)))
            print(f"two routers: {len(cut)} of {len(load)} streams cut by the kill, all retried once")
            assert cut, "the kill cut no stream: it hit nothing"
            assert all(s.whole for s in retried), [(s.error, s.completion_tokens) for s in retried]
            assert new == [200] * 8  # every new request, on the router that lives
            assert {h: n for h, n in matched(other, PROMPT, "tenant-0").items() if n >= blocks} == held
            # ...and it still follows the engines' events: a new prompt's blocks, once its own
            # speculative entries (2 s) are gone.
            fresh = PROMPT.replace("Line", "Row")
            assert httpx.post(f"{other.url}/v1/completions", headers=headers(KEYS[0]), timeout=60,
                              json=body(fresh, 2, stream=False)).status_code == 200
            time.sleep(3)
            assert any(n >= blocks for n in matched(other, fresh, "tenant-0").values())
        finally:
            other.stop()
            owner.stop()
