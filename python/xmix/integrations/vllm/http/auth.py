"""Per request, before any route: who is calling (kept for admission), and two doors vLLM
leaves open (``RequestAppsAuth``); the bounded body reads and the error body the control
plane's routes share."""

from __future__ import annotations

import json
import logging
import os

from fastapi import Request
from fastapi.responses import JSONResponse

from xmix import settings
from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.errors import shown
from xmix.integrations.vllm.http.server_state import ServerState
from xmix.integrations.vllm.request_controls import has_control

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


def max_open_body_bytes() -> int:
    """Largest body read to look for an xmix control in an unauthenticated request to a
    route vLLM does not guard (``XMIX_MAX_OPEN_BODY_BYTES``, default 64 MiB)."""
    return int(settings.get("XMIX_MAX_OPEN_BODY_BYTES"))


def error_body(status: int, msg: str) -> dict:
    return {"error": {"message": msg, "type": "xmix_error", "code": status}}


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read chunk by chunk and cut off as soon as it passes ``limit``
    (a chunked body has no Content-Length to check first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"body of {declared} bytes exceeds the limit of {limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _carries_xmix(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return False  # not a request vLLM would accept either
    xargs = doc.get("vllm_xargs") if isinstance(doc, dict) else None
    return isinstance(xargs, dict) and has_control(xargs)


def _rpc_method(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    m = doc.get("method") if isinstance(doc, dict) else None
    return m if isinstance(m, str) else None


DEV_RPC_PATH = "/collective_rpc"
# With --api-server-count N the servers share one port (SO_REUSEPORT): every response names
# the process that answered it, so a client (and the tests) can tell them apart.
SERVER_HEADER = b"x-xmix-server"
SERVER_ID = str(os.getpid()).encode()
MAX_RPC_BODY = 1 << 20


class RequestAppsAuth:
    """Per request: who is calling (the caller's key fingerprint and policy tenant, kept for
    admission), and two doors vLLM leaves open.

    - Per-request app use follows the inference keys on every route. vLLM's ``--api-key``
      guards only /v1, /v2, /inference and /cohere; a request to another route that accepts
      ``vllm_xargs`` (SageMaker's /invocations) and carries an xmix control must bring a key
      when the server has them. Such bodies are read (up to ``XMIX_MAX_OPEN_BODY_BYTES``) and
      replayed to the route unchanged.
    - vLLM's dev-mode ``/collective_rpc`` (VLLM_SERVER_DEV_MODE=1) runs any worker method,
      xmix's included, behind the frontend's back: an app undeployed there stayed in the
      registry. Calls of xmix's worker methods there are refused; the control plane is the
      way to change apps."""

    def __init__(self, app, server) -> None:
        self.app = app
        self.server = server
        try:
            from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX
        except ImportError:  # pragma: no cover - another vLLM layout
            GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
        # the control plane's own routes check the key themselves
        self.guarded = (*GUARDED_PREFIX, "/xmix/")

    async def __call__(self, scope, receive, send) -> None:
        st = getattr(self.server.state, "xmix", None) if scope["type"] == "http" else None
        if st is None:
            return await self.app(scope, receive, send)

        async def send_named(msg):  # which API server process answered (Scale-out)
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), (SERVER_HEADER, SERVER_ID)]}
            await send(msg)

        from starlette.datastructures import Headers

        header = Headers(scope=scope).get("authorization")
        token = tenants.set_caller(st.auth.caller(header))
        try:
            await self._serve(st, header, scope, receive, send_named)
        finally:
            tenants.reset_caller(token)

    async def _serve(self, st: ServerState, header, scope, receive, send) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        dev_rpc = path == DEV_RPC_PATH
        if scope.get("method") != "POST" or (
            not dev_rpc and (not st.keyed or path.startswith(self.guarded) or st.authorized(header))
        ):
            return await self.app(scope, receive, send)
        limit = MAX_RPC_BODY if dev_rpc else max_open_body_bytes()
        parts, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            parts.append(msg.get("body", b""))
            size += len(parts[-1])
            more = msg.get("more_body", False)
            if size > limit:
                resp = JSONResponse(error_body(413, "request body too large"), status_code=413)
                return await resp(scope, receive, send)
        body = b"".join(parts)
        if dev_rpc:
            method = _rpc_method(body)
            if method is not None and method.startswith("xmix"):
                caller = tenants.current()
                st.audit.record(
                    caller.key if caller else "none",
                    "collective_rpc",
                    None,
                    403,
                    "refused",
                    method=shown(method),
                )
                resp = JSONResponse(
                    error_body(
                        403,
                        f"forbidden: {shown(method)} changes xmix's apps "
                        "behind the control plane; use /xmix/v1/apps",
                    ),
                    status_code=403,
                )
                return await resp(scope, receive, send)
        elif _carries_xmix(body):
            logger.info(
                "xmix: refused an unauthenticated request with an xmix control on %s", scope["path"]
            )
            resp = JSONResponse(
                error_body(
                    401,
                    "unauthorized: requests that use xmix apps need "
                    "the server's API key as a Bearer token",
                ),
                status_code=401,
            )
            return await resp(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
