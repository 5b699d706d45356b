"""A restarted server brought back to what its state directory holds (state_dir.py), before
it takes a request: ``xmix serve`` (server.py, the endpoint plugin's ``init_state``) and the
offline control plane (offline.py) call ``restore`` once their Controller exists.

The directory is read by its one writer, the worker that holds the ledger (ledger.py); an API
server receives its apps as bytes from there (``xmix_ledger("state")``) and deploys each
again through the ordinary transaction, with its mode, locks, deployment version and changed
parameters, in the order they were first deployed (ops of two apps at one site run in that
order). The writer finds each of those changes already written and writes nothing. The
directory keeps each app as it was given, not its lowered program: the restoring server parses
and lowers each app once, as for any deploy, and the engines and the other API servers decode
the program it sends (docs/architecture.md, "Deploy path").

Several API servers: the restore holds the ledger's lease from its first change to its last
and starts with a ``restore`` ledger entry; a server that gets the lease after it finds that
entry and leaves the apps to it. Every server's registry applies the entry (the epoch and
version floors), so their cache salts agree.
"""

from __future__ import annotations

import logging

from xmix import settings
from xmix.integrations.vllm.frontend.controller import Controller
from xmix.integrations.vllm.state_dir import StateError
from xmix.lang.program_codec import app_digest

logger = logging.getLogger("vllm.xmix")

RESTORE_WAIT_S = 600.0  # another server restoring holds the lease for its whole restore


def restore(ctl: Controller) -> dict | None:
    """Deploy what the state directory holds; None without a state directory. Returns
    ``{"dir", "apps": [names], "by_other": bool}``. Raises StateError (naming the app file)
    when an app it holds cannot be deployed on this server: the start stops there."""
    plans = [p for p in ctl._rpc("xmix_ledger", ("state", "")) if p is not None]
    if not plans:
        path = settings.get("XMIX_STATE_DIR")
        if path:
            raise StateError(
                f"XMIX_STATE_DIR={path} is set here but no worker opened "
                "it (the engines were started without it)"
            )
        return None
    plan = plans[0]
    names = [a["name"] for a in plan["apps"]]
    with ctl._change(RESTORE_WAIT_S):
        if ctl.restored:
            return {"dir": plan["dir"], "apps": names, "by_other": True}
        ctl._record(
            {"kind": "restore", "name": None, "epoch": plan["epoch"], "version": plan["version"]}
        )
        for a in plan["apps"]:
            try:
                ctl.deploy(
                    a["data"],
                    a["mode"],
                    allow_custom=True,  # it came from this operator's own earlier deploys
                    locked=a["locked"],
                    version=a["version"],
                )
                if a["params"]:
                    ctl.patch(a["name"], params=a["params"])
            except Exception as e:
                raise StateError(
                    f"the state directory {plan['dir']} holds app {a['name']!r} ({a['path']}) "
                    f"that this server cannot deploy: {e}. Start with the model and limits it "
                    "was deployed on, or start clean (docs/serving.md, State directory)"
                ) from None
    logger.info(
        "xmix: restored from the state directory %s: %s",
        plan["dir"],
        ", ".join(f"{a['name']} (v{a['version']}, {a['mode']})" for a in plan["apps"]) or "no apps",
    )
    return {"dir": plan["dir"], "apps": names, "by_other": False}


def log_app_kept(ctl: Controller, app, path: str, state_dir: str) -> None:
    """An app given at start (``--app``, ``xmix.LLM(apps=...)``) whose name the state directory
    holds: the state's copy is kept, with the changes made to it since. Said at start, louder
    when the file given differs from that copy."""
    d = ctl.registry.apps[app.name]
    if same_app(app, d.lowered):
        logger.info(
            "xmix: app %s restored from the state directory %s (v%d, mode %s, its changes "
            "kept); %s not deployed again",
            app.name,
            state_dir,
            d.version,
            d.mode,
            path,
        )
    else:
        logger.warning(
            "xmix: app %s: %s differs from the copy in the state directory %s, which is "
            "served (v%d, mode %s). To serve the file: undeploy %s and deploy the file, or "
            "start clean (docs/serving.md, State directory)",
            app.name,
            path,
            state_dir,
            d.version,
            d.mode,
            app.name,
        )


def same_app(app, lowered) -> bool:
    """Whether an app file is the app a deployed program was lowered from, apart from how
    token sets are written (the program carries the app's content digest; the server that
    deployed it may be another one, which sent only the program)."""
    return bool(lowered.digest) and app_digest(app) == lowered.digest
