"""Every ``XMIX_*`` environment variable xmix reads, in one table: its type, its default, one
line of doc. Code reads a setting with ``settings.get("XMIX_SYNC_S")``: the environment is
read at each call (``xmix capture``, ``xmix.LLM(xmix_state_dir=...)`` and the tests change it
while a process runs), parsed, and refused with an error naming the variable and the value.

``check_environment()`` runs where xmix starts (``xmix serve`` before any engine; the vLLM
plugin's ``register()`` in every engine process, offline ``LLM`` included): every ``XMIX_*``
variable set must be one this table knows (a typo is refused with the closest name) and
parse, so a bad value stops the start, named, instead of failing a request later.

``xmix settings --markdown`` prints the table of docs/settings.md (a unit test keeps
the two equal). Imported by the vLLM side: it imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

PREFIX = "XMIX_"
MiB = 1 << 20
GiB = 1 << 30


class SettingError(ValueError):
    """An ``XMIX_*`` variable with a value that does not parse, or one xmix does not know."""


# ---------------------------------------------------------------------- types
# Each type parses the raw string (never empty: an empty variable counts as unset) or raises
# ValueError with the reason, phrased to follow "NAME='value' ".
class Int:
    label = "integer >= 0"

    def parse(self, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            raise ValueError("is not an integer") from None
        if v < 0:
            raise ValueError("is negative")
        return v


class Float:
    label = "number >= 0"

    def parse(self, raw: str) -> float:
        try:
            v = float(raw.strip())
        except ValueError:
            raise ValueError("is not a number") from None
        if not math.isfinite(v):
            raise ValueError("is not a finite number")
        if v < 0:
            raise ValueError("is negative")
        return v


class Bool:
    label = "1/0 (true/false, yes/no, on/off)"
    TRUE = ("1", "true", "yes", "on")
    FALSE = ("0", "false", "no", "off")

    def parse(self, raw: str) -> bool:
        v = raw.strip().lower()
        if v in self.TRUE:
            return True
        if v in self.FALSE:
            return False
        raise ValueError(f"is not a yes/no value (one of {', '.join(self.TRUE + self.FALSE)})")


class Choice:
    def __init__(self, *choices: str):
        self.choices = choices
        self.label = " / ".join(choices)

    def parse(self, raw: str) -> str:
        if raw not in self.choices:
            raise ValueError(f"must be one of {list(self.choices)}")
        return raw


class Path:
    label = "path"

    def parse(self, raw: str) -> str:
        return raw


class Json:
    label = "JSON"

    def parse(self, raw: str) -> Any:
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ValueError(f"is not JSON ({e})") from None


class Secret:
    """A secret of at least ``min_bytes`` UTF-8 bytes; its value is never shown."""

    secret = True

    def __init__(self, min_bytes: int):
        self.min_bytes = min_bytes
        self.label = f"secret, >= {min_bytes} bytes"

    def parse(self, raw: str) -> bytes:
        data = raw.encode("utf-8")
        if len(data) < self.min_bytes:
            raise ValueError(
                f"has {len(data)} bytes; a deployment secret needs at least {self.min_bytes} "
                "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
            )
        return data


class Keys:
    """Comma-separated keys; their values are never shown."""

    secret = True
    label = "keys, comma-separated"

    def parse(self, raw: str) -> list[str]:
        return [k.strip() for k in raw.split(",") if k.strip()]


@dataclass(frozen=True)
class Setting:
    name: str
    type: Any  # one of the types above
    default: Any  # the value when unset or empty
    doc: str
    internal: bool = False  # set by xmix for its own processes, or test-only
    flag: str | None = None  # the ``xmix serve`` flag that sets it

    def parse(self, raw: str | None) -> Any:
        if raw is None or raw == "":
            return self.default
        try:
            return self.type.parse(raw)
        except ValueError as e:
            shown = self.name if getattr(self.type, "secret", False) else f"{self.name}={raw!r}"
            raise SettingError(f"{shown} {e} ({self.doc})") from None


# ---------------------------------------------------------------------- the table
SETTINGS: tuple[Setting, ...] = (
    # which engines run xmix
    Setting(
        "XMIX_ENABLE",
        Bool(),
        False,
        "turn xmix on for plain `vllm serve` / `vllm.LLM` engines that inherit the environment "
        "(`additional_config={'xmix': true}` reaches every node)",
    ),
    Setting(
        "XMIX_DISABLE",
        Bool(),
        False,
        "turn xmix off in this process whatever asks for it: the plugin patches nothing (and "
        "checks no other XMIX_ variable)",
    ),
    Setting(
        "XMIX_CACHE",
        Path(),
        None,
        "where `xmix models` keeps tiny models: $XMIX_CACHE/models (unset: ~/.cache/xmix/models)",
    ),
    # the control plane (docs/security.md)
    Setting(
        "XMIX_ADMIN_KEY",
        Keys(),
        (),
        "admin keys of the control plane (deploy, switch, parameters); none: the control plane "
        "is off unless XMIX_ALLOW_OPEN_CONTROL_PLANE",
        flag="--xmix-admin-key",
    ),
    Setting(
        "XMIX_ALLOW_OPEN_CONTROL_PLANE",
        Bool(),
        False,
        "with no admin key, let whoever may generate deploy and change apps",
    ),
    Setting(
        "XMIX_POLICY",
        Path(),
        None,
        "per-key policy file (JSON): which apps each inference key may name",
        flag="--xmix-policy",
    ),
    Setting(
        "XMIX_AUDIT_LOG",
        Path(),
        None,
        "file the control plane's audit lines are appended to, as JSON lines (created 0600)",
        flag="--xmix-audit-log",
    ),
    Setting(
        "XMIX_DEPLOYMENT_SECRET",
        Secret(16),
        None,
        "the deployment's secret (keyed hashes, cache salts, audit fingerprints); unset: the "
        "state directory's, else random per start",
    ),
    Setting(
        "XMIX_METRICS_APP_LABELS",
        Choice("names", "hashed"),
        "names",
        "app and gate names in /metrics labels, or keyed hashes of them",
        flag="--xmix-metrics-app-labels",
    ),
    Setting(
        "XMIX_STATE_DIR",
        Path(),
        None,
        "state directory: the deployed apps and their changes, restored at start "
        "(`xmix serve --xmix-state-dir`, `xmix.LLM(xmix_state_dir=...)` set it)",
    ),
    # limits (docs/serving.md, Size limits; docs/security.md, Limits)
    Setting(
        "XMIX_MAX_REQUEST_APPS",
        Int(),
        16,
        "apps one request may name (400)",
        flag="--xmix-max-request-apps",
    ),
    Setting(
        "XMIX_MAX_REQUEST_PARAMS",
        Int(),
        256,
        "parameter values one request may set, all apps together (400)",
        flag="--xmix-max-request-params",
    ),
    Setting(
        "XMIX_MAX_APPS",
        Int(),
        64,
        "apps deployed at once on the server, at most the engine's 64 (507)",
        flag="--xmix-max-apps",
    ),
    Setting(
        "XMIX_MAX_OPS",
        Int(),
        None,
        "ops placed on layers by all deployed apps; unset: the engine's room (507)",
        flag="--xmix-max-ops",
    ),
    Setting(
        "XMIX_MAX_RESULT_BYTES",
        Int(),
        16 * MiB,
        "read results of one request (400 over the prompt, a truncation marker over tokens)",
        flag="--xmix-max-result-bytes",
    ),
    Setting(
        "XMIX_MAX_RESPONSE_BYTES",
        Int(),
        64 * MiB,
        "read results of one HTTP response, all its prompts and choices; a key's policy may "
        "set its own",
        flag="--xmix-max-response-bytes",
    ),
    Setting("XMIX_MAX_CONTROL_BYTES", Int(), 64 * 1024, "one request's xmix control string (400)"),
    Setting("XMIX_MAX_APP_BYTES", Int(), GiB, "one app file POSTed to the server (413)"),
    Setting(
        "XMIX_MAX_APP_HEADER_BYTES",
        Int(),
        16 * MiB,
        "an app file's safetensors header, the JSON with the spec (413)",
    ),
    Setting("XMIX_MAX_APP_OPS", Int(), 4096, "ops one app may declare (413)"),
    Setting(
        "XMIX_MAX_ARTIFACT_BYTES",
        Int(),
        GiB,
        "one app's distinct artifacts as fp32 (413)",
    ),
    Setting(
        "XMIX_MAX_OPEN_BODY_BYTES",
        Int(),
        64 * MiB,
        "body read to look for an xmix control in an unauthenticated request to a route vLLM "
        "does not guard (413)",
    ),
    Setting(
        "XMIX_CAPTURE_MB",
        Float(),
        16.0,
        "the engine's capture buffer per step, in MiB (`xmix capture` sizes it when unset)",
    ),
    # timing of the control plane across API servers and engines
    Setting(
        "XMIX_SYNC_S",
        Float(),
        0.25,
        "seconds between an API server's reads of the engines' ledger of app changes",
    ),
    Setting(
        "XMIX_RPC_TIMEOUT_S",
        Float(),
        30.0,
        "seconds a control RPC waits for each engine before naming the one that did not answer",
    ),
    Setting(
        "XMIX_LEASE_WAIT_S",
        Float(),
        30.0,
        "seconds a control change waits for another API server's change to finish",
    ),
    # CUDA graphs (docs/cuda_graphs.md)
    Setting(
        "XMIX_GRAPH_PATCH",
        Bool(),
        True,
        "patch captured CUDA graphs to run the deployed apps' kernels; off: graphs keep anchors",
    ),
    Setting(
        "XMIX_GRAPH_VERIFY",
        Bool(),
        False,
        "read every patched graph back and put it back as captured when it differs",
    ),
    Setting(
        "XMIX_GRAPH_CHECK",
        Bool(),
        True,
        "check a patched graph's first replay against its anchors' result",
    ),
    Setting(
        "XMIX_GRAPH_CHECK_MAX_MB",
        Float(),
        1024.0,
        "MiB of device memory the first-replay check may use for its copies",
    ),
    Setting(
        "XMIX_GRAPH_CHECK_GRAPHS",
        Int(),
        8,
        "graphs checked per control block and deploy (a failure checks them all)",
    ),
    # internal
    Setting(
        "XMIX_SERVE_APPS",
        Json(),
        (),
        "the `--app` files of `xmix serve` for its API server: [[path, mode, locked], ...]",
        internal=True,
    ),
    Setting(
        "XMIX_TEST_STATE_CRASH",
        Path(),
        None,
        "test-only: a file naming a state-directory crash point; the writer SIGKILLs its "
        "process group there",
        internal=True,
    ),
)

# Read by the repository's scripts, tests and benchmarks, not by the package: known here so
# that check_environment() does not take them for typos.
TOOL_VARIABLES: dict[str, str] = {
    "XMIX_PYTHON": "scripts/setup.sh: the Python that creates .venv",
    "XMIX_NO_APT": "scripts/setup.sh: 1 never calls apt-get and names what is missing",
    "XMIX_LINT_BIN": "scripts/lint.sh: where ruff and mypy are (default .venv/bin)",
    "XMIX_TEST_WORKERS": "scripts/test.sh: pytest workers (default 2)",
    "XMIX_FUZZ_EXAMPLES": "tests/server/test_fuzz_http.py: examples per route (default 60)",
    "XMIX_ARCH": "bench/gpu_check.sh, bench/build_device_module.sh: CUDA arch (default 90)",
    "XMIX_PREBUILT": "bench/gpu_check.sh: a prebuilt device module (default build/device)",
    "XMIX_DEVICE_OUT": "bench/build_device_module.sh: where the module goes (default build/device)",
}

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
SERVE_FLAGS: dict[str, str] = {s.flag: s.name for s in SETTINGS if s.flag}


# ---------------------------------------------------------------------- reading
def get(name: str) -> Any:
    """The value of setting ``name`` now: parsed from the environment, or its default when
    unset or empty. SettingError (a ValueError) names the variable and the bad value."""
    return BY_NAME[name].parse(os.environ.get(name))


def is_set(name: str) -> bool:
    """Whether the environment gives ``name`` a value (not empty)."""
    BY_NAME[name]  # noqa: B018  (a name not in the table is a KeyError here too)
    return bool(os.environ.get(name))


def set_env(name: str, value: str) -> None:
    """Hand ``name`` to this process's later reads and its child processes, checked first."""
    BY_NAME[name].parse(value)
    os.environ[name] = value


@contextlib.contextmanager
def overridden(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` inside the block, the process's own value (or none) after."""
    old = os.environ.get(name)
    set_env(name, value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def check_environment(environ: dict[str, str] | None = None) -> None:
    """Every ``XMIX_*`` variable set is known and parses; SettingError lists every one that
    is not (one line each). A name xmix does not know is refused with the closest known
    name; its value is never shown (it may be a misspelt secret)."""
    env = os.environ if environ is None else environ
    known = [*BY_NAME, *TOOL_VARIABLES]
    errors = []
    for name in sorted(n for n in env if n.startswith(PREFIX)):
        s = BY_NAME.get(name)
        if s is not None:
            try:
                s.parse(env[name])
            except SettingError as e:
                errors.append(str(e))
        elif name not in TOOL_VARIABLES:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}?" if close else ""
            errors.append(
                f"{name} is not an xmix setting{hint} (docs/settings.md lists them; xmix settings)"
            )
    if errors:
        raise SettingError("\n".join(errors))


# ---------------------------------------------------------------------- docs
def _shown_default(s: Setting) -> str:
    d = s.default
    if d is None or d == ():
        return "unset"
    if isinstance(d, bool):
        return "1" if d else "0"
    if isinstance(d, int) and s.name.endswith("_BYTES") and d >= 1024:
        for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
            if d % size == 0:
                return f"{d // size} {unit} ({d})"
    if isinstance(d, float):
        return f"{d:g}"
    return str(d)


def markdown() -> str:
    """The tables of docs/settings.md."""
    lines = [
        "| variable | type | default | `xmix serve` flag | what |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        if not s.internal:
            flag = f"`{s.flag}`" if s.flag else ""
            lines.append(
                f"| `{s.name}` | {s.type.label} | {_shown_default(s)} | {flag} | {s.doc} |"
            )
    lines += ["", "Internal (set by xmix for its own processes, or test-only):", ""]
    lines += ["| variable | type | default | what |", "|---|---|---|---|"]
    for s in SETTINGS:
        if s.internal:
            lines.append(f"| `{s.name}` | {s.type.label} | {_shown_default(s)} | {s.doc} |")
    lines += [
        "",
        "Read by the repository's scripts, tests and benchmarks, not by the package:",
        "",
        "| variable | where: what |",
        "|---|---|",
    ]
    lines += [f"| `{n}` | {doc} |" for n, doc in TOOL_VARIABLES.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="xmix settings", description="the XMIX_* environment variables xmix reads"
    )
    p.add_argument("--markdown", action="store_true", help="the table of docs/settings.md")
    p.add_argument("--check", action="store_true", help="check this environment's XMIX_*")
    a = p.parse_args(argv)
    if a.check:
        try:
            check_environment()
        except SettingError as e:
            print(e, file=sys.stderr)
            return 2
        print("ok")
        return 0
    if a.markdown:
        sys.stdout.write(markdown())
        return 0
    for s in SETTINGS:
        print(f"{s.name}={_shown_default(s)}  # {s.doc}")
    return 0
