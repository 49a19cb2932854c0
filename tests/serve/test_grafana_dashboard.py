"""The Grafana dashboard (``deploy/grafana/kvos-dashboard.json``) against what ``/metrics`` really
exports: every metric a panel queries is one the server serves, and every ``kvos:`` family the
server serves has a panel.

The exported names are not listed here: they come from the text the server's own ``/metrics``
route returns (``create_app`` over an ``AsyncEngine``, through a TestClient, engine not started),
rendered twice on one real ``LLMEngine`` (the hybrid ``gemma-3-tiny`` config with random weights, so
two cache groups and no weights to load; CPU and disk tiers; n-gram speculative decoding):
- as a single-engine server: the cache, group, memory, tier and speculative families;
- as a data-parallel server: the same client with ``DataParallelEngine.stats`` (the real
  data-parallel aggregation) over two copies of that engine's stats and a ``RouterStats``,
  which adds the per-engine and router families.
Renaming a metric in ``kvos/serve/metrics.py``, or adding a family with no panel, fails here."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvos-dashboard.json"
NAME = re.compile(r"kvos:[a-zA-Z0-9_:]+")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = '{job=~"$job",instance=~"$instance"'
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count"), "unknown": ("",)}


def _families(text: str) -> dict[str, str]:
    """``kvos:`` family name -> Prometheus type, from exposition text. prometheus_client's
    ``_created`` series of a Counter/Histogram object parse as a gauge family of their own; they
    are bookkeeping, not a family to chart."""
    fams = {f.name: f.type for f in text_string_to_metric_families(text) if f.name.startswith("kvos:")}
    return {n: t for n, t in fams.items()
            if not (n.endswith("_created") and fams.get(n[: -len("_created")]) in ("counter", "histogram"))}


def _scrape(client) -> str:
    from fastapi.testclient import TestClient

    from kvos.serve.app import create_app

    app = create_app(client, "kvos-test", warmup=False)  # no lifespan: the engine thread never starts
    try:
        r = TestClient(app).get("/metrics")
    finally:
        if app.state.kvos.tokenizers is not None:
            app.state.kvos.tokenizers.shutdown()
    assert r.status_code == 200, r.text
    return r.text


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """Every ``kvos:`` family a single-engine or data-parallel server exports -> its type."""
    from kvos import LLM
    from kvos.distributed.dp_engine import DataParallelEngine, RouterStats
    from kvos.engine.async_engine import AsyncEngine

    llm = LLM(model="gemma-3-tiny", random_weights=True, cpu_cache_gb=0.01, disk_cache_gb=0.01,
              disk_cache_dir=str(tmp_path_factory.mktemp("disk-tier")),
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = llm.engine
    single = _families(_scrape(AsyncEngine(engine)))

    dp_client = AsyncEngine(engine)
    encoder = {k: 1 for k in ("encoder_runs", "encodings_received", "encoder_cache_hits", "encoder_cache_evictions",
                              "encoder_cache_entries", "encoder_cache_bytes", "encoder_cache_pages",
                              "encoder_cache_capacity_bytes")}  # as a vision-language model's engines report
    fleet = SimpleNamespace(engine_stats=[{**engine.stats(), "pid": os.getpid(), "encoder": encoder} for _ in range(2)],
                            down=[False, False], down_reason=[None, None], _retired={}, num_decode=1,
                            router_name="kv_aware",
                            router_stats=RouterStats(routed=[1, 0]), encoders=object(), encoder_down=[False],
                            encoder_engine_stats={"encoder_engine_runs": 1, "encoder_engine_seconds": 0.1,
                                                  "encoder_engine_failures": 0, "encodings_sent": 1})
    dp_client.stats = lambda: DataParallelEngine.stats(fleet)
    data_parallel = _families(_scrape(dp_client))

    fams = {**single, **data_parallel}
    for part in ("kvos:kv_cache_group_blocks", "kvos:kv_cache_held_bytes", "kvos:tier_usage_bytes",
                 "kvos:spec_decode_num_drafts", "kvos:engine_up", "kvos:router_requests",
                 "kvos:time_to_first_token_seconds", "kvos:request_rejected", "kvos:encoder_engine_runs"):
        assert part in fams, f"the rendering no longer covers {part}: {sorted(fams)}"
    return fams


def _sample_names(fams: dict[str, str]) -> dict[str, str]:
    """Each series name Prometheus stores (``_total``, ``_bucket``, ...) -> its family."""
    return {name + suffix: name for name, kind in fams.items() for suffix in SUFFIXES[kind]}


def _panels(items: list[dict]):
    for p in items:
        yield p
        yield from _panels(p.get("panels", []))  # a collapsed row holds its panels


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target."""
    return [(p["title"], t["expr"]) for p in _panels(dashboard["panels"]) if p["type"] != "row"
            for t in p["targets"]]


def test_every_panel_has_a_title_a_datasource_and_queries(dashboard):
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    ids = [p["id"] for p in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert len(panels) > 40
    for p in _panels(dashboard["panels"]):
        assert p.get("title", "").strip(), f"panel {p['id']} has no title"
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys(), p["title"]
    for p in panels:
        assert p.get("datasource") == DATASOURCE, f"{p['title']!r}: datasource {p.get('datasource')!r}"
        assert p.get("description"), f"{p['title']!r} has no description"
        assert p["targets"], f"{p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("datasource") == DATASOURCE and NAME.search(t["expr"]), (p["title"], t)


def test_every_query_names_an_exported_metric(dashboard, exported):
    series = _sample_names(exported)
    queries = _queries(dashboard) + [(f"variable {v['name']}", v["definition"])
                                     for v in dashboard["templating"]["list"] if v["type"] == "query"]
    unknown = sorted({(title, name) for title, expr in queries for name in NAME.findall(expr) if name not in series})
    assert not unknown, f"panels query series /metrics does not export (counters end in _total, histograms in " \
                        f"_bucket/_sum/_count): {unknown}"


def test_every_exported_family_has_a_panel(dashboard, exported):
    charted = {exported_family for name in NAME.findall(" ".join(e for _, e in _queries(dashboard)))
               if (exported_family := _sample_names(exported).get(name))}
    missing = sorted(set(exported) - charted)
    assert not missing, f"kvos: families /metrics exports with no panel in {DASHBOARD.name}: {missing}"


def test_queries_are_well_formed_promql(dashboard, exported):
    """rate/increase only over counter series, histogram_quantile over ``_bucket`` summed by
    ``le``, balanced brackets, and the job/instance variables on every selector."""
    series = _sample_names(exported)
    for title, expr in _queries(dashboard):
        for fn, name in re.findall(r"\b(rate|irate|increase)\(\s*(kvos:[a-zA-Z0-9_:]+)", expr):
            assert exported.get(series.get(name)) in ("counter", "histogram") and name != series[name], \
                f"{title!r}: {fn}() over {name}, which is not a counter series"
        for m in re.finditer(r"histogram_quantile\(", expr):
            hq = re.match(r"histogram_quantile\(\s*0?\.\d+\s*,\s*sum by \(([^)]*)\)\s*\(rate\((kvos:[a-zA-Z0-9_:]+)",
                          expr[m.start():])
            assert hq and "le" in [x.strip() for x in hq.group(1).split(",")] and hq.group(2).endswith("_bucket") \
                and exported.get(series.get(hq.group(2))) == "histogram", f"{title!r}: {expr}"
        for name in NAME.finditer(expr):
            assert expr[name.end():].startswith(SELECTOR), f"{title!r}: {name.group()} lacks {SELECTOR}...}}"
        depth = {"(": 0, "[": 0, "{": 0}
        closing = {")": "(", "]": "[", "}": "{"}
        for ch in re.sub(r'"[^"]*"', '""', expr):
            if ch in depth:
                depth[ch] += 1
            elif ch in closing:
                depth[closing[ch]] -= 1
                assert depth[closing[ch]] >= 0, f"{title!r}: unbalanced {ch} in {expr}"
        assert not any(depth.values()), f"{title!r}: unbalanced brackets in {expr}"


def test_prometheus_and_grafana_provisioning_fit_together(dashboard):
    import yaml

    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "kvos")
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert job.get("scrape_interval", prom["global"]["scrape_interval"]) == "5s"
    prov = ROOT / "deploy" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "kvos.yaml").read_text())["datasources"][0]
    assert ds["type"] == "prometheus" and ds["url"] == "http://127.0.0.1:9090"
    current = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")["current"]
    assert current["value"] == ds["uid"] and current["text"] == ds["name"]
    provider = yaml.safe_load((prov / "dashboards" / "kvos.yaml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"].endswith("deploy/grafana")
