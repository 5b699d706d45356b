"""The control plane's HTTP routes (``/xmix/v1/apps``, ``/xmix/v1/status``, the console),
their OpenAPI schemas, and the statuses xmix adds to vLLM's own routes in the server's
OpenAPI document. Every route checks the admin or inference key itself (tenants.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xmix import settings
from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.errors import CapacityError, EngineGone, shown
from xmix.integrations.vllm.frontend import metrics
from xmix.integrations.vllm.frontend.engine_rpc import after_late
from xmix.integrations.vllm.http.auth import BodyTooLarge, error_body, read_body
from xmix.integrations.vllm.http.console.router import console_router
from xmix.integrations.vllm.http.server_state import ServerState
from xmix.lang import deploy_work
from xmix.lang.api import AppError, LimitError
from xmix.lang.lowering import DeployError
from xmix.runtime.control import MODES, RequestError

MAX_PATCH_BYTES = 1 << 16


def max_app_bytes() -> int:
    """Largest app file a POST may send (``XMIX_MAX_APP_BYTES``, default 1 GiB)."""
    return int(settings.get("XMIX_MAX_APP_BYTES"))


# Routes whose answers xmix adds to: a request whose key's policy forbids an app, or that sets
# a parameter the operator locked, is a 403 there.
XMIX_STATUSES = {
    "/v1/completions": "post",
    "/v1/chat/completions": "post",
    "/invocations": "post",
    "/v1/responses": "post",
    "/v1/messages": "post",
    "/v1/chat/completions/batch": "post",
    "/inference/v1/generate": "post",
}


def document_statuses(app) -> None:
    """Declare, in the server's OpenAPI document, the statuses xmix adds to vLLM's routes."""
    orig = app.openapi

    def openapi():
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = orig()
        for path, method in XMIX_STATUSES.items():
            op = schema.get("paths", {}).get(path, {}).get(method)
            if op is not None:
                op.setdefault("responses", {}).setdefault(
                    "403",
                    {
                        "description": "xmix: the key's policy does not allow an app the request names, "
                        "or the request sets a parameter the operator locked"
                    },
                )
        return schema

    app.openapi = openapi


# OpenAPI: what the control plane takes and answers (schemathesis checks responses against it).
_ERR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "integer"},
            },
        }
    },
}


def _responses(ok: dict[int, str], *errors: int) -> dict:
    what = {
        400: "bad request (names what is wrong)",
        401: "no or wrong key",
        403: "this key may not do this, or the control plane is off",
        404: "no such app",
        409: "an app of that name is deployed",
        413: "too large (names the limit)",
        422: "the app does not fit the model, or a refused mode/parameter",
        503: "xmix is not initialised, or the server is shutting down",
        507: "the engine has no room for the app (names the limit)",
    }
    out: dict = {s: {"description": d} for s, d in ok.items()}
    for s in errors:
        out[s] = {"description": what[s], "content": {"application/json": {"schema": _ERR_SCHEMA}}}
    return out


_APP_SCHEMA = {
    "type": "object",
    "required": ["name", "mode"],
    "properties": {
        "name": {"type": "string"},
        "mode": {"type": "string", "enum": list(MODES)},
        "sites": {"type": "array", "items": {"type": "string"}},
        "reads": {"type": "array", "items": {"type": "string"}},
        "writes": {"type": "boolean"},
        "stateful": {"type": "boolean"},
        "params": {"type": "object", "additionalProperties": {"type": "number"}},
        "version": {"type": "integer"},
        "locked": {"type": "array", "items": {"type": "string"}},
        "metadata": {"type": "object"},
    },
}
_PATCH_SCHEMA = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": False,
    "properties": {
        "mode": {"type": "string", "enum": list(MODES)},
        "params": {"type": "object", "additionalProperties": {"type": "number"}},
        "locked": {"oneOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "string"}}]},
    },
}


def _json_ok(schema: dict, text: str) -> dict:
    return {"description": text, "content": {"application/json": {"schema": schema}}}


def _error(status: int, msg: str) -> JSONResponse:
    return JSONResponse(error_body(status, msg), status_code=status)


def _state_of(request: Request) -> ServerState | None:
    return getattr(request.app.state, "xmix", None)


async def guard(request: Request, write: bool = False, action: str = "", app: str | None = None):
    st = _state_of(request)
    if st is None:
        return None, _error(503, "xmix is not initialised on this server")
    header = request.headers.get("Authorization")
    refused = st.auth.check_change(header) if write else st.auth.check_read(header)
    if refused is not None:
        status, msg = refused
        if write:
            st.audit.record(
                st.auth.fingerprint(header),
                action,
                app,
                status,
                "refused: " + msg.split(":")[0],
            )
        return None, _error(status, msg)
    if write and st.gone():
        return None, _error(503, "the engine has stopped (the server is shutting down)")
    return st, None


def _audit(
    st: ServerState,
    request: Request,
    action: str,
    app: str | None,
    status: int,
    result: str,
    **details,
) -> None:
    st.audit.record(
        st.auth.fingerprint(request.headers.get("Authorization")),
        action,
        app,
        status,
        result,
        **details,
    )


async def list_apps(request: Request):
    st, err = await guard(request)
    if err:
        return err
    try:
        apps = await asyncio.to_thread(st.ctl.apps)
    except EngineGone as e:
        return _error(503, str(e))
    policy = st.ctl.registry.policy
    apps = [a for a in apps if tenants.may_see(a["name"], a["mode"], policy)]
    if metrics.app_labels_mode() == "hashed":
        for a in apps:  # what /metrics shows for each app (names hidden there)
            a["metrics_label"] = metrics.app_label(a["name"])
    return {"apps": apps}


async def status(request: Request):
    """Per worker: apps, per-app counters of refused non-finite writes and site-program
    failures, request slots in use, step counters. The admin key only."""
    st, err = await guard(request)
    if err:
        return err
    caller = tenants.current()
    if st.auth.has_admin and not (caller is not None and caller.admin):
        return _error(403, "forbidden: the status takes the admin key (--xmix-admin-key)")
    t = caller.tenant if caller is not None and not caller.admin else None
    if t is not None and t.apps is not None:
        # it names every deployed app, and this key's policy hides some of them
        return _error(
            403,
            "forbidden: the status names every app; this key's policy "
            f"(tenant {t.name!r}) does not let it see every app",
        )
    try:
        workers = await asyncio.to_thread(st.status)
    except EngineGone as e:
        return _error(503, str(e))
    # this API server's own counts (app files parsed, apps lowered, programs decoded)
    return {"workers": workers, "server": {"deploy_work": deploy_work.snapshot()}}


async def deploy_app(request: Request, mode: str = "request", locked: str = "false"):
    st, err = await guard(request, True, "deploy")
    if err:
        return err

    def refuse(status: int, msg: str, name: str | None = None) -> JSONResponse:
        _audit(st, request, "deploy", name, status, "refused", mode=shown(mode), reason=msg[:300])
        return _error(status, msg)

    if mode not in MODES:
        return refuse(400, f"mode must be one of {list(MODES)}, got {shown(mode)}")
    lock: Any = {"true": True, "false": False}.get(locked.lower())
    if lock is None:
        lock = [k for k in locked.split(",") if k]
    try:
        body = await read_body(request, max_app_bytes())
    except BodyTooLarge as e:
        return refuse(413, f"app file: {e} (XMIX_MAX_APP_BYTES)")
    if not body:
        return refuse(400, "empty body: send the app file (safetensors with an xmix spec)")
    async with st.lock:
        try:
            info = await asyncio.to_thread(
                st.ctl.deploy, body, mode, allow_custom=False, locked=lock
            )
        except CapacityError as e:
            return refuse(507, str(e))
        except DeployError as e:
            return refuse(409 if "already deployed" in str(e) else 422, str(e))
        except LimitError as e:
            return refuse(413, str(e))
        except AppError as e:
            return refuse(400, str(e))
        except EngineGone as e:  # the engine went away under the change
            return refuse(503, f"deploy did not complete: {e}{after_late(e, 'deploy')}")
    _audit(
        st,
        request,
        "deploy",
        info["name"],
        201,
        "deployed",
        mode=mode,
        version=info["version"],
        sites=len(info["sites"]),
        locked=info["locked"] or None,
    )
    return JSONResponse(info, status_code=201)


async def patch_app(name: str, request: Request):
    st, err = await guard(request, True, "patch", name)
    if err:
        return err

    def refuse(status: int, msg: str) -> JSONResponse:
        _audit(st, request, "patch", shown(name), status, "refused", reason=msg[:300])
        return _error(status, msg)

    try:
        body = json.loads(await read_body(request, MAX_PATCH_BYTES) or b"{}")
    except BodyTooLarge as e:
        return refuse(413, str(e))
    except json.JSONDecodeError as e:
        return refuse(400, f"body is not valid JSON: {e.msg}")
    except (RecursionError, ValueError, UnicodeDecodeError):
        return refuse(400, "body is not valid JSON (nested too deeply or not UTF-8)")
    if not isinstance(body, dict) or not body or set(body) - {"mode", "params", "locked"}:
        return refuse(400, 'body must be an object with "mode", "params" and/or "locked"')
    mode, params, locked = body.get("mode"), body.get("params"), body.get("locked")
    if "mode" in body and not isinstance(mode, str):
        return refuse(400, f'"mode" must be one of {list(MODES)}')
    if "params" in body and not isinstance(params, dict):
        return refuse(400, '"params" must be an object {name: number}')
    if "locked" in body and not isinstance(locked, (bool, list)):
        return refuse(400, '"locked" must be true, false or a list of parameter names')
    async with st.lock:
        await asyncio.to_thread(st.ctl.sync)
        if name not in st.ctl.registry.apps:
            return refuse(404, f"app {shown(name)} is not deployed")
        try:
            info = await asyncio.to_thread(st.ctl.patch, name, mode, params, locked)
        except (DeployError, RequestError) as e:
            return refuse(422, str(e))
        except EngineGone as e:
            return refuse(503, f"change did not complete: {e}{after_late(e, 'patch')}")
    _audit(
        st,
        request,
        "patch",
        name,
        200,
        "changed",
        mode=mode,
        params=params,
        locked=locked,
        version=info["version"],
    )
    return info


async def delete_app(name: str, request: Request):
    st, err = await guard(request, True, "undeploy", name)
    if err:
        return err
    async with st.lock:
        await asyncio.to_thread(st.ctl.sync)
        if name not in st.ctl.registry.apps:
            _audit(st, request, "undeploy", shown(name), 404, "refused: not deployed")
            return _error(404, f"app {shown(name)} is not deployed")
        try:
            await asyncio.to_thread(st.ctl.undeploy, name)
        except EngineGone as e:
            msg = f"undeploy did not complete: {e}{after_late(e, 'undeploy')}"
            _audit(st, request, "undeploy", name, 503, "refused", reason=msg[:300])
            return _error(503, msg)
    _audit(st, request, "undeploy", name, 200, "undeployed")
    return {"deleted": name}


def build_router() -> APIRouter:
    router = APIRouter(tags=["xmix"])
    router.get(
        "/xmix/v1/apps",
        responses=_responses({200: "the deployed apps this key may see"}, 401, 503)
        | {
            200: _json_ok(
                {"type": "object", "properties": {"apps": {"type": "array", "items": _APP_SCHEMA}}},
                "the deployed apps this key may see",
            )
        },
    )(list_apps)
    router.get(
        "/xmix/v1/status",
        responses=_responses({200: "what each worker reports"}, 401, 403, 503)
        | {
            200: _json_ok(
                {
                    "type": "object",
                    "properties": {
                        "workers": {"type": "array", "items": {"type": "object"}},
                        "server": {"type": "object"},
                    },
                },
                "what each worker reports, and this API server's deploy work",
            )
        },
    )(status)
    router.post(
        "/xmix/v1/apps",
        status_code=201,
        responses=_responses({201: "deployed"}, 400, 401, 403, 409, 413, 422, 503, 507)
        | {201: _json_ok(_APP_SCHEMA, "deployed")},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
                },
            }
        },
    )(deploy_app)
    router.patch(
        "/xmix/v1/apps/{name}",
        responses=_responses({200: "changed"}, 400, 401, 403, 404, 413, 422, 503)
        | {200: _json_ok(_APP_SCHEMA, "changed")},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _PATCH_SCHEMA}},
            }
        },
    )(patch_app)
    router.delete(
        "/xmix/v1/apps/{name}",
        responses=_responses({200: "undeployed"}, 401, 403, 404, 503)
        | {
            200: _json_ok(
                {"type": "object", "properties": {"deleted": {"type": "string"}}}, "undeployed"
            )
        },
    )(delete_app)
    router.include_router(console_router(guard))
    return router
