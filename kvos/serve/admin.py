"""``/admin/engines``: an operator drains, resumes, removes or adds engines of a running fleet
(``kvos serve --data-parallel N --admin-key KEY``). Every route needs ``Authorization: Bearer
KEY`` with the admin key (compared in constant time); without ``--admin-key`` they answer 403.
A single-engine server has no fleet: 400 naming ``engine``."""
from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request

from kvos.serve.errors import APIError


def _admin_auth(admin_key: str | None):
    async def check(request: Request) -> None:
        if not admin_key:
            raise APIError(403, "admin endpoints are off: start the server with --admin-key", code="admin_disabled")
        header = request.headers.get("authorization", "")
        key = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(key.encode(), admin_key.encode()):
            raise APIError(401, "Invalid or missing admin key (send Authorization: Bearer ADMIN_KEY)",
                           code="invalid_admin_key")
    return check


def add_admin_routes(app: FastAPI, engine, admin_key: str | None) -> None:
    """The routes over ``engine`` (a ``DataParallelEngine``; anything else is refused per call)."""
    auth = [Depends(_admin_auth(admin_key))]

    def fleet():
        if not hasattr(engine, "drain_engine"):
            raise APIError(400, "engine: this server runs one engine in its process; start it with --data-parallel "
                           "or --transport process to manage engines", param="engine")
        return engine

    def listing() -> dict:
        f = fleet()
        return {"engines": [{"engine": i, "state": f.down_reason[i] or "up",
                             "role": "decode" if i < f.num_decode else "prefill", **f.placements[i]}
                            for i in range(len(f.down)) if f.down_reason[i] != "removed"]}

    def call(fn, *args):
        try:
            return fn(*args)
        except ValueError as e:
            raise APIError(400, str(e), param="engine") from None

    @app.get("/admin/engines", dependencies=auth)
    async def engines():
        return listing()

    @app.post("/admin/engines/{index}/drain", dependencies=auth)
    async def drain(index: int):
        call(fleet().drain_engine, index)
        return listing()

    @app.post("/admin/engines/{index}/resume", dependencies=auth)
    async def resume(index: int):
        call(fleet().resume_engine, index)
        return listing()

    @app.delete("/admin/engines/{index}", dependencies=auth)
    async def remove(index: int, timeout_s: float = 30.0):
        f = fleet()
        try:
            left = await f.remove_engine(index, timeout_s)
        except ValueError as e:
            raise APIError(400, str(e), param="engine") from None
        return {"removed": index, "requests_moved_or_cut": left, **listing()}

    @app.post("/admin/engines", dependencies=auth)
    async def add():
        f = fleet()
        try:
            index = await f.add_engine()
        except ValueError as e:
            raise APIError(400, str(e), param="engine") from None
        return {"added": index, **listing()}
