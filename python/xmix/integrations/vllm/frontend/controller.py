"""The control plane in the frontend (``Controller``: offline ``llm.xmix``, and the server's
control routes): deploy, switch and re-parameterise apps on a running engine, one change at a
time across every API server, following the engines' ledger (ledger.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from xmix import settings
from xmix.integrations.vllm import keyed
from xmix.integrations.vllm.errors import (
    CapacityError,
    EngineGone,
    EngineUnreachable,
    NotSaved,
    WorkerError,
    answered,
    shown,
)
from xmix.integrations.vllm.frontend import admission
from xmix.integrations.vllm.frontend.registry import Needs, Registry, columns_named
from xmix.integrations.vllm.worker.ledger import LEASE_S
from xmix.lang.api import App
from xmix.lang.lowering import DeployError, LoweredApp
from xmix.lang.sites import ModelShape
from xmix.runtime.control import MODES, param_columns

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply


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
            from xmix.integrations.vllm.worker.pp import Stages

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
        change made through any API server since the last sync. Returns the ledger revision.

        While a change through this server holds the lease, another thread's sync reads the
        registry as it is instead of waiting for the change: no other server can have changed
        anything since the change's own sync, and the change itself is announced as pending
        (``_announced``). Waiting would hold an app list, or a request naming an app this
        server does not know, for as long as the change waits for an engine, up to
        XMIX_RPC_TIMEOUT_S when a host is out of reach."""
        if not self.lock.acquire(blocking=False):
            if time.monotonic() < self.registry.held_until:
                return self.ledger_rev
            self.lock.acquire()  # a change still taking the lease, or another sync
        try:
            t0 = time.monotonic()
            self._fetch_keys()
            got = self._rpc("xmix_ledger", ("since", self._owner, self.ledger_rev))[0]
            for e in got["entries"]:
                self.registry.follow(e, self._mine)
                if e["kind"] == "restore":
                    self.restored = True
            self.ledger_rev = got["rev"]
            self.registry.synced_at = t0
            return self.ledger_rev
        finally:
            self.lock.release()

    def _fetch_keys(self) -> None:
        """The deployment's secret from the first worker of the first engine, once: every API
        server keys cache salts and fingerprints alike (keyed.py). A server syncs before it
        serves, so no request is salted with this process's own keys."""
        if not self._keyed:
            self.registry.keys = keyed.Keys(self._rpc("xmix_deployment_secret", ())[0])
            self._keyed = True

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
        from xmix.integrations.vllm.worker.ledger import LIVE_S

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
            lowered, program, needs = self.registry.prepare(app)
            cols = param_columns(lowered)
            # checked first; the ledger and the state directory keep the names it resolved to
            lock_keys = sorted(
                cols[i].key for i in columns_named(cols, locked, f"app {app.name!r}")
            )
            if self._stages is not None:
                from xmix.integrations.vllm.worker.pp import check_deploy

                check_deploy(lowered, self._stages)
            admission.check_forced_write(self.registry, app.name, lowered, mode)
            if version is None:
                version = self.registry.next_version()
            try:
                try:
                    self._rpc("xmix_deploy_prepare", (program, mode, version))
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
                    self._rpc("xmix_deploy_prepare", (program, mode, version))
            except Exception as e:
                # One engine (or worker) refused: drop what the others prepared, everywhere.
                self._undo("xmix_deploy_abort", app.name)
                if isinstance(e, EngineGone):
                    raise
                raise _deploy_failed(app.name, e) from None
            entry = {
                "kind": "deploy",
                "name": app.name,
                "program": program,
                "mode": mode,
                "version": version,
                "locked": lock_keys,
            }
            try:
                # the state directory keeps the app as given (its source of truth for an
                # operator; a restore lowers it again): state_dir.py
                self._save({**entry, "program": None, "data": app.to_bytes()})
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
                admission.check_forced_write(self.registry, name, d.lowered, mode)
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
