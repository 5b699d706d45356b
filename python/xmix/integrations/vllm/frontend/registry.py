"""The frontend's record of deployed apps (``Registry``): what is deployed, at which version
and mode, with which parameter defaults and locks, what each app takes of the engine's control
block (``Needs``), and the history of control changes that the provenance of requests in
flight is read from. It follows the engines' ledger (``follow``, entry by entry, as the
Controller reads them: controller.py) and is the source of truth for admission
(admission.py), which reads it and changes none of its apps."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from xmix import settings
from xmix.integrations.vllm import keyed, tenants
from xmix.integrations.vllm.errors import CapacityError, shown
from xmix.lang import program_codec
from xmix.lang.api import App
from xmix.lang.conditions import n_instructions
from xmix.lang.lowering import DeployError, LoweredApp, lower
from xmix.lang.results_codec import ResultOptions, position_bytes, read_shape
from xmix.lang.sites import ModelShape
from xmix.runtime.control import MODES, ParamCol, param_columns, resolve_params

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


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


_REGISTRIES: weakref.WeakValueDictionary[int, Registry] = weakref.WeakValueDictionary()
_REGISTRY_IDS = itertools.count(1)
HISTORY = 4096  # control changes remembered for the provenance of requests in flight


def registered(uid: Any) -> Registry | None:
    """The live registry of that ``uid`` (a request's provenance names the one that admitted
    it), None once it is gone."""
    return _REGISTRIES.get(uid)


class Registry:
    """The frontend's record of deployed apps; the source of truth for admission."""

    def __init__(self, shape: ModelShape, tokenizer=None):
        from xmix.integrations.vllm.frontend import metrics

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

    # ------------------------------------------------------------------ deploy side
    def used(self) -> Needs:
        total = Needs()
        for d in self.apps.values():
            total = total + d.needs
        return total

    def prepare(self, app: App) -> tuple[LoweredApp, bytes, Needs]:
        """Check an app against the model and the room left in the engine; return it
        lowered, its lowered program for the workers and the other API servers
        (program_codec: token sets resolved with this server's tokenizer, sites numbered
        for the model; none of them lowers it again), and its needs. Nothing is sent to a
        worker before this passed."""
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
            from xmix.runtime.control import K

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
        limits: dict[str, int] = cap or {}  # where() is asked only with limits

        def where(cap_key: str) -> str:
            if cap_key == "max_ops" and server_ops is not None and server_ops == limits["max_ops"]:
                return f"XMIX_MAX_OPS={server_ops}"
            return f"{cap_key}={limits[cap_key]}"

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
        lowered.digest = program_codec.app_digest(app)
        return lowered, program_codec.encode(lowered), needs

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

    # ------------------------------------------------------------------ the ledger
    def follow(self, e: dict, mine: dict[tuple[str, int], tuple[App, LoweredApp, Needs]]) -> None:
        """Apply one entry of the engines' ledger (ledger.py; the Controller reads them in
        order). ``mine``: the deploys this process checked and lowered itself, by name and
        version, taken from there instead of decoding their program."""
        name, kind = e["name"], e["kind"]
        if kind == "deploy":
            if e.get("program") is None or name in self.apps:
                return  # undeployed later in the ledger (its program was dropped)
            own = mine.pop((name, e["version"]), None)
            if own is None:
                # Another server's deploy: lowered there, checked there and on every
                # worker; decoded here (and checked again), not lowered.
                lowered = program_codec.decode(e["program"], self.shape, f"app {name!r}")
                own = (lowered.app, lowered, Needs.of(lowered))
            app, lowered, needs = own
            # A change and its revision under one hold of the lock: an admission between the
            # two would see the change with the revision its pre-stream check saw, and refuse
            # inside a stream what it should leave out (``admit``'s ``gone_ok``).
            with self.lock:
                self.add(app, lowered, e["mode"], e["version"], needs, e.get("locked", False))
                self._version = max(self._version, e["version"])
                self.changed("deploy", name)
        elif kind == "undeploy":
            with self.lock:
                if name in self.apps:
                    self.remove(name)
                    self.changed("undeploy", name)
        elif kind == "restore":
            # A restart from a state directory: start above every epoch and version the
            # directory's earlier runs reached (cache salts and versions are never reused).
            with self.lock:
                self.epoch = max(self.epoch, int(e.get("epoch", 0)))
                self._version = max(self._version, int(e.get("version", 0)))
        elif kind == "patch":
            if name not in self.apps:
                return
            mode, params, locked = e.get("mode"), e.get("params"), e.get("locked")
            with self.lock:
                cols, lock = self.check_patch(name, mode, params, locked)
                self.patch(name, mode, cols, lock)
                if params is not None:
                    self.changed("params", name)
                if mode is not None:
                    self.changed("mode", name)
                if lock is not None:
                    self.changed("locked")
        else:
            logger.warning("xmix: unknown ledger entry %r ignored", kind)

    # ------------------------------------------------------------------ what requests see
    def count(self, name: str, n: float = 1, **labels) -> None:
        if self.metrics:
            from xmix.integrations.vllm.frontend.metrics import shown as shown_labels

            self.metrics[name].labels(model_name=self.shape.model_name, **shown_labels(labels)).inc(
                n
            )

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
