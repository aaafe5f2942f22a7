"""Reading Prometheus metrics (the router's and vLLM's own) for reports."""

from __future__ import annotations

import ssl

import httpx
from prometheus_client.parser import text_string_to_metric_families

from security.engine_access import EngineAccess


def scrape(url: str, prefixes: tuple[str, ...] = ("",), timeout_s: float = 5.0,
           headers: dict[str, str] | None = None, verify: ssl.SSLContext | bool = True,
           labels: dict[str, str] | None = None) -> dict[str, float]:
    """The samples of `url`/metrics whose names start with one of `prefixes`, summed over label
    sets, by sample name. Lines of other metrics are dropped before parsing: vLLM's page is
    large, and a load generator that parses all of it every second competes with the server.
    `headers` carry the credential (the router's admin token); `verify`, the TLS context (an
    engine's: `scrape_engine`); `labels`: only samples with these label values."""
    response = httpx.get(f"{url}/metrics", timeout=timeout_s, headers=headers, verify=verify)
    response.raise_for_status()
    text = response.text
    wanted = "\n".join(
        line for line in text.splitlines() if line.startswith(prefixes) and not line.startswith("#")
    )
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            if labels and any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape_engine(access: EngineAccess, prefixes: tuple[str, ...] = ("",), timeout_s: float = 5.0) -> dict[str, float]:
    """`scrape` of one engine of ours, straight (its pinned TLS context and token)."""
    return scrape(access.url, prefixes, timeout_s, headers=access.headers, verify=access.ssl)
