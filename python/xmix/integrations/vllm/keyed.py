"""The per-deployment secret, and what xmix keys with it: prefix-cache salts, audit-log
fingerprints of keys, and app names hidden on /metrics.

Why keyed: each of these was a plain hash of public facts. A cache salt computed from an
app's name, version and parameters could be computed by any client, which then set it as its
own ``cache_salt`` and read (or poisoned) another tenant's steered KV; an unsalted hash of an
API key in the audit log lets anyone holding the log test guesses of weak keys offline.

One secret per deployment: every API server of a deployment (``--api-server-count N``) must
derive the same salt for the same app configuration, or prefix caching across them breaks,
and the same fingerprint for the same key. The engines are the state every API server
reaches, so the first worker of the first engine holds the secret (``XMIX_DEPLOYMENT_SECRET``
when the operator sets one, else the one kept in the state directory, ``--xmix-state-dir``,
drawn there once and read at every start, else 32 random bytes drawn when it is first asked
for) and each API server fetches it once through xmix's worker RPC before it serves
(controller.Controller). It is never logged, never written anywhere but the state directory's
0600 file, and never sent to a client; vLLM's dev-mode ``/collective_rpc`` refuses xmix's
worker methods (http_auth.RequestAppsAuth).

Each use gets its own key, derived from the secret with HMAC-SHA256 and a label, so a value of
one kind (a fingerprint, a metric label) says nothing about another (a cache salt).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

from xmix import settings

SALT_PREFIX = "xmix:"


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"xmix/" + label, hashlib.sha256).digest()


def _mac(key: bytes, msg: bytes) -> str:
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def secret_from_env() -> bytes | None:
    """The operator's ``XMIX_DEPLOYMENT_SECRET`` (UTF-8), or None; ValueError (never showing
    the value) when it is too short to be a secret."""
    secret: bytes | None = settings.get("XMIX_DEPLOYMENT_SECRET")
    return secret


def engine_secret() -> bytes:
    """What the engine's first worker holds: the operator's secret, else a random one."""
    return secret_from_env() or secrets.token_bytes(32)


class Keys:
    """The keys derived from one deployment secret."""

    def __init__(self, secret: bytes):
        self._salt = _derive(secret, b"cache-salt")
        self._audit = _derive(secret, b"audit-fingerprint")
        self._label = _derive(secret, b"metrics-label")

    @staticmethod
    def random() -> Keys:
        """A process's own keys, until it knows the deployment's (nothing is salted or
        fingerprinted with them in a server: it fetches the deployment's before it serves)."""
        return Keys(secrets.token_bytes(32))

    def cache_salt(self, client: str | None, material: Any) -> str | None:
        """The ``cache_salt`` a request runs with: a keyed MAC of the client's own salt (None:
        it set none) and of what xmix derives from the request's write configuration (None:
        nothing; else any JSON value). None only when both are None (vLLM's unsalted cache).

        No value a client can send equals a salt xmix derives: every client salt is itself
        passed through the MAC, in the first slot, which a derived salt has empty; and
        without the secret nobody can compute either. Two requests share prefix blocks only
        when they agree on both the client salt and the configuration."""
        if client is None and material is None:
            return None
        msg = json.dumps([client, material], separators=(",", ":"), allow_nan=False)
        return SALT_PREFIX + _mac(self._salt, msg.encode("utf-8"))

    def fingerprint(self, key: str | None) -> str:
        """What the audit log shows of an API key: 16 hex digits of a keyed MAC (the same key
        gives the same fingerprint across the deployment's API servers; nobody without the
        secret can test a guess of the key against it)."""
        if not key:
            return "none"
        return _mac(self._audit, key.encode("utf-8"))[:16]

    def label(self, name: str) -> str:
        """An app or gate name as /metrics shows it when the operator hides names."""
        return "h" + _mac(self._label, name.encode("utf-8"))[:12]
