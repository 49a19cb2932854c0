"""``kvos top``: a live terminal view of a running server's KV memory.

Reads the server's ``/metrics`` (Prometheus text) and ``GET /v1/kv/summary`` (``kv_summary``)
over HTTP, and renders with rich: pages by cache group and state, hit rates, the cached prefixes
hit most often, tiers, engines, the request queue, and throughput from the counters' change
between two samples. Nothing here imports the engine: it is a client of any kvos server.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 24


@dataclass
class Sample:
    """One reading of the server: when (monotonic seconds), ``/metrics`` and the KV summary."""

    at: float
    metrics: dict[tuple[str, tuple], float] = field(default_factory=dict)
    """``(sample name, sorted label pairs)`` -> value."""
    summary: dict = field(default_factory=dict)

    def total(self, name: str) -> float | None:
        """A sample's value summed over its label sets (None if the server exports none)."""
        values = [v for (n, _), v in self.metrics.items() if n == name]
        return sum(values) if values else None


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def fetch(client: httpx.Client, top: int = 10) -> Sample:
    """Read ``/metrics`` and ``/v1/kv/summary`` (``client`` has the server's base URL and key)."""
    at = time.monotonic()
    metrics = client.get("/metrics")
    metrics.raise_for_status()
    summary = client.get("/v1/kv/summary", params={"top": top})
    summary.raise_for_status()
    return Sample(at, parse_metrics(metrics.text), summary.json())


def make_client(url: str, api_key: str | None, timeout: float = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout)


# -- formatting ------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def bar(used: float, cached: float, total: float, width: int = BAR_WIDTH) -> Text:
    """A stacked bar: used (red), cached (yellow), free (green)."""
    if total <= 0:
        return Text("·" * width, style="dim")
    n_used = round(width * used / total)
    n_cached = min(width - n_used, round(width * cached / total))
    return Text.assemble(("█" * n_used, "red"), ("▓" * n_cached, "yellow"),
                         ("░" * (width - n_used - n_cached), "green"))


def rates(cur: Sample, prev: Sample | None) -> dict[str, float | None]:
    """Per second over the interval between two samples (None without a previous one); the
    interval's prefix hit rate and mean time to first token."""
    out: dict[str, float | None] = {}
    dt = cur.at - prev.at if prev is not None else 0.0

    def delta(name: str) -> float | None:
        if prev is None or dt <= 0:
            return None
        a, b = cur.total(name), prev.total(name)
        return None if a is None or b is None else a - b

    for key, name in (("requests", "kvos:request_success_total"), ("prompt_tokens", "kvos:prompt_tokens_total"),
                      ("generation_tokens", "kvos:generation_tokens_total"),
                      ("batched_tokens", "kvos:engine_batched_tokens_total"),
                      ("evictions", "kvos:kv_cache_evictions_total")):
        d = delta(name)
        out[key] = None if d is None else d / dt
    hits, queries = delta("kvos:prefix_cache_hits_total"), delta("kvos:prefix_cache_queries_total")
    out["hit_rate"] = hits / queries if hits is not None and queries else None
    s, n = delta("kvos:time_to_first_token_seconds_sum"), delta("kvos:time_to_first_token_seconds_count")
    out["ttft_s"] = s / n if s is not None and n else None
    return out


# -- the view --------------------------------------------------------------------------------
def _usage(x: dict) -> Text:
    """The bar of a pool or group, with its used and cached shares."""
    total = x["total"]
    return Text.assemble(bar(x["used"], x["cached"], total), f" {pct(x['used'] / total if total else 0.0)} used, "
                         f"{pct(x['cached'] / total if total else 0.0)} cached")


def _pages_table(summary: dict) -> Table:
    t = Table(title="KV pages by group and state", title_justify="left", expand=False)
    for col, just in (("", "left"), ("kind", "left"), ("block", "right"), ("bytes/block", "right"),
                      ("total", "right"), ("used", "right"), ("cached", "right"), ("free", "right"),
                      ("usage", "left"), ("used bytes", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    p = summary["pages"]
    bs = summary.get("block_size")
    t.add_row("pool (pages)", summary.get("kv_layout") or "", f"{bs} tok", human_bytes(p["page_bytes"]),
              str(p["total"]), str(p["used"]), str(p["cached"]), str(p["free"]),
              _usage(p),
              human_bytes(p["bytes"]["used"]))
    for g in summary["groups"]:
        kind = g["kind"] + (f" w={g['window']}" if g.get("window") else "") + (f" ({g['role']})" if g.get("role")
                                                                             and g["role"] != "model" else "")
        t.add_row(f"group {g['group']}", kind, f"{g['block_size']} tok", human_bytes(g["block_bytes"]),
                  str(g["total"]), str(g["used"]), str(g["cached"]), str(g["free"]),
                  _usage(g),
                  human_bytes(g["bytes"]["used"]))
    return t


def _hits_table(summary: dict, r: dict) -> Table:
    h = summary["hit_rate"]
    t = Table(title="Hit rates (prompt tokens)", title_justify="left")
    t.add_column("source")
    t.add_column("hit tokens", justify="right")
    t.add_column("rate", justify="right")
    t.add_row("prefix cache (all)", str(h["hits_tokens"]), pct(h["prefix"]))
    t.add_row("  device", str(h["device_hits_tokens"]), pct(h["device"]))
    t.add_row("  tiers below", str(h["tier_hits_tokens"]), pct(h["tiers"]))
    t.add_row("last interval", "", pct(r["hit_rate"]))
    t.caption = f"{h['queries_tokens']} tokens looked up"
    return t


def _queue_table(cur: Sample, summary: dict, r: dict) -> Table:
    t = Table(title="Requests and throughput", title_justify="left")
    t.add_column("")
    t.add_column("now", justify="right")
    running = cur.total("kvos:num_requests_running")
    waiting = cur.total("kvos:num_requests_waiting")
    q = summary["requests"]

    def num(x: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    t.add_row("running", num(running if running is not None else q["running"], "{:.0f}"))
    t.add_row("waiting", num(waiting if waiting is not None else q["waiting"], "{:.0f}"))
    t.add_row("requests/s", num(r["requests"]))
    t.add_row("prompt tok/s", num(r["prompt_tokens"]))
    t.add_row("generated tok/s", num(r["generation_tokens"]))
    t.add_row("computed tok/s", num(r["batched_tokens"]))
    t.add_row("evictions/s", num(r["evictions"]))
    t.add_row("mean TTFT", "-" if r["ttft_s"] is None else f"{1000 * r['ttft_s']:.0f} ms")
    return t


def _top_table(summary: dict) -> Table:
    t = Table(title="Top cached prefixes by hits", title_justify="left")
    for col, just in (("#", "right"), ("hits", "right"), ("tokens", "right"), ("group", "right"),
                      ("engine", "right"), ("state", "left"), ("id", "left")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for p in summary["top_prefixes"]:
        t.add_row(str(p["rank"]), str(p["hits"]), str(p["tokens"]), str(p["group"]), str(p["engine"]),
                  p["state"], p["id"])
    if not summary["top_prefixes"]:
        t.caption = "no cached prefix has been hit yet"
    return t


def _tiers_table(summary: dict) -> Table:
    t = Table(title="Tiers below the device", title_justify="left")
    for col, just in (("tier", "left"), ("engine", "right"), ("used", "right"), ("capacity", "right"),
                      ("usage", "left"), ("hits", "right"), ("misses", "right"), ("hit rate", "right"),
                      ("errors", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for x in summary["tiers"]:
        t.add_row(x["name"], str(x.get("engine", 0)), human_bytes(x["used_bytes"]), human_bytes(x["capacity_bytes"]),
                  Text.assemble(bar(x["used_bytes"], 0, x["capacity_bytes"]), f" {pct(x['usage'])}"),
                  str(x["hits_blocks"]), str(x["misses_blocks"]), pct(x["hit_rate"]),
                  str(x["errors"] + x["checksum_failures"]))
    return t


def _engines_table(summary: dict) -> Table:
    t = Table(title="Engines", title_justify="left")
    for col, just in (("engine", "right"), ("role", "left"), ("up", "left"), ("pid", "right"), ("running", "right"),
                      ("waiting", "right"), ("pages", "left"), ("hit rate", "right"), ("evictions", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in summary["engines"]:
        p = e["pages"]
        t.add_row(str(e["engine"]), e["role"], "up" if e["up"] else Text("down", "bold red"),
                  str(e["pid"] or "-"), str(e["running"]), str(e["waiting"]),
                  Text.assemble(bar(p["used"], p["cached"], p["total"]), f" {p['used']}+{p['cached']}/{p['total']}"),
                  pct(e["hit_rate"]["prefix"]), str(e["evictions"]))
    return t


def render(cur: Sample, prev: Sample | None = None, url: str = "") -> Group:
    """The whole view of one sample (throughput over the interval since ``prev``)."""
    s = cur.summary
    r = rates(cur, prev)
    facts = (f"block {s.get('block_size')} tokens · layout {s.get('kv_layout')} · KV {s.get('kv_cache_dtype')} · "
             f"{len(s['engines'])} engine(s) · {time.strftime('%H:%M:%S')}")
    head = Text.assemble(("kvos top", "bold"), f"  {url}  ", (facts, "dim"))
    legend = Text.assemble(("█ used", "red"), "  ", ("▓ cached", "yellow"), "  ", ("░ free", "green"))
    parts = [head, legend, _pages_table(s)]
    side = Table.grid(padding=(0, 4))
    side.add_row(_hits_table(s, r), _queue_table(cur, s, r))
    parts += [side, _top_table(s)]
    if s["tiers"]:
        parts.append(_tiers_table(s))
    parts.append(_engines_table(s))
    return Group(*parts)


def _error(url: str, err: Exception) -> Panel:
    msg = str(err)
    if isinstance(err, httpx.HTTPStatusError) and err.response.status_code == 401:
        msg = "401: the server wants an API key (--api-key)"
    return Panel(Text(f"cannot read {url}: {msg}", style="bold red"), title="kvos top")


def run(url: str = "http://127.0.0.1:8000", api_key: str | None = None, interval: float = 1.0,
        once: bool = False, top: int = 10, console: Console | None = None) -> int:
    """``once``: two samples ``interval`` apart (for the throughput), one render, exit 0 (1 if
    the server cannot be read). Otherwise refresh every ``interval`` seconds until Ctrl-C."""
    console = console or Console()
    with make_client(url, api_key) as client:
        try:
            prev = fetch(client, top)
            if once:
                time.sleep(interval)
                console.print(render(fetch(client, top), prev, url))
                return 0
        except httpx.HTTPError as err:
            print(f"error: {_error(url, err).renderable}", file=sys.stderr)
            return 1
        try:
            with Live(render(prev, None, url), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    try:
                        cur = fetch(client, top)
                    except httpx.HTTPError as err:
                        live.update(_error(url, err))
                        continue
                    live.update(render(cur, prev, url))
                    prev = cur
        except KeyboardInterrupt:
            return 0
