"""The status page in real headless Chromium (Debian's package, driven by playwright) against a
real `pdcluster serve` (the session's `served`), and `pdcluster status` / `pdcluster top`
against the same router: all show the live instances that GET /admin/instances lists."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.local_cluster import LocalServer

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 30_000
"""How long the page may take to show what the router has (bounds a wait; asserts no speed)."""
HOSTILE_MODEL = "<img src=x onerror=\"document.title='pwned'\">"


@contextlib.contextmanager
def chromium_page(credentials: dict[str, str] | None) -> Iterator:
    """A page of a Chromium with a fresh profile; `credentials` answer the page's Basic challenge."""
    from playwright import sync_api  # the dev extra's: its absence is an error, not a skip
    if not CHROMIUM.exists():
        pytest.fail(f"no {CHROMIUM}: apt-get install -y --no-install-recommends chromium")
    with sync_api.sync_playwright() as playwright, tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True,
            http_credentials=credentials, viewport={"width": 1400, "height": 1000})
        try:
            yield context.new_page()
        finally:
            context.close()


def basic(password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"operator:{password}".encode()).decode()}


def test_the_page_and_its_data_need_the_admin_token(served: LocalServer):
    for path in ("/status", "/admin/status"):
        refused = httpx.get(f"{served.url}{path}", timeout=10)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith('Basic realm="pdcluster"')
        assert httpx.get(f"{served.url}{path}", headers=basic("wrong"), timeout=10).status_code == 401
        another_token = basic(served.engine_access(served.instances()[0]["instance_id"]).token)
        assert httpx.get(f"{served.url}{path}", headers=another_token, timeout=10).status_code == 401
    from playwright.sync_api import Error as BrowserError

    for credentials in (None, {"username": "operator", "password": "wrong"}):
        with chromium_page(credentials) as page:
            try:
                response = page.goto(f"{served.url}/status")
                refused = response is not None and response.status == 401
            except BrowserError as exc:  # no credential to answer the challenge with: it gives up
                refused = "ERR_INVALID_AUTH_CREDENTIALS" in str(exc)
            assert refused
            assert page.locator("#instances").count() == 0


def test_the_page_shows_the_live_instances_and_refreshes_itself(served: LocalServer, artifacts: Path):
    from playwright.sync_api import expect

    instance_ids = [i["instance_id"] for i in served.instances()]
    assert instance_ids
    with chromium_page({"username": "operator", "password": served.credentials.admin_token}) as page:
        script_errors: list[str] = []
        page.on("pageerror", lambda error: script_errors.append(str(error)))
        page.on("console", lambda message: "Content Security Policy" in message.text
                and script_errors.append(message.text))
        page.goto(f"{served.url}/status")
        shown = page.locator("#instances td.instance-id")
        for instance_id in instance_ids:
            expect(shown.filter(has_text=re.compile(f"^{re.escape(instance_id)}$"))).to_have_count(1, timeout=WAIT_MS)
        expect(page.locator("#health")).to_have_text("ok")

        # A client's request for a model named like markup: the page, without being reloaded,
        # shows that an error happened, never the client's text (nor runs it).
        httpx.post(f"{served.url}/v1/completions", json={"model": HOSTILE_MODEL, "prompt": "hi", "max_tokens": 1},
                   timeout=30)
        expect(page.locator("#errors td.message", has_text="Unknown model or route")).not_to_have_count(0,
                                                                                                    timeout=WAIT_MS)
        assert "onerror" not in page.content() and page.locator("#errors img").count() == 0
        assert page.title() == "pdcluster status"
        expect(page.locator("#hit-rates")).to_contain_text("prompt blocks")
        status = httpx.get(f"{served.url}/admin/status", headers=served.credentials.admin_headers(), timeout=10).json()
        assert status["starts"]  # the session's engine start, stage by stage
        segments = sum(len(start["stages_s"]) for start in status["starts"][-12:])  # the page draws the last 12
        expect(page.locator("#starts .bar > span")).to_have_count(segments)
        for shard in status["store"]:
            expect(page.locator("#store")).to_contain_text(shard["endpoint"])
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "status-page.png"), full_page=True)
    assert script_errors == []


def pdcluster(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process, as a user runs it (a wide terminal: ids are never cut)."""
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


def test_status_and_top_show_the_live_instances(served: LocalServer):
    instance_ids = [i["instance_id"] for i in served.instances()]
    status = pdcluster("status", "--url", served.url)
    top = pdcluster("top", "--url", served.url, "--refreshes", "1")
    for result in (status, top):
        assert result.returncode == 0, result.stderr
        for instance_id in instance_ids:
            assert instance_id in result.stdout
        assert "ready" in result.stdout and "Prompt KV hit rates" in result.stdout
    assert f"{served.url}/status" in status.stderr  # how to open the page
    token = pdcluster("status", "--print-admin-token")
    assert token.stdout.strip() == served.credentials.admin_token


def test_status_fails_plainly_without_the_right_secret(served: LocalServer):
    other = {**os.environ, "PDCLUSTER_SECRET": "ab" * 32, "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--url", served.url],
                            capture_output=True, text=True, timeout=120, env=other)
    assert result.returncode == 1
    assert "401" in result.stderr
