"""A streamed OpenAI request read on a thread, as a client of the router sees it: its ids, text,
token ids, usage, how many tokens so far, error events, whether it ended. For tests that hurt an
engine while a stream runs and then compare what the client got."""

from __future__ import annotations

import json
import threading

import httpx


class StreamedRequest:
    """POSTs `body` to `url + endpoint` and reads its events on a daemon thread."""

    def __init__(self, url: str, endpoint: str, body: dict):
        self.url, self.endpoint, self.body = url, endpoint, body
        self.id, self.ids, self.text, self.usage = None, set(), "", None
        self.token_ids: list[int] = []
        self.tokens, self.errors, self.ended = 0, [], False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{self.url}{self.endpoint}", json=self.body
            ) as response:
                if response.status_code != 200:
                    self.errors.append(f"HTTP {response.status_code}: {response.read()!r}")
                    return
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self._event(json.loads(line[len("data: "):]))
        except Exception as exc:  # the test reads it: a thread's exception would vanish
            self.errors.append(repr(exc))
        finally:
            self.ended = True

    def _event(self, event: dict) -> None:
        if "error" in event:
            self.errors.append(event)
            return
        self.id = self.id or event["id"]
        self.ids.add(event["id"])
        if event.get("usage"):
            self.usage = {k: event["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for choice in event["choices"]:
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            self.tokens += bool(piece)
            self.text += piece or ""
            self.token_ids += choice.get("token_ids") or []

    def result(self) -> tuple:
        """(text, usage, errors, token ids) once it ended (at most 180 s from now)."""
        self.thread.join(180)
        return self.text, self.usage, self.errors, self.token_ids
