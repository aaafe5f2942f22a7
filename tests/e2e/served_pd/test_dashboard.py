"""The Grafana dashboard (deploy/grafana/pdcluster.json) against a real Prometheus (Debian's
binary, started here on loopback with a 1 s scrape interval and the scrape configuration of
deploy/prometheus/prometheus.yml) that scrapes a real `pdcluster serve` (tiny model, one prefill
and one decode instance, KV handed over through the store) under a short load: prompts that share
a prefix, and one bad request. Every panel's every query, run as Grafana runs it (a range query,
its variables substituted), answers with data; the router's scrape passes promtool's lint; the
queries' answers are drawn into one PNG (.cache/test-artifacts/dashboard-queries.png)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from machine import unless_ci

from engine.environment import free_port

pytestmark = [pytest.mark.slow,
              unless_ci(shutil.which("prometheus") is not None, "needs Debian's prometheus (make test)")]
REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "pdcluster.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
SCRAPE_INTERVAL_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), with one
# point per second ($__interval = the 1 s step).
GRAFANA_VARIABLES = {"$__rate_interval": f"{4 * SCRAPE_INTERVAL_S}s", "$__interval": "1s"}
SHARED_PREFIX = " ".join(f"rule {k}: every answer cites its sources and names its units." for k in range(40))
REQUESTS = 16
NOT_FOUND = 'pdcluster_router_errors_total{kind="NotFoundError",status="404"}'
LEAD_IN_S = 5
"""Queried from this long before the load: the panels show where it began."""


def prometheus_config(router: str, token_file: Path) -> dict:
    """The example scrape configuration, pointed at `router` with the test's token file and a 1 s
    scrape interval; otherwise as shipped."""
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"] = {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"}
    for job in config["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token_file)
        for static in job.get("static_configs", []):
            static["targets"] = [router]
        for discovery in job.get("http_sd_configs", []):
            discovery["url"] = discovery["url"].replace("127.0.0.1:8000", router)
            discovery["refresh_interval"] = f"{SCRAPE_INTERVAL_S}s"
            discovery["authorization"]["credentials_file"] = str(token_file)
    return config


@pytest.fixture(scope="module")
def prometheus(served_pd, tmp_path_factory, artifacts):
    """A real Prometheus scraping `served_pd` (and, through it, its engines): its base URL."""
    folder = tmp_path_factory.mktemp("prometheus")
    token_file = folder / "admin-token"
    token_file.write_text(served_pd.credentials.admin_token)
    token_file.chmod(0o600)
    config_file = folder / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(prometheus_config(served_pd.url.removeprefix("http://"), token_file)))
    port = free_port("127.0.0.1")
    log = (artifacts / "prometheus.log").open("w")
    process = subprocess.Popen(
        ["prometheus", f"--config.file={config_file}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 60, "Prometheus ready")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def instant(prometheus: str, query: str) -> list[dict]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def scraped(prometheus: str, query: str) -> float:
    """The sum of `query`'s series as last scraped."""
    return sum(float(r["value"][1]) for r in instant(prometheus, query))


def send_load(url: str) -> None:
    """REQUESTS completions sharing a prefix, four at a time, half streamed; then one request
    for a model that does not exist."""

    def complete(k: int) -> int:
        body = {"model": "tiny", "prompt": f"{SHARED_PREFIX} Question {k}: why?", "max_tokens": 8,
                "temperature": 0, "stream": k % 2 == 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(complete, range(REQUESTS))) == [200] * REQUESTS
    bad = httpx.post(f"{url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=30)
    assert bad.status_code == 404


@pytest.fixture(scope="module")
def loaded(served_pd, prometheus) -> tuple[float, float]:
    """The load, sent while Prometheus scrapes; (start, end) Unix times of the span to query, once
    Prometheus has scraped the router's counts of it and both engines through the relay."""
    wait_for(lambda: len(instant(prometheus, 'up{job="pdcluster-engines"} == 1')) == 2, 60,
             "both engines scraped through the router's relay")
    started = time.time()
    send_load(served_pd.url)
    wait_for(lambda: scraped(prometheus, "pdcluster_router_requests_total") >= REQUESTS, 30,
             "the load's requests scraped")
    # The bad request comes last: a scrape between the load's end and it saw no error, and under
    # load the next scrapes can come late (CI stop 43: the 404 panel's rate was 0 to the end).
    wait_for(lambda: scraped(prometheus, NOT_FOUND) >= 1, 30, "the bad request's error scraped")
    time.sleep(4 * SCRAPE_INTERVAL_S)  # a few more scrapes: the rates' windows close over the load
    return started - LEAD_IN_S, time.time()


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) of every query of every panel, Grafana's variables
    substituted; fails on a variable the dashboard would need defined."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: an undefined variable in {expr}"
            queries.append((panel["title"], target.get("legendFormat", ""), expr))
    return queries


def test_the_dashboard_imports_as_is():
    dashboard = json.loads(DASHBOARD.read_text())
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    titles = [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    assert len(titles) == len(set(titles)) and len(panel_queries()) >= len(titles)


def test_every_panel_query_returns_data(served_pd, prometheus, loaded, artifacts):
    start, end = loaded
    answers = {}
    for title, legend, expr in panel_queries():
        answer = httpx.get(f"{prometheus}/api/v1/query_range",
                           params={"query": expr, "start": start, "end": end, "step": "1s"}, timeout=30).json()
        assert answer["status"] == "success", (title, expr, answer)
        series = answer["data"]["result"]
        finite = [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]
        assert finite, f"{title}: no data for {expr}"
        answers[(title, legend)] = series
    draw(answers, start, artifacts / "dashboard-queries.png")

    def peak(query: str) -> float:
        series = httpx.get(f"{prometheus}/api/v1/query_range", params={
            "query": query.replace("$__rate_interval", GRAFANA_VARIABLES["$__rate_interval"]),
            "start": start, "end": end, "step": "1s"}, timeout=30).json()["data"]["result"]
        return max((float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))), default=0.0)

    # What the panels are for: the shared prefix hit, KV handed over, the store used, the error seen.
    assert peak('sum(rate(pdcluster_router_prompt_blocks_total{found="instance"}[$__rate_interval]))') > 0
    assert peak("sum(rate(pdcluster_router_kv_handover_prompt_tokens_total[$__rate_interval]))") > 0
    assert peak("sum(pdcluster_store_stored_bytes)") > 0
    assert peak(f"sum(rate({NOT_FOUND}[$__rate_interval]))") > 0
    pools = {(r["metric"]["role"], r["metric"]["state"]) for r in instant(prometheus, "pdcluster_router_instances")}
    assert pools == {("prefill", "ready"), ("decode", "ready")}


def test_router_metrics_pass_promtool_lint(served_pd):
    scrape = httpx.get(f"{served_pd.url}/metrics", headers=served_pd.credentials.admin_headers(), timeout=30)
    assert scrape.status_code == 200
    assert re.search(r"^pdcluster_store_used_bytes\{", scrape.text, re.MULTILINE)  # the shards, at scrape time
    lint = subprocess.run(["promtool", "check", "metrics"], input=scrape.text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_engine_metrics_are_relayed_only_for_known_instances(served_pd):
    admin = served_pd.credentials.admin_headers()
    targets = httpx.get(f"{served_pd.url}/admin/prometheus_sd", headers=admin, timeout=10).json()
    assert sorted(t["labels"]["role"] for t in targets) == ["decode", "prefill"]
    for target in targets:
        relayed = httpx.get(f"{served_pd.url}{target['labels']['__metrics_path__']}", headers=admin, timeout=10)
        assert relayed.status_code == 200 and "vllm:num_requests_running" in relayed.text
    for path in ("/admin/engines/nope/metrics", "/admin/engines/..%2F..%2Fmetrics/metrics"):
        assert httpx.get(f"{served_pd.url}{path}", headers=admin, timeout=10).status_code == 404
    assert httpx.get(f"{served_pd.url}/admin/prometheus_sd", timeout=10).status_code == 401
    first = targets[0]["labels"]["__metrics_path__"]
    engine = served_pd.engine_access(targets[0]["labels"]["instance_id"])
    assert httpx.get(f"{served_pd.url}{first}", headers=engine.headers,
                     timeout=10).status_code == 401  # an engine's token is no admin credential


def draw(answers: dict[tuple[str, str], list[dict]], start: float, path: Path) -> None:
    """One small plot per panel: each query's series over the load (from `start`, Unix time), as
    the panel would show them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(dict.fromkeys(title for title, _ in answers))
    columns = 3
    rows = math.ceil(len(titles) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    for axis, title in zip(axes.flat, titles, strict=False):
        for (panel, legend), series in answers.items():
            if panel != title:
                continue
            for s in series:
                label = re.sub(r"\{\{(\w+)\}\}", lambda m, s=s: s["metric"].get(m.group(1), ""), legend)
                axis.plot([float(t) - start for t, _ in s["values"]], [float(v) for _, v in s["values"]],
                          label=label[:48], linewidth=1)
        axis.set_title(title, fontsize=9)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=6, loc="upper left")
    for axis in list(axes.flat)[len(titles):]:
        axis.axis("off")
    figure.supxlabel(f"seconds (the load starts at {LEAD_IN_S} s; Prometheus range queries, 1 s step)", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
