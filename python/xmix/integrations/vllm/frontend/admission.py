"""Admission of each request's xmix control in the frontend, against the deployed apps of the
registry (registry.py), before the request reaches the engine (processor_patches.py calls it
from ``InputProcessor.process_inputs``; the server's pre-stream check calls it first):
  - the request's ``extra_args["xmix"]`` (a dict offline, a JSON string from ``vllm_xargs``)
    is checked against the deployed apps and replaced by a canonical dict on the request's
    own copy of its SamplingParams (the caller's object is never changed, so reusing one
    SamplingParams for many calls keeps working). The canonical dict pins every app it
    names to its deployment version and carries parameters as column values, so the
    workers admit it without any check that could fail;
  - its result options (encoding, dtype, window of positions, byte cap) are checked, and a
    request whose reads over its prompt would exceed its byte cap is refused; reads of
    generated tokens are cut at the cap by the worker, with a marker (``results_codec``);
  - requests whose effective apps write get a ``cache_salt`` from everything that shapes
    their KV (apps, deployment versions, every parameter value, defaults included, and the
    control epoch), so their prompt KV is never shared with another configuration. The salt
    is a MAC keyed with the deployment's secret over that and the client's own
    ``cache_salt``, and every client salt goes through the same MAC, so no client can send
    the salt of a configuration it may not use (keyed.py);
  - requests whose apps read, or keep per-request state over the prompt, skip reading the
    prefix cache, so every prompt token is computed and read;
  - with a KV connector, or a prompt computed on another instance, requests whose apps need
    the prompt computed here are refused with the reason (``_kv_connector_rules``).

Admission has no state of its own: everything it reads (apps, policy, KV connector, keys,
epoch, revision) is the registry's, so it is functions over a ``Registry``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import threading
from dataclasses import dataclass
from typing import Any

from xmix import settings
from xmix.integrations.vllm import tenants
from xmix.integrations.vllm.errors import _validation_error, shown
from xmix.integrations.vllm.frontend.registry import Deployed, Registry
from xmix.lang.lowering import DeployError, LoweredApp
from xmix.lang.results_codec import OPTION_KEYS, max_result_bytes, parse_options
from xmix.runtime.control import RequestError, resolve_params

REQUEST_KEYS = {"apps", "params"} | OPTION_KEYS


def max_control_bytes() -> int:
    return int(settings.get("XMIX_MAX_CONTROL_BYTES"))


# KV connectors shipped with vLLM 0.32 that key what they store and load by the request's
# block hashes, which include its cache_salt (v1/core/kv_cache_utils.py:
# generate_block_hash_extra_keys), so KV computed under one write configuration is never
# loaded by another (offloading_connector.py / offloading/scheduler.py: request.block_hashes).
SALTED_CONNECTORS = frozenset({"OffloadingConnector"})


@dataclass
class Admission:
    control: dict | None  # canonical control for the workers (None: the request has none)
    # What shapes the request's KV besides its tokens (the control epoch, its writing apps,
    # their versions and parameter values), None when nothing does; the cache salt is a
    # keyed MAC of this and the client's own cache_salt (``cache_salt``, keyed.py).
    salt: Any
    skip_cache: bool  # skip reading the prefix cache
    # Bytes its reads return over the prompt, all sequences together (known in advance).
    prompt_bytes: int = 0


class ResponseBudget:
    """What the read results of one HTTP response (all its prompts and choices) may take
    (``XMIX_MAX_RESPONSE_BYTES``, or the caller's policy). The server's pre-stream check
    refuses a response whose reads over its prompts alone exceed it; what is left is shared
    out evenly as ``spare`` bytes per sequence for the reads of generated tokens, which the
    worker cuts at each sequence's budget with the truncation marker. Each admission takes
    its sequences' budgets from ``remaining``, so the response stays under the cap even when
    apps change between the check and the admissions."""

    def __init__(self, total: int, spare: int, source: str):
        self.total, self.spare, self.source = total, spare, source
        self.remaining = total
        self.lock = threading.Lock()

    def take(self, per_seq: int, known: int, n: int) -> int:
        """A sequence's byte budget: at most ``per_seq`` (the request's own cap), its reads
        over the prompt (``known``) plus the spare, and an n-th of what is left."""
        with self.lock:
            b = max(min(per_seq, known + self.spare, self.remaining // n), 0)
            self.remaining -= b * n
            return b


# The registry revision at which the server's pre-stream check admitted the request being
# served (server._precheck), in that request's own context (clients cannot set it). vLLM
# admits a streamed request lazily, after the HTTP 200 is committed: an app that went away or
# was switched off between the check and that admission then applies to the request the way a
# change in flight would (left out, named in provenance ``changed``), instead of a refusal
# inside a stream that already answered 200.
_PRECHECKED: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "xmix_prechecked", default=None
)


def mark_prechecked(revision: int) -> None:
    _PRECHECKED.set(revision)


# The response budget of the HTTP request being served (set by the server's pre-stream check,
# in that request's own context; none offline).
_RESPONSE: contextvars.ContextVar[ResponseBudget | None] = contextvars.ContextVar(
    "xmix_response_budget", default=None
)


def set_response_budget(budget: ResponseBudget | None) -> None:
    _RESPONSE.set(budget)


def remote_prefill(kv_transfer_params: Any) -> bool:
    """A request whose prompt KV another instance computed (what vLLM's own code reads:
    v1/engine/output_processor.py, v1/core/sched/scheduler.py)."""
    return isinstance(kv_transfer_params, dict) and bool(
        kv_transfer_params.get("do_remote_prefill")
    )


def admit(
    reg: Registry,
    raw: Any,
    prompt_len: int = 0,
    max_tokens: int = 0,
    n: int = 1,
    count: bool = True,
    remote_prefill: bool = False,
) -> Admission:
    """Check one request's control (``raw``) and resolve it; raises the validation error
    the client sees. ``count=False``: a check ahead of the real admission (the server
    runs one before a stream starts) that counts only refusals. ``remote_prefill``: the
    request's ``kv_transfer_params`` say its prompt KV was computed on another instance
    (P/D disaggregation)."""
    if count and reg.stale():
        # the server's admission syncs first (server._catch_up); a route that does not
        # pass there, with the engines' ledger out of reach for seconds, is refused
        raise _validation_error(
            f"xmix: this API server has not been able to follow the control plane's "
            f"changes for over {reg.STALE_S:g} s (the engines' ledger did not answer); "
            "the request is refused rather than admitted against apps that may have "
            "changed. Retry."
        )
    caller = tenants.current()
    tenant = caller.tenant if caller is not None else (reg.policy.default if reg.policy else None)
    since = _PRECHECKED.get() if count else None
    dropped: list[str] = []
    with reg.lock:
        gone_ok = since is not None and since != reg.revision
        try:
            cfg, overrides = _parse(reg, raw, tenant, dropped if gone_ok else None)
            apps = cfg["apps"] if cfg else []
            effective = [reg.apps[a] for a in apps] + [
                d
                for a, d in reg.apps.items()
                if d.mode == "all" and a not in apps and (tenant is None or tenant.may_force(a))
            ]
            cfg, prompt_bytes = _result_options(
                reg, cfg, effective, prompt_len, n, _RESPONSE.get() if count else None
            )
        except ValueError:
            reg.count("rejected")
            raise
        if count and cfg and cfg["apps"]:
            reg.count("requests")
            for a in cfg["apps"]:
                reg.count("app_requests", app=a)
        # Every request carries what it runs with (provenance) and, under a policy that
        # limits the apps forced on it, which mode-"all" apps may apply to it.
        cfg = cfg if cfg is not None else {"apps": [], "params": {}, "pin": {}}
        forced = sorted(tenant.forced) if tenant is not None and tenant.forced is not None else None
        if forced is not None:
            cfg["forced"] = forced
        cfg["applied"] = {
            "apps": [
                {
                    "name": d.app.name,
                    "version": d.version,
                    "mode": "request" if d.app.name in apps else "all",
                    "params": d.applied_params(overrides.get(d.app.name, {})),
                }
                for d in effective
            ],
            **({"tenant": tenant.name} if tenant is not None else {}),
            "_rev": reg.revision,
            "_reg": reg.uid,
            "_forced": forced,
            **({"_dropped": dropped} if dropped else {}),
        }
        if not effective and not reg.epoch:
            return Admission(cfg, None, False, prompt_bytes)
        writes = sorted((d for d in effective if d.lowered.writes), key=lambda d: d.app.name)
        salt = None
        if writes or reg.epoch:
            key = [
                reg.epoch,
                [
                    [
                        d.app.name,
                        d.version,
                        [
                            overrides.get(d.app.name, {}).get(i, c.default)
                            for i, c in enumerate(d.cols)
                        ],
                    ]
                    for d in writes
                ],
            ]
            salt = key
        skip = any(d.lowered.reads_prompt or d.lowered.stateful for d in effective)
        if reg.kv_connector is not None or remote_prefill:
            try:
                _kv_connector_rules(reg, effective, remote_prefill)
            except ValueError:
                reg.count("rejected")
                raise
        return Admission(cfg, salt, skip, prompt_bytes)


def cache_salt(reg: Registry, client: str | None, adm: Admission) -> str | None:
    """The cache_salt a request runs with: the client's own salt and ``adm.salt`` (what
    xmix derives from its apps) in a keyed MAC; no client value equals a derived salt."""
    return reg.keys.cache_salt(client, adm.salt)


def check_forced_write(reg: Registry, name: str, lowered: LoweredApp, mode: str) -> None:
    """A writing app in mode "all" on a connector that would make admission refuse every
    request (``_kv_connector_rules``) is refused when it is deployed or switched."""
    if (
        mode == "all"
        and lowered.writes
        and reg.kv_connector is not None
        and reg.kv_connector not in SALTED_CONNECTORS
    ):
        raise DeployError(
            f"app {name!r} writes, and in mode 'all' on this engine's KV connector "
            f"({reg.kv_connector}, which keys stored KV by tokens, not cache salts) every "
            "request would be refused; use mode 'request' (requests naming it are refused "
            "with the reason) or a connector keyed by block hashes ("
            + ", ".join(sorted(SALTED_CONNECTORS))
            + ")"
        )


def _kv_connector_rules(reg: Registry, effective: list[Deployed], remote_prefill: bool) -> None:
    """Requests whose state over the prompt would be missing or wrong if their prompt KV
    came from outside this engine, refused with the reason (docs/serving.md, "KV
    connectors"). Reads and latches/spans need every prompt token computed here: they
    skip reading any cache, vLLM's scheduler then asks the connector for nothing
    (``v1/core/sched/scheduler.py``: ``skip_reading_prefix_cache`` zeroes the external
    hit), so with a connector that loads on its own they just recompute the prompt. A
    request whose prompt was already computed elsewhere (P/D decode side) cannot."""
    writes = sorted(d.app.name for d in effective if d.lowered.writes)
    prompt_state = sorted(
        d.app.name for d in effective if d.lowered.reads_prompt or d.lowered.stateful
    )
    if remote_prefill and (writes or prompt_state):
        raise _validation_error(
            "this request's prompt KV comes from another instance (kv_transfer_params."
            "do_remote_prefill: prefill/decode disaggregation), and its apps "
            + ", ".join(sorted(set(writes) | set(prompt_state)))
            + " need the prompt computed where they run (reads and latches/spans over the "
            "prompt; writes, whose effect on the prompt KV this instance cannot check): "
            "send the request to an instance that computes its prompt"
        )
    if writes and reg.kv_connector is not None and reg.kv_connector not in SALTED_CONNECTORS:
        raise _validation_error(
            f"app(s) {', '.join(writes)} write, and this engine's KV connector "
            f"({reg.kv_connector}) stores and loads KV keyed by the prompt's tokens, not by "
            "the cache salt that keeps the KV of a differently steered prompt apart: other "
            "requests would load this request's steered KV (or it theirs). Writing apps need "
            "a connector keyed by vLLM's block hashes ("
            + ", ".join(sorted(SALTED_CONNECTORS))
            + ") or no connector"
        )


def _result_options(
    reg: Registry,
    cfg: dict | None,
    effective: list[Deployed],
    prompt_len: int,
    n: int,
    budget: ResponseBudget | None = None,
) -> tuple[dict | None, int]:
    """The request's result options into its canonical control (each sequence's byte
    budget included), and the bytes its reads return over the prompt (all sequences).
    Those are known now (prompt length x window x read width): above the budget, the
    request is refused. Reads of generated tokens depend on how long it runs: the worker
    cuts them at the budget and marks the results (``TRUNCATED_KEY``). ``budget``: the
    whole response's, which each sequence's budget is taken from."""
    raw = cfg.pop("results_raw", {}) if cfg else {}
    n = max(n, 1)
    try:
        opts = parse_options(raw, n)
    except ValueError as e:
        raise _validation_error(str(e)) from None
    readers = [d for d in effective if d.lowered.reads]
    if not readers:
        return cfg, 0
    known = sum(d.prompt_result_bytes(prompt_len, opts) for d in readers)
    assert opts.max_bytes is not None  # parse_options always sets it
    if known > opts.max_bytes:
        reg.count("result_cap_refusals")
        total = raw.get("max_result_bytes", max_result_bytes())
        source = "max_result_bytes" if "max_result_bytes" in raw else "XMIX_MAX_RESULT_BYTES"
        raise _validation_error(
            f"the reads of this request return {known} bytes over its {prompt_len} prompt tokens "
            f"({', '.join(d.app.name for d in readers)}, {opts.encoding}, {opts.dtype}"
            f"{', ' + str(n) + ' sequences' if n > 1 else ''}); the cap is {total} bytes per "
            f"request ({source}){', ' + str(opts.max_bytes) + ' per sequence' if n > 1 else ''}: "
            f'report fewer positions ("positions"), fewer or narrower reads, a smaller '
            f'"dtype", "encoding": "base64", or n=1'
        )
    if budget is not None:
        opts = dataclasses.replace(opts, max_bytes=budget.take(opts.max_bytes or 0, known, n))
    ctl = dict(cfg) if cfg else {"apps": [], "params": {}, "pin": {}}
    ctl["results"] = opts.to_control()
    return ctl, known * n


def _parse(
    reg: Registry, raw: Any, tenant: tenants.Tenant | None = None, dropped: list[str] | None = None
) -> tuple[dict | None, dict[str, dict[int, float]]]:
    """``dropped`` (a list): the request passed the pre-stream check before a change, so
    apps that went away or were switched off since are left out and listed there rather
    than refused."""
    if raw is None:
        return None, {}
    if isinstance(raw, (str, bytes)):
        if len(raw) > max_control_bytes():
            raise _validation_error(
                f"the xmix control is {len(raw)} bytes; at most "
                f"{max_control_bytes()} (XMIX_MAX_CONTROL_BYTES)"
            )
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _validation_error(
                f"the xmix control is not valid JSON ({e.msg} at position {e.pos})"
            ) from None
        except RecursionError:
            raise _validation_error("the xmix control is nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise _validation_error(f"the xmix control is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise _validation_error(
            f"the xmix control must be an object like "
            f'{{"apps": [...], "params": {{...}}}}, got {type(raw).__name__}'
        )
    unknown = set(raw) - REQUEST_KEYS
    if unknown:
        raise _validation_error(
            f"unknown key(s) {shown(sorted(map(str, unknown)))} in the xmix "
            f"control; allowed: {sorted(REQUEST_KEYS)}"
        )
    apps = raw.get("apps", [])
    if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
        raise _validation_error(f'"apps" must be a list of app names, got {shown(apps)}')
    if len(set(apps)) != len(apps):
        raise _validation_error(f'"apps" lists an app twice: {shown(apps)}')
    max_apps = settings.get("XMIX_MAX_REQUEST_APPS")
    if len(apps) > max_apps:
        raise _validation_error(
            f"the request names {len(apps)} apps; at most {max_apps} (XMIX_MAX_REQUEST_APPS)"
        )
    for a in apps:
        if tenant is not None and not tenant.may_name(a):
            raise tenants.forbidden(
                f"app {shown(a)} is not allowed for this key "
                f"(tenant {tenant.name!r} of the server's policy)"
            )
        if dropped is not None and (a not in reg.apps or reg.apps[a].mode == "off"):
            dropped.append(a)
            continue
        if a not in reg.apps:
            raise _validation_error(f"unknown app {shown(a)}; deployed: {_listed(reg, tenant)}")
        if reg.apps[a].mode == "off":
            raise _validation_error(f"app {a!r} is deployed but switched off")
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise _validation_error(
            f'"params" must be an object {{app: {{name: number}}}}, got {shown(params)}'
        )
    n_params = sum(len(p) if isinstance(p, dict) else 1 for p in params.values())
    max_params = settings.get("XMIX_MAX_REQUEST_PARAMS")
    if n_params > max_params:
        raise _validation_error(
            f"the request sets {n_params} parameters; at most {max_params} "
            f"(XMIX_MAX_REQUEST_PARAMS)"
        )
    canon: dict[str, dict[str, float]] = {}
    overrides: dict[str, dict[int, float]] = {}
    for a, p in params.items():
        if tenant is not None and not tenant.may_name(a):
            raise tenants.forbidden(
                f"params for app {shown(a)}, which this key may not use "
                f"(tenant {tenant.name!r} of the server's policy)"
            )
        if dropped is not None and (
            a in dropped or a not in reg.apps or (a not in apps and reg.apps[a].mode != "all")
        ):
            if a not in dropped:
                dropped.append(a)
            continue
        if a not in reg.apps:
            raise _validation_error(
                f"params for unknown app {shown(a)}; deployed: {_listed(reg, tenant)}"
            )
        if a not in apps and (
            reg.apps[a].mode != "all" or (tenant is not None and not tenant.may_force(a))
        ):
            raise _validation_error(f"params for app {a!r}, which this request does not use")
        try:
            overrides[a] = resolve_params(reg.apps[a].cols, p, f"app {a!r}")
        except (RequestError, DeployError) as e:
            raise _validation_error(str(e)) from None
        held = sorted(reg.apps[a].cols[i].key for i in overrides[a] if i in reg.apps[a].locked)
        if held:
            raise tenants.forbidden(
                f"app {a!r}: parameter(s) {held} are locked by the operator; "
                f"requests may not override them"
            )
        canon[a] = {k: float(v) for k, v in p.items()}
    if dropped:
        apps = [a for a in apps if a not in dropped]
    pin = {
        a: [reg.apps[a].version, sorted([c, v] for c, v in overrides.get(a, {}).items())]
        for a in [*apps, *(a for a in params if a not in apps and a not in (dropped or ()))]
    }
    out = {"apps": list(apps), "params": canon, "pin": pin}
    out["results_raw"] = {k: raw[k] for k in OPTION_KEYS if k in raw}  # checked in admit
    return out, overrides


def _listed(reg: Registry, tenant: tenants.Tenant | None) -> list[str]:
    """The deployed apps a caller may know of."""
    return sorted(a for a in reg.apps if tenant is None or tenant.may_name(a))
