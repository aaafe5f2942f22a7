"""The status views without engines: `pdcluster status`/`top` rendering a ClusterStatus built
here, and the status page's routes and credential (HTTP Basic for a browser, reads only)."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from routers import router_client

from deploy.status_view import StatusSource, render_status, watch
from router.status_model import ClusterStatus, HitRates
from security.credentials import ClusterCredentials

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)


def cluster_status() -> ClusterStatus:
    """A snapshot as the views get it: GET /admin/status's JSON."""
    return ClusterStatus.model_validate({
        "generated_at": 1_790_000_000.0, "models": ["tiny"], "health": "ok",
        "requests": {"served": 42, "inflight": 3, "queued": 1},
        "pools": [{"model": "tiny", "role": "prefill", "states": {"ready": 1}},
                  {"model": "tiny", "role": "decode", "states": {"ready": 1, "standby": 2}}],
        "instances": [
            {"instance_id": "prefill-0", "model": "tiny", "role": "prefill", "state": "ready", "url": "http://127.0.0.1:9001",
             "inflight": 2, "pending_prefill_tokens": 512.0, "index_blocks": 17},
            {"instance_id": "decode-7", "model": "tiny", "role": "decode", "state": "standby", "url": "http://127.0.0.1:9002",
             "inflight": 0, "pending_prefill_tokens": 0.0, "index_blocks": 0},
        ],
        "starts": [{"instance_id": "decode-7", "role": "decode", "path": "peer", "started_at": 1_789_999_990.0,
                    "total_s": 0.9, "stages_s": {"weights": 0.4, "warmup_request": 0.2, "api_server": 0.3}}],
        "hit_rates": {"prompt_blocks": 200, "instance_hit_blocks": 50, "store_hit_blocks": 30},
        "store": [{"endpoint": "tcp://127.0.0.1:7000", "capacity_bytes": 2 * 2**30, "used_bytes": 2**30, "chunks": 9},
                  {"endpoint": "tcp://127.0.0.1:7001", "error": "no answer in 5 s"}],
        "recent_placements": [{"at": 1_789_999_998.0, "model": "tiny", "prompt_tokens": 900, "prompt_blocks": 56,
                               "reason": "remote", "chosen": "decode-3", "prefill": "prefill-0",
                               "candidates": [{"instance_id": "decode-3", "cached_blocks": 40, "store_blocks": 8,
                                               "queued_tokens": 0.0, "inflight": 1, "load": 1,
                                               "score": 160.4},
                                              {"instance_id": "decode-4", "cached_blocks": 0, "store_blocks": 48,
                                               "queued_tokens": 300.0, "inflight": 2, "load": 3,
                                               "score": 1176.0}]}],
        "recent_errors": [{"at": 1_789_999_999.0, "kind": "RateLimitError", "status": 429,
                           "message": "key over its rate [bold]limit[/bold]"}],
    })


def rendered(status: ClusterStatus) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(render_status(status, "http://router"))
    return console.export_text()


def test_status_names_instances_states_stages_hit_rates_store_placements_and_errors():
    text = rendered(cluster_status())
    for expected in ("prefill-0", "decode-7", "ready", "standby", "weights", "warmup_request", "api_server",
                     "0.90 s", "25.0%", "15.0%", "1.0 GiB", "2.0 GiB", "no answer in 5 s", "RateLimitError",
                     "42 served", "http://127.0.0.1:9001", "remote, prefilled on prefill-0",
                     "decode-3: 40+8 store · 0 · 1 · 160", "decode-4: 0+48 store · 300 · 2 · 1176"):
        assert expected in text, expected


def test_data_is_shown_as_text_never_read_as_rich_markup():
    status = cluster_status()
    status.instances[0].instance_id = "[red]x[/red]"
    text = rendered(status)
    assert "[red]x[/red]" in text
    assert "key over its rate [bold]limit[/bold]" in text
    status.recent_placements[0].prefill = "[/x]"  # would raise MarkupError if read as markup
    status.recent_placements[0].model = "[blue]m[/blue]"
    text = rendered(status)
    assert "prefilled on [/x]" in text and "[blue]m[/blue]" in text


def test_an_empty_cluster_renders():
    status = cluster_status().model_copy(update={"pools": [], "instances": [], "starts": [], "store": [],
                                                 "recent_placements": [], "recent_errors": []})
    status.hit_rates = HitRates(prompt_blocks=0, instance_hit_blocks=0, store_hit_blocks=0)
    text = rendered(status)
    assert "none yet" in text and "no shards" in text and "-" in text


def test_top_redraws_the_given_number_of_times_and_survives_a_failed_fetch(monkeypatch):
    answers = iter([cluster_status(), None, cluster_status()])

    def fetch(self) -> ClusterStatus:
        answer = next(answers)
        if answer is None:
            from deploy.status_view import StatusUnavailable
            raise StatusUnavailable("GET http://router/admin/status answered 502")
        return answer

    monkeypatch.setattr(StatusSource, "fetch", fetch)
    console = Console(width=200, record=True, color_system=None, force_terminal=False)
    slept: list[float] = []
    assert watch(StatusSource("http://router", {}), console, 0.5, refreshes=3, sleep=slept.append)
    assert slept == [0.5, 0.5]  # between refreshes, not after the last
    assert "prefill-0" in console.export_text()
    with pytest.raises(StopIteration):
        next(answers)


def router() -> TestClient:
    return router_client()


def basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.mark.parametrize("path", ["/status", "/status/status.js", "/status/status.css", "/admin/instances"])
def test_a_browser_is_asked_for_the_admin_token_and_may_read_with_it(path):
    with router() as client:
        refused = client.get(path)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith('Basic realm="pdcluster"')
        for wrong in (basic("admin", "wrong"), basic("admin", CREDENTIALS.engine_host_keys("c-0").new_process("127.0.0.1").engine_token),
                      {"authorization": "Basic !!!not-base64"}, basic("", "")):
            assert client.get(path, headers=wrong).status_code == 401
        assert client.get(path, headers=basic("anyone", CREDENTIALS.admin_token)).status_code == 200
        assert client.get(path, headers=CREDENTIALS.admin_headers()).status_code == 200


def test_the_page_forbids_inline_and_foreign_script():
    with router() as client:
        page = client.get("/status", headers=CREDENTIALS.admin_headers())
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy and "unsafe-inline" not in policy
    assert page.headers["cache-control"] == "no-store"
    assert "/status/status.js" in page.text


def test_basic_auth_never_authorizes_a_post():
    """A browser sends its Basic credential with a cross-site form's POST too."""
    body = {"model": "m", "prompt": "x"}
    with router() as client:
        assert client.post("/admin/explain", json=body, headers=basic("a", CREDENTIALS.admin_token)).status_code == 401
        assert client.post("/admin/explain", json=body, headers=CREDENTIALS.admin_headers()).status_code != 401
