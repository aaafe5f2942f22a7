"""`pdcluster status` and `pdcluster top`: GET /admin/status (router/status_model.py's
ClusterStatus) drawn with rich, the same sections as the status page (router/status_page.py):
pools, instances, the last starts' stage timelines as bars, hit rates, store use, recent errors.

`top` redraws in place (rich.live) every `interval_s`; a failed fetch keeps the last state on
screen under a line saying why, and the next refresh tries again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text  # every string from the router goes in as Text: shown as is, never read as markup

from router.status_model import ClusterStatus, HitRates, InstanceStatus, PoolStatus, ShardStatus, StartRecord

STARTS_SHOWN = 12
ERRORS_SHOWN = 10
PLACEMENTS_SHOWN = 8
BAR_WIDTH = 48
STAGE_STYLES = ("blue", "green", "yellow", "magenta", "red", "cyan", "bright_black", "bright_blue",
                "bright_green", "bright_magenta")
STATE_STYLES = {"ready": "green", "ok": "green", "loading": "yellow", "warming": "yellow",
                "draining": "yellow", "standby": "bright_black", "sleeping": "bright_black", "preimported": "bright_black",
                "failed": "red", "stopped": "red", "unavailable": "red"}


class StatusUnavailable(RuntimeError):
    """GET /admin/status failed (no router, a wrong token, a bad answer)."""


@dataclasses.dataclass(frozen=True)
class StatusSource:
    """Where the snapshot comes from: a router's URL and the admin credential's headers."""

    url: str
    headers: dict[str, str] = dataclasses.field(repr=False)
    timeout_s: float = 5.0

    def fetch(self) -> ClusterStatus:
        try:
            response = httpx.get(f"{self.url}/admin/status", headers=self.headers, timeout=self.timeout_s)
            response.raise_for_status()
            return ClusterStatus.model_validate_json(response.content)
        except httpx.HTTPStatusError as exc:
            raise StatusUnavailable(f"GET {self.url}/admin/status answered {exc.response.status_code}") from None
        except (httpx.HTTPError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise StatusUnavailable(f"GET {self.url}/admin/status failed: {exc!r}") from None


def _state(state: str) -> Text:
    return Text(state, style=STATE_STYLES.get(state, ""))


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def _bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def _meter(fraction: float, width: int = 20, style: str = "green") -> Text:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return Text("█" * filled, style=style) + Text("░" * (width - filled), style="bright_black")


def header(status: ClusterStatus, url: str) -> Text:
    requests = status.requests
    line = Text(f"pdcluster at {url}  model{'s' if len(status.models) > 1 else ''} {', '.join(status.models)}  ")
    line += _state(status.health)
    line += Text(f"  {requests.served} served, {requests.inflight} in flight, {requests.queued} queued  "
                 f"as of {time.strftime('%H:%M:%S', time.localtime(status.generated_at))}", style="dim")
    return line


def pools_table(pools: list[PoolStatus]) -> Table:
    table = Table(title="Pools", title_justify="left")
    table.add_column("model")
    table.add_column("role")
    table.add_column("instances by state")
    for pool in pools:
        states = Text(" ").join(_state(state) + Text(f" {count}") for state, count in pool.states.items())
        table.add_row(Text(pool.model), Text(pool.role), states)
    return table


def instances_table(instances: list[InstanceStatus]) -> Table:
    table = Table(title="Instances", title_justify="left")
    table.add_column("instance", no_wrap=True)
    for column in ("role", "state"):
        table.add_column(column)
    table.add_column("TP", justify="right")
    for column in ("in flight", "queued prefill tokens", "index blocks"):
        table.add_column(column, justify="right")
    table.add_column("url", overflow="fold")
    for i in instances:
        table.add_row(Text(i.instance_id), Text(i.role), _state(i.state), str(i.tensor_parallel_size), str(i.inflight),
                      str(round(i.pending_prefill_tokens)), str(i.index_blocks), Text(i.url))
    return table


def stage_styles(starts: list[StartRecord]) -> dict[str, str]:
    """A style per stage name, in the order stages first appear (the legend's order)."""
    styles: dict[str, str] = {}
    for start in starts:
        for stage in start.stages_s:
            styles.setdefault(stage, STAGE_STYLES[len(styles) % len(STAGE_STYLES)])
    return styles


def starts_table(all_starts: list[StartRecord]) -> RenderableType:
    """The last starts as horizontal bars on one scale, a segment per stage."""
    starts = all_starts[-STARTS_SHOWN:]
    if not starts:
        return Text("Last starts: none yet", style="dim")
    styles = stage_styles(starts)
    longest = max(start.total_s for start in starts) or 1.0
    table = Table(title="Last starts (a segment per stage)", title_justify="left")
    table.add_column("instance", no_wrap=True)
    table.add_column("path")
    table.add_column("stages", no_wrap=True)
    table.add_column("total", justify="right")
    for start in starts:
        bar = Text()
        for stage, seconds in start.stages_s.items():
            bar += Text("█" * max(1, round(BAR_WIDTH * seconds / longest)), style=styles[stage])
        table.add_row(Text(start.instance_id), Text(start.path), bar, f"{start.total_s:.2f} s")
    legend = Text("  ").join(Text("■ ", style=style) + Text(stage) for stage, style in styles.items())
    return Group(table, legend)


def hit_rates_table(hits: HitRates) -> Table:
    table = Table(title=f"Prompt KV hit rates ({hits.prompt_blocks} prompt blocks)", title_justify="left")
    for column in ("found", "blocks", "rate", ""):
        table.add_column(column)
    for where, blocks, rate in (("in the chosen instance", hits.instance_hit_blocks, hits.instance_hit_rate),
                                ("in the KV store", hits.store_hit_blocks, hits.store_hit_rate)):
        table.add_row(where, str(blocks), _percent(rate), _meter(rate or 0.0))
    return table


def store_table(shards: list[ShardStatus]) -> RenderableType:
    if not shards:
        return Text("KV store: no shards", style="dim")
    table = Table(title="KV store", title_justify="left")
    for column in ("shard", "used", "capacity", "chunks", ""):
        table.add_column(column, overflow="fold")
    for shard in shards:
        if shard.error is not None:
            table.add_row(Text(shard.endpoint), Text(shard.error, style="red"), "", "", "")
            continue
        used = (shard.used_bytes or 0) / shard.capacity_bytes if shard.capacity_bytes else 0.0
        table.add_row(Text(shard.endpoint), _bytes(shard.used_bytes), _bytes(shard.capacity_bytes),
                      "-" if shard.chunks is None else str(shard.chunks), _meter(used, style="blue"))
    return table


def placements_table(status: ClusterStatus) -> RenderableType:
    """The last requests' placements: each candidate's cached blocks, queued prefill tokens, this
    router's requests in flight and the policy's score, the chosen one in bold (a hot spot is one
    instance chosen over and over while its queue grows)."""
    placements = status.recent_placements[-PLACEMENTS_SHOWN:]
    if not placements:
        return Text("Recent placements: none yet", style="dim")
    table = Table(title="Recent placements (newest first; cached blocks · queued tokens · in flight · score)",
                  title_justify="left")
    for column in ("time", "model", "prompt tokens", "reason", "candidates"):
        table.add_column(column, overflow="fold")
    for placement in reversed(placements):
        lines = Text()
        for k, c in enumerate(placement.candidates):
            score = "-" if c.score is None else f"{c.score:.0f}"
            store = f"+{c.store_blocks} store" if c.store_blocks else ""
            lines.append(("\n" if k else "") + f"{c.instance_id}: {c.cached_blocks}{store} · "
                         f"{c.queued_tokens:.0f} · {c.inflight} · {score}",
                         style="bold" if c.instance_id == placement.chosen else "")
        reason = ("migrated, " if placement.migrated else "") + placement.reason + (
            f", prefilled on {placement.prefill}" if placement.prefill else "")
        table.add_row(time.strftime("%H:%M:%S", time.localtime(placement.at)), Text(placement.model),
                      str(placement.prompt_tokens), Text(reason), lines)
    return table


def errors_table(status: ClusterStatus) -> RenderableType:
    errors = status.recent_errors[-ERRORS_SHOWN:]
    if not errors:
        return Text("Recent errors: none", style="dim")
    table = Table(title="Recent errors (newest first)", title_justify="left")
    for column in ("time", "kind", "status", "message"):
        table.add_column(column, overflow="fold")
    for error in reversed(errors):
        table.add_row(time.strftime("%H:%M:%S", time.localtime(error.at)), Text(error.kind), str(error.status),
                      Text(error.message))
    return table


def render_status(status: ClusterStatus, url: str) -> Group:
    """Every section of the status page, for a terminal."""
    return Group(header(status, url), pools_table(status.pools), instances_table(status.instances),
                 starts_table(status.starts), hit_rates_table(status.hit_rates), store_table(status.store),
                 placements_table(status), errors_table(status))


def watch(source: StatusSource, console: Console, interval_s: float, refreshes: int | None = None,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """Redraw `source`'s status in place every `interval_s` until Ctrl-C (the caller's to catch)
    or, with `refreshes`, after that many fetches. Whether the last fetch succeeded."""
    shown: RenderableType = Text(f"waiting for {source.url} ...", style="dim")
    ok, done = False, 0
    with Live(shown, console=console, auto_refresh=False, screen=False) as live:
        while refreshes is None or done < refreshes:
            try:
                shown, ok = render_status(source.fetch(), source.url), True
                live.update(shown, refresh=True)
            except StatusUnavailable as exc:
                ok = False
                live.update(Group(Text(f"{exc}; retrying every {interval_s:g} s", style="red"), shown),
                            refresh=True)
            done += 1
            if refreshes is None or done < refreshes:
                sleep(interval_s)
    return ok
