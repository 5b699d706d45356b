"""``xmix serve``: vLLM's OpenAI-compatible server with xmix loaded. This module is the
endpoint plugin (``vllm.endpoint_plugins``): it mounts the control plane and, at start, builds
its state, restores a state directory and deploys the ``--app`` files. The rest of the HTTP
side lives beside it, one job per module:

- ``serve_cli.py``: the ``xmix serve`` command (xmix's flags checked, then vLLM's ``serve``)
- ``http_routes.py``: the control plane's routes, their OpenAPI schemas, the statuses xmix
  adds to vLLM's routes
- ``http_auth.py``: the middleware (who is calling; the doors vLLM leaves open), body reads
- ``engine_rpc.py``: control RPCs to every engine, with a deadline per engine
- ``openai_precheck.py``: admission on vLLM's OpenAI routes before a stream starts
- ``openai_results.py``: read results and provenance in vLLM's OpenAI responses
- ``server_state.py``: what the plugin keeps on ``app.state.xmix``

What a server started this way does:

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
import logging
import os

from xmix import settings
from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.errors import EngineGone, EngineUnreachable
from xmix.integrations.vllm.frontend import metrics, restore, usage
from xmix.integrations.vllm.frontend.controller import Controller, _load_app
from xmix.integrations.vllm.frontend.engine_rpc import blocking_rpc, blocking_status, engine_gone
from xmix.integrations.vllm.http.auth import RequestAppsAuth
from xmix.integrations.vllm.http.console import console_url
from xmix.integrations.vllm.http.routes import build_router, document_statuses
from xmix.integrations.vllm.http.server_state import ServerState
from xmix.lang.lowering import DeployError

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


# ---------------------------------------------------------------------- endpoint plugin
class XmixEndpointPlugin:
    """``vllm.endpoint_plugins`` entry: the control-plane routes and their state."""

    name = "xmix"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(build_router())
        app.add_middleware(RequestAppsAuth, server=app)
        document_statuses(app)

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

        gone = engine_gone(engine_client, loop)
        rpc = blocking_rpc(engine_client, loop, gone)
        status = blocking_status(engine_client, loop, gone)

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
