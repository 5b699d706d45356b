"""xmix in the vLLM frontend process (LLM / AsyncLLM): the app registry, admission of each
request's xmix control, prefix-cache isolation, and read results on RequestOutput.

Per request, in ``InputProcessor.process_inputs`` (before the request reaches the engine):
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
    prefix cache, so every prompt token is computed and read.

Results come back per step inside ``EngineCoreOutput.kv_transfer_params["_xmix_results"]``
(``RESULTS_KEY``; set by the engine core, engine_core.py, as packed arrays, on a copy of a KV
connector's dict that keeps its keys; engine_core.py says why that channel and why it cannot
collide with a connector); ``OutputProcessor.process_outputs`` takes them out before vLLM sees
them (the dict left is exactly the connector's, or None) and attaches them as ``.xmix``
({app: {read: ReadResult}}) to each sequence's ``CompletionOutput`` and to the
``RequestOutput`` (the reads of its first sequence). A request a worker could not serve
carries an error marker there instead; it is finished with ``finish_reason="error"``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import json
import logging
import os
import reprlib
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmix import settings
from xmix.api import App
from xmix.conditions import n_instructions
from xmix.control import MODES, ParamCol, RequestError, param_columns, resolve_params
from xmix.hooks import ModelShape
from xmix.lowering import DeployError, LoweredApp, lower
from xmix.results_codec import (
    DROPPED_KEY,
    OPTION_KEYS,
    STOPPED_KEY,
    SWITCHED_KEY,
    TRUNCATED_KEY,
    ResultOptions,
    copy_results,
    max_result_bytes,
    parse_options,
    position_bytes,
    read_shape,
    unpack_results,
)

from . import fence, keyed, tenants
from .ledger import LEASE_S
from .request_controls import control_from_args

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply

XMIX_KEY = "xmix"
# Where read results ride on EngineCoreOutput.kv_transfer_params between the engine core and
# the frontend (engine_core.py): a private name no KV connector uses.
RESULTS_KEY = "_xmix_results"
REQUEST_KEYS = {"apps", "params"} | OPTION_KEYS

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother, _short.maxlist, _short.maxdict = 2, 60, 60, 6, 6


def shown(v: Any) -> str:
    """A bounded repr of something a client sent (never recursing into deep nesting)."""
    return _short.repr(v)


def max_control_bytes() -> int:
    return int(settings.get("XMIX_MAX_CONTROL_BYTES"))


_ERROR_CLASS = None


def _validation_error(msg: str, value: Any = None) -> Exception:
    """A bad per-request control: vLLM's validation error (HTTP 400 on the server), and a
    ValueError for offline callers."""
    global _ERROR_CLASS
    if _ERROR_CLASS is None:
        try:
            from vllm.exceptions import VLLMValidationError

            class XmixValidationError(VLLMValidationError, ValueError):
                pass
        except ImportError:  # pragma: no cover - older vLLM

            class XmixValidationError(ValueError):
                def __init__(self, message, parameter=None, value=None):
                    super().__init__(message)

        _ERROR_CLASS = XmixValidationError
    return _ERROR_CLASS(
        f"xmix: {msg}", parameter="vllm_xargs.xmix", value=None if value is None else shown(value)
    )


@dataclass
class Needs:
    """What an app takes of the engine's control block."""

    ops: int = 0
    cond: int = 0
    params: int = 0
    channels: int = 0
    token_sets: int = 0
    spans: int = 0
    sinces: int = 0

    @staticmethod
    def of(lw: LoweredApp) -> Needs:
        return Needs(
            len(lw.ops),
            sum(n_instructions(o.cond) for o in lw.ops if o.cond is not None),
            len(param_columns(lw)),
            sum(o.n_channels for o in lw.reads.values()),
            len(lw.token_sets),
            len(lw.spans),
            len(lw.sinces),
        )

    def __add__(self, o: Needs) -> Needs:
        return Needs(
            self.ops + o.ops,
            self.cond + o.cond,
            self.params + o.params,
            self.channels + o.channels,
            self.token_sets + o.token_sets,
            self.spans + o.spans,
            self.sinces + o.sinces,
        )


_NEEDS = {
    "ops": ("max_ops", "ops"),
    "cond": ("max_cond", "condition instructions"),
    "params": ("max_params", "parameter columns"),
    "channels": ("max_channels", "reads"),
    "token_sets": ("max_token_sets", "token sets"),
    "spans": ("max_spans", "spans"),
    "sinces": ("max_sinces", "since(...) terms"),
}


class EngineGone(RuntimeError):
    """The engine stopped (a shutdown, or it died) while a control change waited for it."""


class EngineUnreachable(EngineGone):
    """An engine did not answer a control RPC in time (``XMIX_RPC_TIMEOUT_S``): its host
    unreachable, or the engine dead without vLLM noticing (a killed remote data-parallel
    engine leaves the others serving and its requests waiting). Messages to an engine are
    delivered in order, so what the change sends after it (its rollback) reaches that engine
    after the change itself, if it ever answers again."""


class NotSaved(EngineGone):
    """A change refused because the state directory could not record it (state_dir.py): it
    is written before any engine applies it, so nothing changed. Answered as a change the
    server could not complete (HTTP 503)."""


class WorkerError(RuntimeError):
    """An xmix worker method failed on a worker; the message is the worker's own
    (``"<Type>: <message>"``, worker.py ``xmix_call``)."""


def answered(rpc):
    """``rpc`` (run a worker method on every worker, return their replies) through the
    workers' ``xmix_call``: each worker answers ``("ok", result)`` or ``("error", message)``
    and never raises inside vLLM's collective RPC (why: worker.py ``xmix_call``). Returns the
    results, or raises WorkerError with the first failure once every reply is read."""

    def call(method: str, args: tuple) -> list:
        out, failed = [], None
        for r in rpc("xmix_call", (method, tuple(args))):
            if not (isinstance(r, (list, tuple)) and len(r) == 2 and r[0] in ("ok", "error")):
                raise WorkerError(f"{method}: a worker sent {type(r).__name__}, not an answer")
            if r[0] == "error" and failed is None:
                failed = str(r[1])
            out.append(r[1])
        if failed is not None:
            raise WorkerError(failed)
        return out

    return call


class CapacityError(DeployError):
    """A deploy that would fit the engine but finds it full of other apps (its control
    block, or the server's limits): HTTP 507 on the server. The message names the limit."""


@dataclass
class Deployed:
    app: App
    lowered: LoweredApp
    mode: str
    version: int
    cols: list[ParamCol] = field(default_factory=list)
    needs: Needs = field(default_factory=Needs)
    locked: set[int] = field(default_factory=set)  # columns clients may not override

    @property
    def defaults(self) -> dict[str, float]:
        return {c.key: c.default for c in self.cols if c.public}

    def prompt_result_bytes(self, prompt_len: int, opts: ResultOptions) -> int:
        """Bytes its reads can report over the prompt's positions in the request's window."""
        win = opts.window
        n = 0
        for op in self.lowered.reads.values():
            shape = read_shape(op)
            if shape.once:  # CAST: once per request, at the last prompt token
                k = (
                    1
                    if prompt_len
                    and (win is None or win.count(prompt_len - 1, prompt_len, prompt_len))
                    else 0
                )
            else:
                k = prompt_len if win is None else int(win.count(0, prompt_len, prompt_len))
            n += k * position_bytes(shape, opts)
        return n

    def describe(self) -> dict[str, Any]:
        lw = self.lowered
        return {
            "name": self.app.name,
            "mode": self.mode,
            "sites": lw.sites,
            "reads": sorted(lw.reads),
            "writes": lw.writes,
            "stateful": lw.stateful,
            "params": self.defaults,
            "version": self.version,
            "locked": sorted(self.cols[i].key for i in self.locked),
            "metadata": self.app.metadata,
        }

    def applied_params(self, overrides: dict[int, float]) -> dict[str, float]:
        """The public parameter values a request runs with: its overrides, else defaults."""
        return {c.key: overrides.get(i, c.default) for i, c in enumerate(self.cols) if c.public}


def columns_named(cols: list[ParamCol], spec: Any, who: str) -> set[int]:
    """The columns a lock names: true (every parameter), false (none), or a list of names
    matched as request parameters are ("scale": every op's, "push.scale": one op's)."""
    if spec is True:
        return {i for i, c in enumerate(cols) if c.public}
    if spec is False or spec is None:
        return set()
    if not isinstance(spec, list) or not all(isinstance(k, str) for k in spec):
        raise DeployError(
            f'{who}: "locked" must be true, false or a list of parameter names, got {shown(spec)}'
        )
    out: set[int] = set()
    for key in spec:
        if "." in key:
            op, p = key.rsplit(".", 1)
            hits = [i for i, c in enumerate(cols) if c.public and c.op == op and c.name == p]
        else:
            hits = [
                i for i, c in enumerate(cols) if c.public and c.op is None and c.name == key
            ] or [i for i, c in enumerate(cols) if c.public and c.name == key]
        if not hits:
            raise DeployError(
                f"{who}: cannot lock unknown parameter {shown(key)}; known: "
                f"{sorted(c.key for c in cols if c.public)}"
            )
        out.update(hits)
    return out


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
    # keyed MAC of this and the client's own cache_salt (Registry.cache_salt, keyed.py).
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


_REGISTRIES: weakref.WeakValueDictionary[int, Registry] = weakref.WeakValueDictionary()
_REGISTRY_IDS = itertools.count(1)
HISTORY = 4096  # control changes remembered for the provenance of requests in flight


class Registry:
    """The frontend's record of deployed apps; the source of truth for admission."""

    def __init__(self, shape: ModelShape, tokenizer=None):
        from . import metrics

        self.metrics = metrics.get()
        self.shape = shape
        self.tokenizer = tokenizer
        self.apps: dict[str, Deployed] = {}
        self.lock = threading.RLock()
        # The engine's KV connector class name (--kv-transfer-config), None without one:
        # admission keeps requests whose apps need the prompt computed here off external KV.
        self.kv_connector: str | None = None
        self._version = 0
        # A server's per-key policy (tenants.Policy); None offline. With one, a request whose
        # caller is unknown gets the policy's default.
        self.policy: tenants.Policy | None = None
        # Control changes in order, for what reached requests in flight (provenance).
        self.revision = 0
        self.history: deque = deque(maxlen=HISTORY)  # (revision, app, kind, mode after)
        # Changes on their way to the engines (app -> its mode after the change). The engines
        # apply a change at their next step, before the RPC that carried it returns and the
        # registry follows the ledger: a request that finishes in that window ran with it.
        self.pending: dict[str, str | None] = {}
        self.uid = next(_REGISTRY_IDS)
        _REGISTRIES[self.uid] = self
        # The control epoch: +1 at every change that reaches the KV of running requests (see
        # ``_touches_kv``). It is part of every cache salt once non-zero, so blocks computed
        # by requests in flight across a change are never reused by requests admitted after.
        self.epoch = 0
        self.capacity: dict[str, int] | None = None  # the workers' control-block sizes
        self.sync = None  # the Controller's: follow the engines' ledger (ledger.py)
        # With several API servers (``follow``): when this registry last started a sync that
        # succeeded. A change made through another server waits at most ledger.LIVE_S for this
        # one to confirm it; past STALE_S without a sync, this one syncs (or refuses) before
        # it admits, so it never admits against a state older than a change that answered.
        self.follows = False
        self.synced_at = 0.0
        self.held_until = 0.0  # while this server holds the lease nothing changes elsewhere
        # Keyed with the deployment's secret once the Controller fetched it from the engines
        # (before a server serves); this process's own until then.
        self.keys = keyed.Keys.random()

    STALE_S = 4.0  # < ledger.LIVE_S: the margin covers the two processes' clocks and a sync

    def stale(self) -> bool:
        now = time.monotonic()
        return self.follows and now > self.held_until and now - self.synced_at > self.STALE_S

    def cache_salt(self, client: str | None, adm: Admission) -> str | None:
        """The cache_salt a request runs with: the client's own salt and ``adm.salt`` (what
        xmix derives from its apps) in a keyed MAC; no client value equals a derived salt."""
        return self.keys.cache_salt(client, adm.salt)

    # ------------------------------------------------------------------ deploy side
    def used(self) -> Needs:
        total = Needs()
        for d in self.apps.values():
            total = total + d.needs
        return total

    def prepare(self, app: App) -> tuple[LoweredApp, bytes, Needs]:
        """Check an app against the model and the room left in the engine; return it
        lowered, its needs, and its bytes for the workers with token sets resolved to ids
        (workers have no tokenizer). Nothing is sent to a worker before this passed."""
        with self.lock:
            if app.name in self.apps:
                raise DeployError(f"app {app.name!r} is already deployed")
            used = self.used()
            max_apps = settings.get("XMIX_MAX_APPS")
            if max_apps is not None and len(self.apps) >= max_apps:
                raise CapacityError(
                    f"app {app.name!r}: {len(self.apps)} apps are deployed; the server "
                    f"allows {max_apps} (XMIX_MAX_APPS)"
                )
        cap = dict(self.capacity) if self.capacity else None
        if cap:
            from xmix.control import K

            cap.setdefault("max_token_sets", K["MAX_TOKEN_SETS"])
            cap.setdefault("max_spans", K["MAX_SPANS"])
            cap.setdefault("max_sinces", K["MAX_STICKY"])
            max_ops = settings.get("XMIX_MAX_OPS")
            if max_ops is not None and max_ops < cap["max_ops"]:
                cap["max_ops"] = max_ops
        # An app that could never fit (more than the whole engine, or a server limit, holds)
        # is the client's error (422); one that fits an engine the other apps have filled is
        # 507. Either message names the limit.
        server_ops = settings.get("XMIX_MAX_OPS")

        def where(cap_key: str) -> str:
            if cap_key == "max_ops" and server_ops is not None and server_ops == cap["max_ops"]:
                return f"XMIX_MAX_OPS={server_ops}"
            return f"{cap_key}={cap[cap_key]}"

        try:
            lowered = lower(
                app, self.shape, self.tokenizer, max_ops=cap["max_ops"] if cap else None
            )
        except DeployError as e:
            if cap and ("max_ops" in str(e) or "engine has room" in str(e)):
                raise DeployError(f"{e} ({where('max_ops')})") from None
            raise
        needs = Needs.of(lowered)
        if cap:
            for attr, (cap_key, what) in _NEEDS.items():
                want, have = getattr(needs, attr), cap[cap_key] - getattr(used, attr)
                if want > cap[cap_key]:
                    raise DeployError(
                        f"app {app.name!r} needs {want} {what}; the engine holds "
                        f"{cap[cap_key]} in all ({where(cap_key)})"
                    )
                if want > have:
                    raise CapacityError(
                        f"app {app.name!r} needs {want} {what}; the engine has room "
                        f"for {have} more ({where(cap_key)})"
                    )
        spec = app.spec()
        spec["token_sets"] = [{"name": n, "ids": ids} for n, ids in lowered.token_sets.items()]
        resolved = App.from_spec(spec, app.tensors(), source=f"app {app.name!r}", allow_custom=True)
        return lowered, resolved.to_bytes(), needs

    def next_version(self) -> int:
        with self.lock:
            self._version += 1
            return self._version

    def changed(self, kind: str, name: str | None = None) -> None:
        if name is not None:
            with self.lock:
                self.revision += 1
                d = self.apps.get(name)
                self.history.append((self.revision, name, kind, d.mode if d is not None else None))
        self.count("changes", kind=kind)
        if self.metrics:
            self.metrics["deployed"].labels(model_name=self.shape.model_name).set(len(self.apps))

    def announce(self, name: str, mode_after: str | None) -> None:
        """A change of ``name`` is about to be sent to the engines: from now until ``settle``,
        requests that finish count it as a change while they ran (``changed_since``). Called
        only after every check passed, so a refused change leaves no trace; a change that
        fails on the way stays in the history (a request may then name it as changed
        without it having changed: the safe side)."""
        with self.lock:
            self.revision += 1
            self.history.append((self.revision, name, "pending", mode_after))
            self.pending[name] = mode_after

    def settle(self, name: str) -> None:
        with self.lock:
            self.pending.pop(name, None)

    def add(
        self,
        app: App,
        lowered: LoweredApp,
        mode: str,
        version: int,
        needs: Needs,
        locked: Any = False,
    ) -> Deployed:
        with self.lock:
            d = Deployed(app, lowered, mode, version, param_columns(lowered), needs)
            d.locked = columns_named(d.cols, locked, f"app {app.name!r}")
            self.apps[app.name] = d
            if lowered.writes and mode == "all":
                self.epoch += 1
            return d

    def remove(self, name: str) -> None:
        with self.lock:
            d = self.apps.pop(name, None)
            if d is not None and d.lowered.writes:
                self.epoch += 1

    def get(self, name: str) -> Deployed:
        d = self.apps.get(name)
        if d is None:
            raise DeployError(f"app {name!r} is not deployed; deployed: {sorted(self.apps)}")
        return d

    def check_patch(
        self, name: str, mode: str | None, params: Any, locked: Any = None
    ) -> tuple[dict[int, float], set[int] | None]:
        """Every check of a PATCH, nothing applied: the new default per column, and the
        columns locked after it (None: unchanged)."""
        d = self.get(name)
        if mode is not None and mode not in MODES:
            raise DeployError(f"mode must be one of {list(MODES)}, got {shown(mode)}")
        cols = resolve_params(d.cols, params, f"app {name!r}") if params is not None else {}
        lock = columns_named(d.cols, locked, f"app {name!r}") if locked is not None else None
        return cols, lock

    def patch(
        self, name: str, mode: str | None, cols: dict[int, float], locked: set[int] | None = None
    ) -> None:
        with self.lock:
            d = self.get(name)
            for i, v in cols.items():
                d.cols[i].default = v
            if mode is not None:
                d.mode = mode
            if locked is not None:
                d.locked = locked
            if d.lowered.writes and (cols or mode is not None):
                self.epoch += 1

    def describe(self) -> list[dict]:
        with self.lock:
            return [d.describe() for d in sorted(self.apps.values(), key=lambda d: d.version)]

    # ------------------------------------------------------------------ request side
    def count(self, name: str, n: float = 1, **labels) -> None:
        if self.metrics:
            from .metrics import shown as shown_labels

            self.metrics[name].labels(model_name=self.shape.model_name, **shown_labels(labels)).inc(
                n
            )

    def admit(
        self,
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
        if count and self.stale():
            # the server's admission syncs first (server._catch_up); a route that does not
            # pass there, with the engines' ledger out of reach for seconds, is refused
            raise _validation_error(
                f"xmix: this API server has not been able to follow the control plane's "
                f"changes for over {self.STALE_S:g} s (the engines' ledger did not answer); "
                "the request is refused rather than admitted against apps that may have "
                "changed. Retry."
            )
        caller = tenants.current()
        tenant = (
            caller.tenant if caller is not None else (self.policy.default if self.policy else None)
        )
        since = _PRECHECKED.get() if count else None
        dropped: list[str] = []
        with self.lock:
            gone_ok = since is not None and since != self.revision
            try:
                cfg, overrides = self._parse(raw, tenant, dropped if gone_ok else None)
                apps = cfg["apps"] if cfg else []
                effective = [self.apps[a] for a in apps] + [
                    d
                    for a, d in self.apps.items()
                    if d.mode == "all" and a not in apps and (tenant is None or tenant.may_force(a))
                ]
                cfg, prompt_bytes = self._result_options(
                    cfg, effective, prompt_len, n, _RESPONSE.get() if count else None
                )
            except ValueError:
                self.count("rejected")
                raise
            if count and cfg and cfg["apps"]:
                self.count("requests")
                for a in cfg["apps"]:
                    self.count("app_requests", app=a)
            # Every request carries what it runs with (provenance) and, under a policy that
            # limits the apps forced on it, which mode-"all" apps may apply to it.
            cfg = cfg if cfg is not None else {"apps": [], "params": {}, "pin": {}}
            forced = (
                sorted(tenant.forced) if tenant is not None and tenant.forced is not None else None
            )
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
                "_rev": self.revision,
                "_reg": self.uid,
                "_forced": forced,
                **({"_dropped": dropped} if dropped else {}),
            }
            if not effective and not self.epoch:
                return Admission(cfg, None, False, prompt_bytes)
            writes = sorted((d for d in effective if d.lowered.writes), key=lambda d: d.app.name)
            salt = None
            if writes or self.epoch:
                key = [
                    self.epoch,
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
            if self.kv_connector is not None or remote_prefill:
                try:
                    self._kv_connector_rules(effective, remote_prefill)
                except ValueError:
                    self.count("rejected")
                    raise
            return Admission(cfg, salt, skip, prompt_bytes)

    def check_forced_write(self, name: str, lowered: LoweredApp, mode: str) -> None:
        """A writing app in mode "all" on a connector that would make admission refuse every
        request (``_kv_connector_rules``) is refused when it is deployed or switched."""
        if (
            mode == "all"
            and lowered.writes
            and self.kv_connector is not None
            and self.kv_connector not in SALTED_CONNECTORS
        ):
            raise DeployError(
                f"app {name!r} writes, and in mode 'all' on this engine's KV connector "
                f"({self.kv_connector}, which keys stored KV by tokens, not cache salts) every "
                "request would be refused; use mode 'request' (requests naming it are refused "
                "with the reason) or a connector keyed by block hashes ("
                + ", ".join(sorted(SALTED_CONNECTORS))
                + ")"
            )

    def _kv_connector_rules(self, effective: list[Deployed], remote_prefill: bool) -> None:
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
        if writes and self.kv_connector is not None and self.kv_connector not in SALTED_CONNECTORS:
            raise _validation_error(
                f"app(s) {', '.join(writes)} write, and this engine's KV connector "
                f"({self.kv_connector}) stores and loads KV keyed by the prompt's tokens, not by "
                "the cache salt that keeps the KV of a differently steered prompt apart: other "
                "requests would load this request's steered KV (or it theirs). Writing apps need "
                "a connector keyed by vLLM's block hashes ("
                + ", ".join(sorted(SALTED_CONNECTORS))
                + ") or no connector"
            )

    def _result_options(
        self,
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
        if known > opts.max_bytes:
            self.count("result_cap_refusals")
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
        self, raw: Any, tenant: tenants.Tenant | None = None, dropped: list[str] | None = None
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
            if dropped is not None and (a not in self.apps or self.apps[a].mode == "off"):
                dropped.append(a)
                continue
            if a not in self.apps:
                raise _validation_error(f"unknown app {shown(a)}; deployed: {self._listed(tenant)}")
            if self.apps[a].mode == "off":
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
                a in dropped or a not in self.apps or (a not in apps and self.apps[a].mode != "all")
            ):
                if a not in dropped:
                    dropped.append(a)
                continue
            if a not in self.apps:
                raise _validation_error(
                    f"params for unknown app {shown(a)}; deployed: {self._listed(tenant)}"
                )
            if a not in apps and (
                self.apps[a].mode != "all" or (tenant is not None and not tenant.may_force(a))
            ):
                raise _validation_error(f"params for app {a!r}, which this request does not use")
            try:
                overrides[a] = resolve_params(self.apps[a].cols, p, f"app {a!r}")
            except (RequestError, DeployError) as e:
                raise _validation_error(str(e)) from None
            held = sorted(
                self.apps[a].cols[i].key for i in overrides[a] if i in self.apps[a].locked
            )
            if held:
                raise tenants.forbidden(
                    f"app {a!r}: parameter(s) {held} are locked by the operator; "
                    f"requests may not override them"
                )
            canon[a] = {k: float(v) for k, v in p.items()}
        if dropped:
            apps = [a for a in apps if a not in dropped]
        pin = {
            a: [self.apps[a].version, sorted([c, v] for c, v in overrides.get(a, {}).items())]
            for a in [*apps, *(a for a in params if a not in apps and a not in (dropped or ()))]
        }
        out = {"apps": list(apps), "params": canon, "pin": pin}
        out["results_raw"] = {k: raw[k] for k in OPTION_KEYS if k in raw}  # checked in admit
        return out, overrides

    def _listed(self, tenant: tenants.Tenant | None) -> list[str]:
        """The deployed apps a caller may know of."""
        return sorted(a for a in self.apps if tenant is None or tenant.may_name(a))

    def changed_since(self, applied: dict) -> list[str]:
        """Apps of a request's provenance changed since its admission (mode, parameters,
        undeploy), and apps that came to apply to it (deployed or switched to mode "all")."""
        rev0 = applied.get("_rev", 0)
        names = {a["name"] for a in applied.get("apps", ())}
        forced = applied.get("_forced")
        with self.lock:
            pending = dict(self.pending)
            moved = self.revision != rev0
            if not moved and not pending:
                return []
            hist = list(self.history)
        out: set[str] = set()
        if moved and (not hist or hist[0][0] > rev0 + 1):
            out |= names  # older than what is remembered
        reached = [(n, m) for rev, n, _kind, m in hist if rev > rev0] + list(pending.items())
        for name, mode in reached:
            if name in names or (mode == "all" and (forced is None or name in forced)):
                out.add(name)
        return sorted(out)


# ---------------------------------------------------------------------- patches
def _prompt_len(req) -> int:
    ids = getattr(req, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    emb = getattr(req, "prompt_embeds", None)
    return len(emb) if emb is not None else 0


def patch_input_processor(cls) -> None:
    found = fence.to_wrap("frontend", (cls, "process_inputs"))
    if found is None:
        return
    (orig,) = found

    def process_inputs(self, *args, **kwargs):
        req = orig(self, *args, **kwargs)
        reg: Registry | None = getattr(self, "_xmix_registry", None)
        sp = getattr(req, "sampling_params", None)
        if sp is None:
            if reg is not None and getattr(req, "cache_salt", None) is not None:
                req.cache_salt = reg.keys.cache_salt(req.cache_salt, None)  # see below
            return req
        raw = control_from_args(sp.extra_args, _validation_error)
        if reg is None:
            if raw is not None:
                raise _validation_error(
                    "this request asks for xmix apps, but xmix is not enabled "
                    "on this engine (use xmix.LLM / xmix serve)"
                )
            return req
        n_prompt = _prompt_len(req)
        max_tokens = sp.max_tokens
        if max_tokens is None:
            max_tokens = max(self.model_config.max_model_len - n_prompt, 0)
        adm = reg.admit(
            raw,
            n_prompt,
            max_tokens,
            sp.n or 1,
            remote_prefill=_remote_prefill((sp.extra_args or {}).get("kv_transfer_params")),
        )
        if adm.control is not None:
            # A new dict on the request's own copy: the caller's SamplingParams stays as given.
            sp.extra_args = {**(sp.extra_args or {}), XMIX_KEY: adm.control}
        # Every salt on an xmix engine goes through the keyed MAC, the client's own too, so
        # no client can send the salt of another configuration (keyed.py).
        req.cache_salt = reg.cache_salt(req.cache_salt, adm)
        if adm.skip_cache:
            sp.skip_reading_prefix_cache = True
        return req

    fence.replace(cls, "process_inputs", process_inputs, by="frontend")


def patch_output_processor(out_cls, state_cls, request_output_cls) -> None:
    """Results live on each CompletionOutput (``.xmix``: one sequence's reads, so ``n > 1``
    keeps its sequences apart) and on the RequestOutput (``.xmix``: those of ``outputs[0]``,
    the only sequence when ``n == 1``)."""
    found = fence.to_wrap(
        "frontend",
        (out_cls, "process_outputs"),
        (state_cls, "make_request_output"),
        (state_cls, "_new_completion_output"),
        (request_output_cls, "add"),
        (state_cls, "from_new_request"),
    )
    if found is None:
        return
    orig_process, orig_make, orig_new_completion, orig_add, from_new = found
    orig_from_new = from_new.__func__

    def from_new_request(cls, tokenizer, request, *args, **kwargs):
        st = orig_from_new(cls, tokenizer, request, *args, **kwargs)
        ctl = (
            (getattr(request.sampling_params, "extra_args", None) or {}).get(XMIX_KEY)
            if getattr(request, "sampling_params", None) is not None
            else None
        )
        if isinstance(ctl, dict) and "applied" in ctl:
            st.__dict__["_xmix_applied"] = ctl["applied"]
        return st

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        from vllm.v1.engine import FinishReason

        from .worker import ERROR_KEY, merge_results

        failed: list[str] = []
        for eco in engine_core_outputs:
            kvp = eco.kv_transfer_params
            if kvp and RESULTS_KEY in kvp:
                kvp = dict(kvp)
                res = unpack_results(kvp.pop(RESULTS_KEY) or {})
                eco.kv_transfer_params = kvp or None
                err = res.pop(ERROR_KEY, None)
                dropped = res.pop(DROPPED_KEY, None)
                stopped = res.pop(STOPPED_KEY, None)
                switched = res.pop(SWITCHED_KEY, None)
                st = self.request_states.get(eco.request_id)
                if st is None:
                    continue
                if stopped is not None or switched:
                    # monitors: named in the request's provenance when it finishes
                    mon = st.__dict__.setdefault("_xmix_monitors", {})
                    if stopped is not None:
                        mon.setdefault("stopped", stopped)
                    if switched:
                        mon.setdefault("switched", []).extend(switched)
                applied = st.__dict__.get("_xmix_applied")
                if dropped and applied is not None:
                    # the engine no longer held the version admitted (a change through another
                    # API server this one had not seen yet): named under "changed"
                    st.__dict__["_xmix_applied"] = {
                        **applied,
                        "_dropped": sorted(set(applied.get("_dropped", ())) | set(dropped)),
                    }
                if not res and err is None:
                    continue
                st.__dict__["_xmix_seen"] = True
                if TRUNCATED_KEY in res:
                    _count_truncated(st)
                if res:
                    merge_results(st.__dict__.setdefault("_xmix_new", {}), res)
                if err is not None:
                    # A worker could not serve this request: it ends here with an error (the
                    # OpenAI server answers 500 / an error event); the engine core drops it.
                    logger.warning(
                        "xmix: request %s finished with an error: %s", eco.request_id, err
                    )
                    st.__dict__["_xmix_error"] = str(err)
                    if eco.finish_reason is None:
                        failed.append(eco.request_id)
                    eco.finish_reason = FinishReason.ERROR
        out = orig_process(self, engine_core_outputs, *args, **kwargs)
        if failed:
            out.reqs_to_abort.extend(r for r in failed if r not in out.reqs_to_abort)
        return out

    def take_results(state) -> dict:
        # Results since the last output (DELTA) or all so far; steps that produced no output
        # (FINAL_ONLY, stream_interval) keep accumulating in _xmix_new until one does.
        from vllm.sampling_params import RequestOutputKind

        from .worker import merge_results

        new = state.__dict__.pop("_xmix_new", None)
        if state.output_kind == RequestOutputKind.DELTA:
            return new or {}
        acc = state.__dict__.setdefault("_xmix_all", {})
        if new:
            merge_results(acc, new)
        return copy_results(acc)

    # Only requests that ever carried reads get an ``.xmix`` attribute: outputs of an engine
    # without xmix (or of a request without reads) are vLLM's objects untouched, and
    # ``xmix.results`` reads a missing attribute as {}.
    def _new_completion_output(self, *args, **kwargs):
        co = orig_new_completion(self, *args, **kwargs)
        if self.__dict__.get("_xmix_seen"):
            co.xmix = take_results(self)
        mon = self.__dict__.get("_xmix_monitors")
        if mon and co.finish_reason is not None:
            # this sequence's stop and switches (with n > 1 each choice has its own)
            co.xmix_monitors = mon
        return co

    def make_request_output(self, *args, **kwargs):
        out = orig_make(self, *args, **kwargs)
        if out is None:
            return out
        # Provenance is set at admission, so a request xmix admitted carries it even when no
        # result ever came back (no apps, or apps without reads). It is built when this
        # state's sequence finishes, once (its ``changed`` covers the whole run); outputs
        # before that carry none (the server sends it in the chunk that finishes a choice).
        applied = self.__dict__.get("_xmix_applied")
        if applied is not None and (
            getattr(out, "finished", False)
            or any(
                getattr(c, "finish_reason", None) is not None
                for c in getattr(out, "outputs", None) or ()
            )
        ):
            prov = self.__dict__.get("_xmix_prov")
            if prov is None:
                prov = self.__dict__["_xmix_prov"] = {
                    **provenance(applied),
                    **self.__dict__.get("_xmix_monitors", {}),
                }
            out.xmix_applied = prov
        if not self.__dict__.get("_xmix_seen"):
            return out
        err = self.__dict__.get("_xmix_error")
        if err is not None:
            out.xmix_error = err
        outs = getattr(out, "outputs", None)
        if isinstance(outs, list) and outs:
            out.xmix = getattr(outs[0], XMIX_KEY, None) or {}
        else:  # pooling output: one per request
            out.xmix = take_results(self)
        return out

    def add(self, next_output, aggregate: bool) -> None:
        from .worker import merge_results

        before = {c.index: c for c in self.outputs} if aggregate else {}
        orig_add(self, next_output, aggregate)
        for nc in next_output.outputs:
            c = before.get(nc.index)
            nxt = getattr(nc, XMIX_KEY, None)
            if c is not None and c is not nc and nxt:  # vLLM merged nc into c in place
                c.xmix = merge_results(getattr(c, XMIX_KEY, None) or {}, nxt)
        if self.outputs and hasattr(self.outputs[0], XMIX_KEY):
            self.xmix = getattr(self.outputs[0], XMIX_KEY, None) or {}
        # When the consumer falls behind, vLLM's RequestOutputCollector merges the finishing
        # output into an earlier one: provenance and a worker's error come only with the
        # output that finishes, so they move over with it or the response loses them.
        for key in ("xmix_applied", "xmix_error"):
            val = getattr(next_output, key, None)
            if val is not None:
                setattr(self, key, val)

    fence.replace(out_cls, "process_outputs", process_outputs, by="frontend")
    fence.replace(state_cls, "from_new_request", classmethod(from_new_request), by="frontend")
    fence.replace(state_cls, "make_request_output", make_request_output, by="frontend")
    fence.replace(state_cls, "_new_completion_output", _new_completion_output, by="frontend")
    fence.replace(request_output_cls, "add", add, by="frontend")


def _remote_prefill(kv_transfer_params: Any) -> bool:
    """A request whose prompt KV another instance computed (what vLLM's own code reads:
    v1/engine/output_processor.py, v1/core/sched/scheduler.py)."""
    return isinstance(kv_transfer_params, dict) and bool(
        kv_transfer_params.get("do_remote_prefill")
    )


def provenance(applied: dict) -> dict:
    """What was applied to a request (``xmix_applied``): each app with its deployment version,
    how it applied ("request": named by it; "all": the deployment's mode) and the parameter
    values it ran with at admission, its tenant under a policy, and ``changed``: the apps
    whose mode, parameters or deployment changed while it ran (they took effect at a step
    boundary; docs/serving.md) or that came to apply to it."""
    out = {k: v for k, v in applied.items() if not k.startswith("_")}
    reg = _REGISTRIES.get(applied.get("_reg"))
    changed = set(reg.changed_since(applied)) if reg is not None else set()
    out["changed"] = sorted(changed | set(applied.get("_dropped", ())))
    return out


def _count_truncated(state) -> None:
    """One sequence cut at its byte cap, counted on the registry that admitted it."""
    reg = _REGISTRIES.get((state.__dict__.get("_xmix_applied") or {}).get("_reg"))
    if reg is not None:
        reg.count("results_truncated")


# ---------------------------------------------------------------------- control plane
def _load_app(app: App | str | Path | bytes, allow_custom: bool) -> App:
    if isinstance(app, App):
        return app
    if isinstance(app, (bytes, bytearray)):
        return App.from_bytes(bytes(app), allow_custom=allow_custom)
    return (
        App.load(app) if allow_custom else App.from_bytes(Path(app).read_bytes(), str(app), False)
    )


class Controller:
    """Deploy, switch and re-parameterise apps on a running engine (offline ``llm.xmix``).

    Every change is checked in full here first, then applied on every worker by collective
    RPCs, which vLLM's engine core runs between two steps: it takes effect at the next step
    boundary for requests in flight. A deploy is two-phase: every worker checks the app and
    builds its new tables aside (``xmix_deploy_prepare``); only when all accepted does each
    swap them in (``xmix_deploy_commit``), so a refusal leaves every worker as it was.
    Changes are serialised (one at a time).
    """

    def __init__(self, input_processor, rpc):
        """rpc(method, args) runs a worker method on every worker of every engine and returns
        their replies (the first engine's first worker first); xmix's methods are reached
        through ``xmix_call`` (``answered``)."""
        self._rpc = answered(rpc)
        cfg = input_processor.vllm_config.model_config
        self.registry = Registry(
            ModelShape.from_hf_config(cfg.hf_config, cfg.model), input_processor.tokenizer
        )
        self.lock = threading.RLock()
        input_processor._xmix_registry = self.registry
        # Pipeline parallel: refused here, before any RPC, because a worker raising in a
        # collective RPC under vLLM's batch queue left the engine core dead (pp.py).
        par = input_processor.vllm_config.parallel_config
        size = int(getattr(par, "pipeline_parallel_size", 1) or 1)
        self._stages = None
        if size > 1:
            from .pp import Stages

            self._stages = Stages.of(self.registry.shape.n_layers, 0, size)
        self.registry.sync = self.sync
        # The engine-side ledger (ledger.py) is the truth; this registry follows it.
        self.ledger_rev = 0
        self._keyed = False
        self._owner = f"{os.uname().nodename}:{os.getpid()}:{self.registry.uid}"
        self._mine: dict[tuple[str, int], tuple[App, LoweredApp, Needs]] = {}
        self._depth = 0  # nested changes (a restore) hold the lease once
        self.restored = False  # the ledger holds a restore from a state directory (restore.py)
        kv = getattr(input_processor.vllm_config, "kv_transfer_config", None)
        self.registry.kv_connector = getattr(kv, "kv_connector", None) if kv is not None else None

    def _capacity(self) -> None:
        if self.registry.capacity is None:
            caps = self._rpc("xmix_capacity", ())
            self.registry.capacity = {k: min(c[k] for c in caps) for k in caps[0]}

    # ------------------------------------------------------------------ the ledger
    def sync(self) -> int:
        """Bring the registry up to the engines' ledger: apply, in the ledger's order, every
        change made through any API server since the last sync. Returns the ledger revision."""
        with self.lock:
            t0 = time.monotonic()
            self._fetch_keys()
            got = self._rpc("xmix_ledger", ("since", self._owner, self.ledger_rev))[0]
            for e in got["entries"]:
                self._apply(e)
            self.ledger_rev = got["rev"]
            self.registry.synced_at = t0
            return self.ledger_rev

    def _fetch_keys(self) -> None:
        """The deployment's secret from the first worker of the first engine, once: every API
        server keys cache salts and fingerprints alike (keyed.py). A server syncs before it
        serves, so no request is salted with this process's own keys."""
        if not self._keyed:
            self.registry.keys = keyed.Keys(self._rpc("xmix_deployment_secret", ())[0])
            self._keyed = True

    def _apply(self, e: dict) -> None:
        reg, name, kind = self.registry, e["name"], e["kind"]
        if kind == "deploy":
            if e.get("data") is None or name in reg.apps:
                return  # undeployed later in the ledger (its bytes were dropped)
            mine = self._mine.pop((name, e["version"]), None)
            if mine is None:
                # Another server's deploy: the bytes passed every check there and on the
                # workers; they are lowered here against this server's model and tokenizer.
                app = App.from_bytes(e["data"], allow_custom=True)
                lowered = lower(app, reg.shape, reg.tokenizer)
                mine = (app, lowered, Needs.of(lowered))
            app, lowered, needs = mine
            # A change and its revision under one hold of the lock: an admission between the
            # two would see the change with the revision its pre-stream check saw, and refuse
            # inside a stream what it should leave out (``admit``'s ``gone_ok``).
            with reg.lock:
                reg.add(app, lowered, e["mode"], e["version"], needs, e.get("locked", False))
                reg._version = max(reg._version, e["version"])
                reg.changed("deploy", name)
        elif kind == "undeploy":
            with reg.lock:
                if name in reg.apps:
                    reg.remove(name)
                    reg.changed("undeploy", name)
        elif kind == "restore":
            # A restart from a state directory: start above every epoch and version the
            # directory's earlier runs reached (cache salts and versions are never reused).
            with reg.lock:
                reg.epoch = max(reg.epoch, int(e.get("epoch", 0)))
                reg._version = max(reg._version, int(e.get("version", 0)))
            self.restored = True
        elif kind == "patch":
            if name not in reg.apps:
                return
            mode, params, locked = e.get("mode"), e.get("params"), e.get("locked")
            with reg.lock:
                cols, lock = reg.check_patch(name, mode, params, locked)
                reg.patch(name, mode, cols, lock)
                if params is not None:
                    reg.changed("params", name)
                if mode is not None:
                    reg.changed("mode", name)
                if lock is not None:
                    reg.changed("locked")
        else:
            logger.warning("xmix: unknown ledger entry %r ignored", kind)

    def _save(self, entry: dict) -> None:
        """Write a change to the state directory, if there is one, before any engine applies
        it (state_dir.py): a change that is not written is not made."""
        try:
            self._rpc("xmix_ledger", ("save", self._owner, 0, entry))
        except WorkerError as e:
            raise NotSaved(f"the change was not made: {_root(e)}") from None

    def _forget(self, entry: dict) -> None:
        """A change written to the state directory that then failed on the way: write its
        undoing, so a restart does not bring back what the engines refused."""
        try:
            self._save(entry)
        except Exception:
            logger.exception("xmix: the state directory keeps a change that failed (%s)", entry)

    def _record(self, entry: dict) -> None:
        """Append a change that reached every engine to the ledger, then follow the ledger
        (the registry changes only from it, so every server applies the same order)."""
        self._rpc("xmix_ledger", ("append", self._owner, 0, entry))
        self.sync()
        self._await_followers(self.ledger_rev)

    def _await_followers(self, rev: int) -> None:
        """Return once every other API server has applied ledger revision ``rev`` (each says
        so at its next read, every XMIX_SYNC_S), or has not been heard from for ledger.LIVE_S
        (it then syncs before admitting anything: Registry.stale). Without other servers
        nothing waits."""
        from .ledger import LIVE_S

        deadline = time.monotonic() + LIVE_S + 1.0
        while self._rpc("xmix_ledger", ("lagging", self._owner, rev))[0]:
            if time.monotonic() > deadline:  # the ledger's clock expires them first
                logger.warning("xmix: API servers did not confirm change %d in time", rev)
                return
            time.sleep(0.02)

    @contextlib.contextmanager
    def _change(self, wait_s: float | None = None):
        """One control change at a time across every API server: the ledger's lease on the
        first worker of the first engine, then a sync, so the checks see every earlier change.
        Nested (the changes of a restore): the inner ones renew the lease, the outer releases it."""
        with self.lock:
            if wait_s is None:
                wait_s = float(settings.get("XMIX_LEASE_WAIT_S"))
            deadline = time.monotonic() + wait_s
            while not self._rpc("xmix_ledger", ("acquire", self._owner))[0]:
                if time.monotonic() > deadline:
                    raise EngineGone(
                        "another API server holds the control plane's lease (a "
                        "change in progress); try again"
                    )
                time.sleep(0.02)
            self._depth += 1
            try:
                self.sync()
                # every change takes the lease: while held, this registry is the latest state
                self.registry.held_until = time.monotonic() + LEASE_S - 10.0
                yield
            finally:
                self.registry.held_until = 0.0
                self._depth -= 1
                if self._depth == 0:
                    try:
                        self._rpc("xmix_ledger", ("release", self._owner))
                    except Exception:  # the lease lapses by itself (ledger.LEASE_S)
                        logger.warning(
                            "xmix: releasing the control-plane lease failed", exc_info=True
                        )

    @contextlib.contextmanager
    def _announced(self, name: str, mode_after: str | None):
        """The engines may apply the change as soon as its RPC is sent, and requests in flight
        can finish before the registry follows the ledger: the registry knows the change as
        pending from before the send until it has recorded it (provenance's ``changed``)."""
        self.registry.announce(name, mode_after)
        try:
            yield
        finally:
            self.registry.settle(name)

    def _undo(self, method: str, name: str, *args: Any) -> None:
        try:
            self._rpc(method, (name, *args))
        except EngineUnreachable as e:
            logger.warning("xmix: %s(%s) sent; %s", method, name, e)
        except EngineGone:
            logger.info("xmix: %s(%s) not needed: the engine is gone", method, name)
        except Exception:
            logger.exception("xmix: %s(%s) failed", method, name)

    def deploy(
        self,
        app: App | str | Path | bytes,
        mode: str = "request",
        *,
        allow_custom: bool = True,
        locked: Any = False,
        version: int | None = None,
    ) -> dict:
        """``locked``: true, or a list of parameter names, that requests may not override.
        ``version``: the deployment version to keep (a restore, restore.py); else the next."""
        if mode not in MODES:
            raise DeployError(f"mode must be one of {list(MODES)}, got {shown(mode)}")
        with self._change():
            self._capacity()
            app = _load_app(app, allow_custom)
            lowered, data, needs = self.registry.prepare(app)
            cols = param_columns(lowered)
            # checked first; the ledger and the state directory keep the names it resolved to
            lock_keys = sorted(
                cols[i].key for i in columns_named(cols, locked, f"app {app.name!r}")
            )
            if self._stages is not None:
                from .pp import check_deploy

                check_deploy(lowered, self._stages)
            self.registry.check_forced_write(app.name, lowered, mode)
            if version is None:
                version = self.registry.next_version()
            try:
                try:
                    self._rpc("xmix_deploy_prepare", (data, mode, version))
                except Exception as e:
                    if "is already deployed" not in _root(e):
                        raise
                    # A worker holds an app of this name that the ledger does not know
                    # (deployed behind the frontend's back, e.g. by vLLM's dev-mode
                    # /collective_rpc): nothing can use it, so it goes, and the deploy is retried.
                    self._undo("xmix_deploy_abort", app.name)
                    logger.warning(
                        "xmix: app %r was on a worker but not in the registry; "
                        "taken off before deploying it",
                        app.name,
                    )
                    self._rpc("xmix_undeploy_if_present", (app.name,))
                    self._rpc("xmix_deploy_prepare", (data, mode, version))
            except Exception as e:
                # One engine (or worker) refused: drop what the others prepared, everywhere.
                self._undo("xmix_deploy_abort", app.name)
                if isinstance(e, EngineGone):
                    raise
                raise _deploy_failed(app.name, e) from None
            entry = {
                "kind": "deploy",
                "name": app.name,
                "data": data,
                "mode": mode,
                "version": version,
                "locked": lock_keys,
            }
            try:
                self._save(entry)
            except Exception:
                self._undo("xmix_deploy_abort", app.name)
                raise
            with self._announced(app.name, mode):
                try:
                    self._rpc("xmix_deploy_commit", (app.name,))
                except Exception as e:  # a worker lost its prepared state: take it off everywhere
                    self._undo("xmix_undeploy_if_present", app.name)
                    self._forget({"kind": "undeploy", "name": app.name})
                    if isinstance(e, EngineGone):
                        raise
                    raise _deploy_failed(app.name, e) from None
                self._mine[(app.name, version)] = (app, lowered, needs)
                self._record(entry)
            return self.registry.get(app.name).describe()

    def undeploy(self, name: str) -> None:
        with self._change():
            self.registry.get(name)
            self._save({"kind": "undeploy", "name": name})
            with self._announced(name, None):
                # Where a worker no longer has it (taken off behind the frontend's back, e.g.
                # by vLLM's dev-mode /collective_rpc), there is nothing to take off: the
                # registry follows, instead of keeping an app no request can use and no
                # DELETE can remove.
                try:
                    gone = self._rpc("xmix_undeploy_if_present", (name,))
                except EngineUnreachable:
                    # Taken off every engine that answered, and on its way to the others
                    # (in order): it is recorded as gone, and the caller hears which engine
                    # did not answer. Undoing an undeploy would mean deploying it again.
                    self._record({"kind": "undeploy", "name": name})
                    raise
                if not all(gone):
                    logger.warning(
                        "xmix: app %r was already gone on %d of %d workers",
                        name,
                        sum(not g for g in gone),
                        len(gone),
                    )
                self._record({"kind": "undeploy", "name": name})

    def patch(
        self, name: str, mode: str | None = None, params: dict | None = None, locked: Any = None
    ) -> dict:
        """Mode, default parameters and/or the parameters locked against requests' overrides,
        as one change: everything is checked before anything is applied; a refusal changes
        nothing."""
        with self._change():
            d = self.registry.get(name)
            cols, lock = self.registry.check_patch(name, mode, params, locked)
            if mode is not None:
                self.registry.check_forced_write(name, d.lowered, mode)
            # The ledger and the state directory keep the names the values resolved to.
            named = {d.cols[i].key: v for i, v in cols.items()}
            entry = {
                "kind": "patch",
                "name": name,
                "mode": mode,
                "params": named if params is not None else None,
                "locked": sorted(d.cols[i].key for i in lock) if lock is not None else None,
            }
            before = {
                "kind": "patch",
                "name": name,
                "mode": d.mode,
                "params": d.defaults,
                "locked": sorted(d.cols[i].key for i in d.locked),
            }
            self._save(entry)
            if mode is not None or params is not None:
                after = mode if mode is not None else d.mode
                # what an engine that did not answer must be set back to, after the change
                undo = (d.mode if mode is not None else None, d.defaults if params else None)
                with self._announced(name, after):
                    try:
                        self._rpc("xmix_patch", (name, mode, params))
                    except Exception as e:
                        if isinstance(e, EngineUnreachable):
                            # applied where it was answered, on its way elsewhere: set the
                            # previous mode and defaults back everywhere, after it
                            self._undo("xmix_patch", name, *undo)
                        self._forget(before)
                        raise
                    self._record(entry)
            else:  # only which parameters are locked: nothing reaches the engines
                self._record(entry)
            return self.registry.get(name).describe()

    def set_mode(self, name: str, mode: str) -> None:
        self.patch(name, mode=mode)

    def set_params(self, name: str, params: dict) -> None:
        self.patch(name, params=params)

    def apps(self) -> list[dict]:
        self.sync()
        return self.registry.describe()

    def status(self) -> list[dict]:
        """What each worker reports (apps, sites placed, step counters)."""
        return self._rpc("xmix_describe", ())


def _deploy_failed(name: str, e: BaseException) -> DeployError:
    msg = _root(e)
    room = "not enough room" in msg or "apps are deployed already" in msg
    return (CapacityError if room else DeployError)(
        f"deploying app {name!r} failed on a worker: {msg}"
    )


def _root(e: BaseException) -> str:
    msg = str(e)
    for marker in ("DeployError: ", "AppError: ", "RuntimeError: "):
        if marker in msg:
            msg = msg.split(marker, 1)[1]
    return msg.strip().splitlines()[-1] if msg.strip() else type(e).__name__
