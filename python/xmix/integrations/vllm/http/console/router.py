"""The xmix console's routes on ``xmix serve``.

``/xmix/ui/`` serves three static files (HTML, JS, CSS) shipped in the package. They carry no
data, so they are served without the API key: a browser cannot attach a Bearer header to a
page it navigates to, and the page has to load before it can ask for the key. Every piece of
data the page shows comes from authenticated calls it makes with ``fetch`` and the key the
user typed: the control plane (``/xmix/v1/apps``), vLLM's own endpoints (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``) and the helpers below, which
take the same Bearer token as the control plane:

    POST /xmix/v1/console/tokens     {"ids": [...]}: the text of each token, decoded alone
    POST /xmix/v1/console/decisions  {"app", "ids", "prompt_len", "results", "params"}: on
                                     which positions each conditioned op's condition held,
                                     as far as the results determine it (decisions.py)
    GET  /xmix/v1/console/info       the model's name, layers and hook sites
    GET  /xmix/v1/console/live       per-app counters of /metrics (live.py)
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from xmix.lang.sites import LAYER_SITES, MODEL_SITES
from xmix.version import __version__

from . import decisions as D
from . import live

STATIC = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# The page runs only its own script and style and talks only to this server.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
MAX_BODY = 16 << 20
MAX_TOKENS = 1 << 17

Guard = Callable[[Request], Awaitable[tuple[Any, JSONResponse | None]]]


def static_file(name: str) -> bytes:
    return (resources.files("xmix.integrations.vllm.http.console") / "static" / name).read_bytes()


def _error(status: int, msg: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": msg, "type": "xmix_error", "code": status}}, status_code=status
    )


async def _json_body(request: Request) -> tuple[Any, JSONResponse | None]:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        return None, _error(413, f"body of {size} bytes exceeds the limit of {MAX_BODY}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            return None, _error(413, f"body exceeds the limit of {MAX_BODY} bytes")
    try:
        return json.loads(body or b"null"), None
    except (ValueError, RecursionError) as e:
        return None, _error(400, f"body is not valid JSON: {str(e)[:200]}")


def _ids(value: Any, vocab: int) -> list[int] | str:
    if not isinstance(value, list) or len(value) > MAX_TOKENS:
        return f'"ids" must be a list of at most {MAX_TOKENS} token ids'
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in value):
        return f'"ids" must hold token ids in 0..{vocab - 1}'
    return value


def console_router(guard: Guard) -> APIRouter:
    """``guard(request)`` -> (server state with ``.ctl``, None) or (None, error response): the
    control plane's authentication. What the helpers return about apps is limited to the apps
    the caller's policy lets it see (``tenants.may_see``): another app is answered as one that
    is not deployed."""
    router = APIRouter()

    @router.get("/xmix/ui", include_in_schema=False)
    async def ui_root():
        # Relative, so the page keeps working behind a proxy that mounts the server elsewhere.
        return RedirectResponse("ui/", status_code=307)

    @router.get("/xmix/ui/", include_in_schema=False)
    async def ui_index():
        return Response(
            static_file("index.html"), media_type=STATIC["index.html"], headers=SECURITY_HEADERS
        )

    @router.get("/xmix/ui/{name}", include_in_schema=False)
    async def ui_file(name: str):
        if name not in STATIC:
            return _error(404, f"no console file {name[:80]!r}")
        return Response(static_file(name), media_type=STATIC[name], headers=SECURITY_HEADERS)

    @router.get("/xmix/v1/console/info")
    async def info(request: Request):
        st, err = await guard(request)
        if err:
            return err
        shape = st.ctl.registry.shape
        return {
            "model": shape.model_name,
            "n_layers": shape.n_layers,
            "layer_sites": list(LAYER_SITES),
            "model_sites": list(MODEL_SITES),
            "moe_layers": list(shape.moe_layers),
            "xmix_version": __version__,
        }

    @router.post("/xmix/v1/console/tokens")
    async def tokens(request: Request):
        st, err = await guard(request)
        if err:
            return err
        body, err = await _json_body(request)
        if err:
            return err
        reg = st.ctl.registry
        if not isinstance(body, dict) or set(body) != {"ids"}:
            return _error(400, 'body must be {"ids": [token id, ...]}')
        ids = _ids(body["ids"], reg.shape.vocab_size)
        if isinstance(ids, str):
            return _error(400, ids)
        tok = reg.tokenizer
        if tok is None:
            return _error(503, "this server has no tokenizer")
        return {"texts": [tok.decode([i]) for i in ids]}

    @router.post("/xmix/v1/console/decisions")
    async def decisions(request: Request):
        st, err = await guard(request)
        if err:
            return err
        body, err = await _json_body(request)
        if err:
            return err
        reg = st.ctl.registry
        from xmix.integrations.vllm.tenants import may_see

        if (
            not isinstance(body, dict)
            or not {"app", "ids", "prompt_len"} <= set(body)
            or set(body) - {"app", "ids", "prompt_len", "results", "params"}
        ):
            return _error(400, 'body must be {"app", "ids", "prompt_len", "results", "params"}')
        ids = _ids(body["ids"], reg.shape.vocab_size)
        if isinstance(ids, str):
            return _error(400, ids)
        p = body["prompt_len"]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 < p <= len(ids):
            return _error(400, f'"prompt_len" must be an integer in 1..{len(ids)}')
        results, params = body.get("results") or {}, body.get("params") or {}
        if not isinstance(results, dict) or not isinstance(params, dict):
            return _error(400, '"results" and "params" must be objects')
        if not all(
            isinstance(k, str)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            for k, v in params.items()
        ):
            return _error(400, '"params" must map names to finite numbers')
        with reg.lock:
            d = reg.apps.get(body["app"]) if isinstance(body["app"], str) else None
            if d is None or not may_see(d.app.name, d.mode, reg.policy):
                # an app the caller's policy hides is answered as one that is not deployed
                return _error(404, f"app {str(body['app'])[:80]!r} is not deployed")
            lowered, defaults = d.lowered, dict(d.defaults)
        ops = D.decisions(lowered, ids, p, results, {**defaults, **params})
        return {"app": body["app"], "ops": ops}

    @router.get("/xmix/v1/console/live")
    async def live_view(request: Request):
        st, err = await guard(request)
        if err:
            return err
        from xmix.integrations.vllm.frontend import metrics
        from xmix.integrations.vllm.frontend.usage import gates_of
        from xmix.integrations.vllm.tenants import may_see

        m = metrics.get()
        if m is None or "gate_tokens" not in m:
            return _error(503, "prometheus_client is not available: no counters")
        # apps() follows the engines' ledger through an RPC that waits on this event loop:
        # called on the loop itself it would block the whole server, so it runs in a thread
        reg = st.ctl.registry
        apps = [
            a
            for a in await asyncio.to_thread(st.ctl.apps)
            if may_see(a["name"], a["mode"], reg.policy)
        ]
        with reg.lock:
            gates = {
                a["name"]: [g.label for g in gates_of(d.lowered, d.defaults, {})]
                for a in apps
                if (d := reg.apps.get(a["name"])) is not None
            }
        return live.snapshot(m, reg.shape.model_name, apps, metrics.shown, gates)

    return router
