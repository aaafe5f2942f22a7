"""Reading Prometheus metrics (the router's and vLLM's own) for reports."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, prefixes: tuple[str, ...] = ("",), timeout_s: float = 5.0,
           headers: dict[str, str] | None = None) -> dict[str, float]:
    """The samples of `url`/metrics whose names start with one of `prefixes`, summed over label
    sets, by sample name. Lines of other metrics are dropped before parsing: vLLM's page is
    large, and a load generator that parses all of it every second competes with the server.
    `headers` carry the credential (the router's admin token, an engine's engine token)."""
    response = httpx.get(f"{url}/metrics", timeout=timeout_s, headers=headers)
    response.raise_for_status()
    text = response.text
    wanted = "\n".join(
        line for line in text.splitlines() if line.startswith(prefixes) and not line.startswith("#")
    )
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
