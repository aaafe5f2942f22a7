"""Reading Prometheus metrics (the router's and vLLM's own) for reports."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Every sample of `url`/metrics, summed over label sets, by sample name."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
