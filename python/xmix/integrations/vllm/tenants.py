"""Who may do what on an ``xmix serve`` server.

- The control plane has its own credential, the admin key (``--xmix-admin-key`` or
  ``XMIX_ADMIN_KEY``), distinct from vLLM's inference keys (``--api-key``): a client that may
  generate may not deploy, switch or re-parameterise apps. With no admin key the control plane
  is off unless ``XMIX_ALLOW_OPEN_CONTROL_PLANE=1`` opens it to whoever may generate (vLLM
  gates runtime LoRA loading behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` the same way).
- A policy file (``--xmix-policy`` or ``XMIX_POLICY``) says, per inference key, which apps its
  requests may name and which apps deployed in mode ``all`` apply to them.
- Every control-plane change is one audit line (logger ``vllm.xmix.audit``, and
  ``XMIX_AUDIT_LOG`` as JSON lines, the file created 0600): which key (a fingerprint keyed
  with the deployment's secret, keyed.py; never the key), what, when, the result.
- Limits per request and per server, from the environment (``xmix serve`` flags set it;
  xmix.settings types and checks them).

The caller of the HTTP request being served is kept in a context variable set by the
server's middleware; admission in the frontend reads it. Offline engines have no caller and
no policy.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from xmix import settings
from xmix.integrations.vllm import keyed

logger = logging.getLogger("vllm.xmix")
audit_logger = logging.getLogger("vllm.xmix.audit")

# ``xmix serve`` flags that set an environment variable of this process (the API server
# runs in it), from the settings table. Repeated --xmix-admin-key flags give several admin keys.
SERVE_FLAGS = settings.SERVE_FLAGS


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def bearer(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def _matches(token: str | None, digests: list[bytes]) -> bool:
    if token is None:
        return False
    d = digest(token)
    ok = False
    for t in digests:  # every one compared: the time taken does not say which matched
        ok |= secrets.compare_digest(d, t)
    return ok


# ---------------------------------------------------------------------- errors
_FORBIDDEN = None


def forbidden(msg: str) -> Exception:
    """A request the policy refuses: HTTP 403 on the server (vLLM's GracefulHTTPError),
    a ValueError offline."""
    global _FORBIDDEN
    if _FORBIDDEN is None:
        from http import HTTPStatus

        try:
            from vllm.exceptions import GracefulHTTPError

            class XmixForbidden(GracefulHTTPError, ValueError):
                status = 403

                def __init__(self, message: str):
                    super().__init__(message, HTTPStatus.FORBIDDEN)
        except ImportError:  # pragma: no cover - older vLLM

            class XmixForbidden(ValueError):  # type: ignore[no-redef]
                status = 403

        _FORBIDDEN = XmixForbidden
    return _FORBIDDEN(f"xmix: {msg}")


def is_forbidden(e: BaseException) -> bool:
    return _FORBIDDEN is not None and isinstance(e, _FORBIDDEN)


# ---------------------------------------------------------------------- policy
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TENANT_KEYS = {"keys_sha256", "apps", "forced", "max_response_bytes"}
_DEFAULT_KEYS = {"apps", "forced", "max_response_bytes"}


@dataclass(frozen=True)
class Tenant:
    """What one inference key's requests may use. ``apps``: the apps they may name (and set
    parameters of); ``forced``: the apps deployed in mode ``all`` that apply to them. None
    means any."""

    name: str
    apps: frozenset[str] | None = None
    forced: frozenset[str] | None = None
    # the cap on the read results of one response (None: the server's XMIX_MAX_RESPONSE_BYTES)
    max_response_bytes: int | None = None

    def may_name(self, app: str) -> bool:
        return self.apps is None or app in self.apps

    def may_force(self, app: str) -> bool:
        return self.forced is None or app in self.forced

    def describe(self) -> dict:
        def names(s):
            return "*" if s is None else sorted(s)

        out = {"tenant": self.name, "apps": names(self.apps), "forced": names(self.forced)}
        if self.max_response_bytes is not None:
            out["max_response_bytes"] = self.max_response_bytes
        return out


class PolicyError(ValueError):
    pass


def _cap(v: Any, where: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise PolicyError(f"{where} must be a positive integer (bytes), got {v!r}"[:200])
    return v


def _names(v: Any, where: str) -> frozenset[str] | None:
    if v == "*":
        return None
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise PolicyError(f'{where} must be "*" or a list of app names')
    return frozenset(v)


class Policy:
    """The per-key policy file (JSON):

        {"tenants": {"research": {"keys_sha256": ["<sha256 hex of the key>"],
                                  "apps": "*", "forced": [],
                                  "max_response_bytes": 268435456},
                     "product":  {"keys_sha256": ["..."], "apps": ["steer"], "forced": "*"}},
         "default": {"apps": [], "forced": "*"}}

    ``max_response_bytes`` (optional): the cap on the read results of one response for the
    tenant's keys, in place of the server's ``XMIX_MAX_RESPONSE_BYTES``.

    ``default`` covers requests whose key is in no tenant (and requests without a key on a
    server without ``--api-key``); without it such requests may name no app and get every
    app in mode ``all``. Keys are given as SHA-256 digests, so the file holds no secret."""

    def __init__(self, tenants: dict[bytes, Tenant], default: Tenant, source: str = "<policy>"):
        self.by_digest = tenants
        self.default = default
        self.source = source

    @staticmethod
    def parse(doc: Any, source: str = "<policy>") -> Policy:
        if not isinstance(doc, dict) or set(doc) - {"tenants", "default"}:
            raise PolicyError(
                f'{source}: must be an object with "tenants" and optionally "default"'
            )
        tenants = doc.get("tenants") or {}
        if not isinstance(tenants, dict):
            raise PolicyError(f'{source}: "tenants" must be an object of name: rules')
        by_digest: dict[bytes, Tenant] = {}
        for name, rules in tenants.items():
            where = f"{source}: tenant {name!r}"
            if not isinstance(rules, dict) or set(rules) - _TENANT_KEYS:
                raise PolicyError(f"{where}: rules are an object with keys {sorted(_TENANT_KEYS)}")
            keys = rules.get("keys_sha256")
            if (
                not isinstance(keys, list)
                or not keys
                or not all(isinstance(k, str) and _HEX64.match(k.lower()) for k in keys)
            ):
                raise PolicyError(
                    f'{where}: "keys_sha256" must list the SHA-256 digests (64 hex '
                    f'digits) of its keys, e.g. printf %s "$KEY" | sha256sum'
                )
            t = Tenant(
                name,
                _names(rules.get("apps", []), f'{where}: "apps"'),
                _names(rules.get("forced", "*"), f'{where}: "forced"'),
                _cap(rules.get("max_response_bytes"), f'{where}: "max_response_bytes"'),
            )
            for k in keys:
                d = bytes.fromhex(k.lower())
                if d in by_digest:
                    raise PolicyError(
                        f"{where}: a key is listed for tenant {by_digest[d].name!r} too"
                    )
                by_digest[d] = t
        dflt = doc.get("default", {})
        if not isinstance(dflt, dict) or set(dflt) - _DEFAULT_KEYS:
            raise PolicyError(
                f'{source}: "default" is an object with "apps", "forced" and "max_response_bytes"'
            )
        default = Tenant(
            "default",
            _names(dflt.get("apps", []), f'{source}: default "apps"'),
            _names(dflt.get("forced", "*"), f'{source}: default "forced"'),
            _cap(dflt.get("max_response_bytes"), f'{source}: default "max_response_bytes"'),
        )
        return Policy(by_digest, default, source)

    @staticmethod
    def load(path: str) -> Policy:
        try:
            with open(path, "rb") as f:
                data = f.read((1 << 20) + 1)
        except OSError as e:
            raise PolicyError(f"cannot read the policy file {path!r}: {e.strerror}") from None
        if len(data) > 1 << 20:
            raise PolicyError(f"policy file {path!r} is larger than 1 MiB")
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise PolicyError(f"policy file {path!r} is not valid JSON: {e}") from None
        return Policy.parse(doc, path)

    def tenant(self, token: str | None) -> Tenant:
        if token is not None:
            t = self.by_digest.get(digest(token))
            if t is not None:
                return t
        return self.default


@dataclass(frozen=True)
class Caller:
    """The client of the HTTP request being served."""

    key: str  # fingerprint of its key ("none" without one)
    tenant: Tenant | None  # None: no policy on this server
    admin: bool = False


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("xmix_caller", default=None)


def current() -> Caller | None:
    return _CALLER.get()


def set_caller(c: Caller | None) -> contextvars.Token:
    return _CALLER.set(c)


def reset_caller(tok: contextvars.Token) -> None:
    _CALLER.reset(tok)


def may_see(app: str, mode: str, policy: Policy | None = None) -> bool:
    """Whether the caller of the request being served may know of an app: one its policy
    lets it name, or one in mode "all" that applies to its requests. Admin keys, and servers
    without a policy, see every app; a request whose caller is unknown gets the policy's
    default (fails closed)."""
    caller = current()
    if caller is not None:
        t = None if caller.admin else caller.tenant
    else:
        t = policy.default if policy is not None else None
    return t is None or t.may_name(app) or (mode == "all" and t.may_force(app))


# ---------------------------------------------------------------------- server credentials
class Auth:
    """The server's credentials: inference keys (vLLM's ``--api-key``), admin keys, whether an
    open control plane was asked for, and the policy."""

    def __init__(
        self,
        api_keys: list[str],
        admin_keys: list[str],
        open_control: bool = False,
        policy: Policy | None = None,
    ):
        self._api = [digest(k) for k in api_keys if k]
        self._admin = [digest(k) for k in admin_keys if k]
        self.open_control = open_control
        self.policy = policy
        # Audit fingerprints are keyed with the deployment's secret (keyed.py); the server
        # puts the deployment's keys here once it fetched them, before it serves.
        self.keys = keyed.Keys.random()
        if set(self._api) & set(self._admin):
            logger.warning(
                "xmix: an admin key is also an inference key (--api-key): clients "
                "holding it may both generate and change apps"
            )

    @staticmethod
    def from_env(api_keys: list[str]) -> Auth:
        policy_path = settings.get("XMIX_POLICY")
        policy = Policy.load(policy_path) if policy_path else None
        return Auth(
            api_keys,
            list(settings.get("XMIX_ADMIN_KEY")),
            settings.get("XMIX_ALLOW_OPEN_CONTROL_PLANE"),
            policy,
        )

    @property
    def keyed(self) -> bool:
        """Whether inference needs a key."""
        return bool(self._api)

    @property
    def has_admin(self) -> bool:
        return bool(self._admin)

    def is_admin(self, token: str | None) -> bool:
        return _matches(token, self._admin)

    def may_generate(self, token: str | None) -> bool:
        return not self._api or _matches(token, self._api)

    def fingerprint(self, header: str | None) -> str:
        """What the audit log shows of the caller's key (keyed.Keys.fingerprint)."""
        return self.keys.fingerprint(bearer(header))

    def caller(self, header: str | None) -> Caller:
        token = bearer(header)
        tenant = self.policy.tenant(token) if self.policy is not None else None
        return Caller(self.keys.fingerprint(token), tenant, self.is_admin(token))

    def check_change(self, header: str | None) -> tuple[int, str] | None:
        """None when this caller may change apps; else (status, message)."""
        token = bearer(header)
        if self._admin:
            if self.is_admin(token):
                return None
            if token is not None and self.may_generate(token) and self._api:
                return 403, (
                    "forbidden: this key may generate but not change apps; the control "
                    "plane takes the admin key (--xmix-admin-key)"
                )
            return 401, "unauthorized: send the admin key (--xmix-admin-key) as a Bearer token"
        if not self.open_control:
            return 403, (
                "the control plane is off: start xmix serve with --xmix-admin-key (or "
                "XMIX_ADMIN_KEY), or set XMIX_ALLOW_OPEN_CONTROL_PLANE=1 to let whoever may "
                "generate change apps"
            )
        if self.may_generate(token):
            return None
        return 401, "unauthorized: send the server's API key as a Bearer token"

    def check_read(self, header: str | None) -> tuple[int, str] | None:
        """Listing apps: the admin key, or any key that may generate (filtered by policy)."""
        token = bearer(header)
        if self.is_admin(token) or self.may_generate(token):
            return None
        return 401, "unauthorized: send an API key or the admin key as a Bearer token"

    def start_lines(self) -> list[str]:
        """What the server says about its control plane when it starts."""
        if self._admin:
            lines = [
                f"xmix: control plane on, authenticated by {len(self._admin)} admin key(s) "
                f"(inference keys may not change apps)"
            ]
        elif self.open_control:
            who = (
                "the server's API key"
                if self._api
                else "ANYONE who can reach the server (no --api-key)"
            )
            lines = [
                f"xmix: control plane OPEN (XMIX_ALLOW_OPEN_CONTROL_PLANE=1): {who} may deploy, "
                "switch and re-parameterise apps"
            ]
        else:
            lines = [
                "xmix: control plane off (no --xmix-admin-key / XMIX_ADMIN_KEY); apps given "
                "with --app are served, changes are refused (set XMIX_ALLOW_OPEN_CONTROL_PLANE=1 "
                "to open it)"
            ]
        if self.policy is not None:
            lines.append(
                f"xmix: per-key policy from {self.policy.source}: "
                f"{len(set(self.policy.by_digest.values()))} tenant(s), default "
                f"{self.policy.default.describe()}"
            )
        return lines


# ---------------------------------------------------------------------- audit
class Audit:
    """One line per control-plane change, to ``vllm.xmix.audit`` and, when set, appended to
    ``XMIX_AUDIT_LOG`` as JSON lines."""

    def __init__(self, path: str | None = None):
        self.path = path if path is not None else settings.get("XMIX_AUDIT_LOG")
        self._lock = threading.Lock()
        if self.path:
            try:
                mode = os.stat(self.path).st_mode & 0o777
            except OSError:
                mode = 0
            if mode & 0o077:
                # an existing file keeps the mode its owner gave it; say that others can read it
                logger.warning(
                    "xmix: the audit log %s can be read by other users (mode %o); xmix "
                    "creates it 0600",
                    self.path,
                    mode,
                )

    def record(
        self, key: str, action: str, app: str | None, status: int, result: str, **details: Any
    ) -> dict:
        now = time.time()
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
            + f".{int(now * 1000) % 1000:03d}Z",
            "key": key,
            "action": action,
            "app": app,
            "status": status,
            "result": result,
        }
        entry.update({k: v for k, v in details.items() if v is not None})
        line = json.dumps(entry, sort_keys=False, default=str)
        audit_logger.info("xmix audit %s", line)
        if self.path:
            with self._lock:
                try:
                    # created owner-only: the log names apps, keys' fingerprints and refusals
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                    with os.fdopen(fd, "a", encoding="utf-8") as f:
                        f.write(line + "\n")
                except OSError as e:
                    logger.error("xmix: cannot write the audit log %s: %s", self.path, e.strerror)
        return entry
