"""``GET /v1/kv/summary``: the server's KV memory as JSON, for ``kvos top`` and dashboards.

Pages by cache group and state, hit rates, tiers, engines, and the cached prefixes that prefix
hits took most often. No token ids or text leave the server: a prefix is its hit count, its
length and an opaque id (a digest of its last block's hash keyed by a secret of this process, so
it names the prefix from one refresh to the next, but a client cannot compute it from a prompt
and so cannot ask whether someone sent one).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from fastapi import APIRouter, Query

from kvos.serve.state import ServerState

_ID_KEY = os.urandom(16)
STATES = ("free", "cached", "used")


def prefix_id(block_hash_hex: str) -> str:
    """A prefix's opaque id: 12 hex digits of a keyed digest of its last block's hash."""
    return hashlib.blake2b(bytes.fromhex(block_hash_hex), key=_ID_KEY, digest_size=6).hexdigest()


def kv_summary_router(state: ServerState, dependencies: Sequence) -> APIRouter:
    """The route, behind the same API-key check as the rest of ``/v1``."""
    router = APIRouter(prefix="/v1", dependencies=list(dependencies))

    @router.get("/kv/summary")
    async def kv_summary(top: int = Query(10, ge=0, le=100, description="how many top prefixes")):
        top_rows = await state.engine.top_prefixes(top) if top else []
        return summarize(state._stats(), top_rows)

    return router


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _pages(s: dict) -> dict:
    """The pool in large pages (blocks, for one group of one block a page) by state, and bytes."""
    page_bytes = s.get("page_bytes") or 0
    out = {k: s.get(k, 0) for k in ("total", *STATES)}
    out["usage"] = _ratio(out["used"], out["total"])
    out["page_bytes"] = page_bytes
    out["bytes"] = {k: out[k] * page_bytes for k in ("total", *STATES)}
    return out


def _groups(s: dict) -> list[dict]:
    """Each cache group's blocks (small pages) by state, in the large pages it holds."""
    out = []
    for i, g in enumerate(s.get("groups", [])):
        per_page = g.get("blocks_per_large_page", 1)
        block_bytes = g.get("page_bytes", 0)
        row = {"group": i, "kind": g.get("kind"), "role": g.get("role"), "window": g.get("window"),
               "layers": len(g.get("layers", [])), "block_size": s.get("block_size"), "block_bytes": block_bytes,
               "blocks_per_page": per_page, "pages": g.get("total", 0) // max(1, per_page),
               **{k: g.get(k, 0) for k in ("total", *STATES)}}
        row["usage"] = _ratio(row["used"], row["total"])
        row["bytes"] = {k: row[k] * block_bytes for k in ("total", *STATES)}
        out.append(row)
    return out


def _hit_rate(s: dict) -> dict:
    """Prompt tokens looked up in the prefix cache and where the hits came from: the device's
    own cache or a tier below it (CPU, disk, remote, transfer)."""
    queries, hits = s.get("prefix_queries_tokens", 0), s.get("prefix_hits_tokens", 0)
    tier = s.get("tier_hits_tokens", 0)
    return {"queries_tokens": queries, "hits_tokens": hits, "device_hits_tokens": hits - tier,
            "tier_hits_tokens": tier, "prefix": _ratio(hits, queries), "device": _ratio(hits - tier, queries),
            "tiers": _ratio(tier, queries)}


def _tiers(s: dict, engine: int | None) -> list[dict]:
    out = []
    for t in s.get("tiers", []):
        hits, misses = t.get("hits_blocks", 0), t.get("misses_blocks", 0)
        out.append({"name": t["name"], **({"engine": engine} if engine is not None else {}),
                    "used_bytes": t.get("used_bytes", 0), "capacity_bytes": t.get("capacity_bytes", 0),
                    "usage": t.get("usage", 0.0), "hits_blocks": hits, "misses_blocks": misses,
                    "hit_rate": _ratio(hits, hits + misses), "evictions": t.get("evictions", 0),
                    "errors": t.get("errors", 0), "checksum_failures": t.get("checksum_failures", 0)})
    return out


def _sum_groups(per_engine: list[list[dict]]) -> list[dict]:
    """Data parallel: the engines' groups (the same layout on each) added up."""
    total = [dict(g, bytes=dict(g["bytes"])) for g in per_engine[0]]
    for groups in per_engine[1:]:
        for acc, g in zip(total, groups):
            for k in ("pages", "total", *STATES):
                acc[k] += g[k]
            for k in acc["bytes"]:
                acc["bytes"][k] += g["bytes"][k]
    for acc in total:
        acc["usage"] = _ratio(acc["used"], acc["total"])
    return total


def summarize(stats: dict, top: list[dict]) -> dict:
    """The summary's JSON from the client's ``stats()`` (one engine's, or a data-parallel
    client's sums with ``engines``) and its ``top_prefixes``."""
    many = "engines" in stats
    raw = stats["engines"] if many else [{"engine": 0, "up": True, "pid": os.getpid(), **stats}]  # in this process
    engines, groups, tiers = [], [], []
    for e in raw:
        i = e.get("engine", 0)
        g = _groups(e)
        row = {"engine": i, "role": e.get("role", "decode"), "up": bool(e.get("up", True)), "pid": e.get("pid"),
               "running": e.get("running", 0), "waiting": e.get("waiting", 0), "pages": _pages(e),
               "hit_rate": _hit_rate(e), "evictions": e.get("evictions", 0)}
        engines.append(row)
        if row["up"]:
            groups.append(g)
            tiers += _tiers(e, i if many else None)
    up = [e for e in engines if e["up"]] or engines[:1]
    pages = {k: sum(e["pages"][k] for e in up) for k in ("total", *STATES)}
    pages["usage"] = _ratio(pages["used"], pages["total"])
    pages["page_bytes"] = up[0]["pages"]["page_bytes"]
    pages["bytes"] = {k: sum(e["pages"]["bytes"][k] for e in up) for k in ("total", *STATES)}
    return {
        "object": "kv.summary",
        "block_size": raw[0].get("block_size"),  # (a data-parallel client sums every number it can)
        "kv_layout": raw[0].get("kv_layout"),
        "kv_cache_dtype": raw[0].get("kv_cache_dtype"),
        "pages": pages,
        "groups": _sum_groups(groups) if groups else [],
        "hit_rate": _hit_rate(stats),
        "counters": {k: stats.get(k, 0) for k in ("evictions", "preemptions", "recomputed_tokens", "cow_copies",
                                                    "steps", "batched_tokens")},
        "requests": {"running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                     "loading": stats.get("loading", 0)},
        "tiers": tiers,
        "engines": engines,
        "top_prefixes": [{"rank": n + 1, "engine": r.get("engine", 0), "group": r["group"], "hits": r["hits"],
                          "tokens": r["tokens"], "state": r["state"], "id": prefix_id(r["hash"])}
                         for n, r in enumerate(top)],
    }
