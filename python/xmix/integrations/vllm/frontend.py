"""xmix in the vLLM frontend process (LLM / AsyncLLM): the app registry, admission of each
request's xmix control, prefix-cache isolation, and read results on RequestOutput.

Per request, in ``InputProcessor.process_inputs`` (before the request reaches the engine):
  - the request's ``extra_args["xmix"]`` (a dict offline, a JSON string from ``vllm_xargs``)
    is checked against the deployed apps and replaced by a canonical dict on the request's
    own copy of its SamplingParams (the caller's object is never changed, so reusing one
    SamplingParams for many calls keeps working);
  - requests whose apps write get a ``cache_salt`` derived from the write configuration, so
    their prompt KV is never shared with requests of another configuration;
  - requests whose apps read, or keep per-request state over the prompt, skip reading the
    prefix cache, so every prompt token is computed and read.

Results come back per step inside ``EngineCoreOutput.kv_transfer_params["xmix"]`` (set by
the engine core, engine_core.py); ``OutputProcessor.process_outputs`` takes them out before
vLLM sees them and attaches them as ``.xmix`` to each sequence's ``CompletionOutput`` and to
the ``RequestOutput`` (the reads of its first sequence).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmix.api import App, AppError
from xmix.control import MODES, RequestError, param_columns, resolve_params
from xmix.hooks import ModelShape
from xmix.lowering import DeployError, LoweredApp, lower

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply

XMIX_KEY = "xmix"
REQUEST_KEYS = {"apps", "params"}


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
    return _ERROR_CLASS(f"xmix: {msg}", parameter="vllm_xargs.xmix", value=value)


@dataclass
class Deployed:
    app: App
    lowered: LoweredApp
    mode: str
    version: int
    defaults: dict[str, float] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        lw = self.lowered
        return {"name": self.app.name, "mode": self.mode, "sites": lw.sites,
                "reads": sorted(lw.reads), "writes": lw.writes, "stateful": lw.stateful,
                "params": dict(self.defaults), "version": self.version,
                "metadata": self.app.metadata}


class Registry:
    """The frontend's record of deployed apps; the source of truth for admission."""

    def __init__(self, shape: ModelShape, tokenizer=None):
        from . import metrics

        self.metrics = metrics.get()
        self.shape = shape
        self.tokenizer = tokenizer
        self.apps: dict[str, Deployed] = {}
        self.lock = threading.RLock()
        self._version = 0

    # ------------------------------------------------------------------ deploy side
    def prepare(self, app: App) -> tuple[LoweredApp, bytes]:
        """Check an app against the model; return it lowered, and its bytes for the workers
        with token sets resolved to ids (workers have no tokenizer)."""
        with self.lock:
            if app.name in self.apps:
                raise DeployError(f"app {app.name!r} is already deployed")
        lowered = lower(app, self.shape, self.tokenizer)
        spec = app.spec()
        spec["token_sets"] = [{"name": n, "ids": ids} for n, ids in lowered.token_sets.items()]
        resolved = App.from_spec(spec, app.tensors(), source=f"app {app.name!r}", allow_custom=True)
        return lowered, resolved.to_bytes()

    def changed(self, kind: str) -> None:
        self.count("changes", kind=kind)
        if self.metrics:
            self.metrics["deployed"].labels(model_name=self.shape.model_name).set(len(self.apps))

    def add(self, app: App, lowered: LoweredApp, mode: str) -> Deployed:
        with self.lock:
            self._version += 1
            cols = param_columns(lowered)
            d = Deployed(app, lowered, mode, self._version,
                         {c.key: c.default for c in cols if c.public})
            d._cols = cols  # type: ignore[attr-defined]
            self.apps[app.name] = d
            return d

    def remove(self, name: str) -> None:
        with self.lock:
            self.apps.pop(name, None)

    def get(self, name: str) -> Deployed:
        d = self.apps.get(name)
        if d is None:
            raise DeployError(f"app {name!r} is not deployed; deployed: {sorted(self.apps)}")
        return d

    def check_params(self, name: str, params: Any) -> dict[str, float]:
        d = self.get(name)
        cols = d._cols  # type: ignore[attr-defined]
        hits = resolve_params(cols, params, f"app {name!r}")
        return {cols[i].key: v for i, v in hits.items()}

    def describe(self) -> list[dict]:
        with self.lock:
            return [d.describe() for d in sorted(self.apps.values(), key=lambda d: d.version)]

    # ------------------------------------------------------------------ request side
    def count(self, name: str, n: float = 1, **labels) -> None:
        if self.metrics:
            self.metrics[name].labels(model_name=self.shape.model_name, **labels).inc(n)

    def admit(self, raw: Any) -> tuple[dict | None, str | None, bool]:
        """(canonical control, cache-salt suffix, skip prefix-cache reads) for one request."""
        with self.lock:
            try:
                cfg = self._parse(raw)
            except ValueError:
                self.count("rejected")
                raise
            if cfg and cfg["apps"]:
                self.count("requests")
                for a in cfg["apps"]:
                    self.count("app_requests", app=a)
            apps = cfg["apps"] if cfg else []
            effective = [self.apps[a] for a in apps] + [
                d for n, d in self.apps.items() if d.mode == "all" and n not in apps]
            if not effective:
                return cfg, None, False
            writes = [d for d in effective if d.lowered.writes]
            salt = None
            if writes:
                key = [(d.app.name, d.version, sorted((cfg or {}).get("params", {}).get(d.app.name, {}).items()))
                       for d in sorted(writes, key=lambda d: d.app.name)]
                salt = "xmix:" + hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]
            skip = any(d.lowered.reads_prompt or d.lowered.stateful for d in effective)
            return cfg, salt, skip

    def _parse(self, raw: Any) -> dict | None:
        if raw is None:
            return None
        if isinstance(raw, (str, bytes)):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise _validation_error(f"the xmix control is not valid JSON ({e.msg} at "
                                        f"position {e.pos})", raw)
        if not isinstance(raw, dict):
            raise _validation_error(f"the xmix control must be an object like "
                                    f'{{"apps": [...], "params": {{...}}}}, got {type(raw).__name__}')
        unknown = set(raw) - REQUEST_KEYS
        if unknown:
            raise _validation_error(f"unknown key(s) {sorted(unknown)} in the xmix control; "
                                    f"allowed: {sorted(REQUEST_KEYS)}")
        apps = raw.get("apps", [])
        if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
            raise _validation_error(f'"apps" must be a list of app names, got {apps!r}')
        if len(set(apps)) != len(apps):
            raise _validation_error(f'"apps" lists an app twice: {apps!r}')
        for a in apps:
            if a not in self.apps:
                raise _validation_error(f"unknown app {a!r}; deployed: {sorted(self.apps)}")
            if self.apps[a].mode == "off":
                raise _validation_error(f"app {a!r} is deployed but switched off")
        params = raw.get("params", {})
        if not isinstance(params, dict):
            raise _validation_error(f'"params" must be an object {{app: {{name: number}}}}, got {params!r}')
        canon: dict[str, dict[str, float]] = {}
        for a, p in params.items():
            if a not in self.apps:
                raise _validation_error(f"params for unknown app {a!r}; deployed: {sorted(self.apps)}")
            if a not in apps and self.apps[a].mode != "all":
                raise _validation_error(f"params for app {a!r}, which this request does not use")
            try:
                self.check_params(a, p)
            except (RequestError, DeployError) as e:
                raise _validation_error(str(e), p) from None
            canon[a] = {k: float(v) for k, v in p.items()}
        return {"apps": list(apps), "params": canon}


# ---------------------------------------------------------------------- patches
def patch_input_processor(cls) -> None:
    if getattr(cls, "_xmix_patched", False):
        return
    orig = cls.process_inputs

    def process_inputs(self, *args, **kwargs):
        req = orig(self, *args, **kwargs)
        reg: Registry | None = getattr(self, "_xmix_registry", None)
        sp = getattr(req, "sampling_params", None)
        if sp is None:
            return req
        raw = (sp.extra_args or {}).get(XMIX_KEY)
        if reg is None:
            if raw is not None:
                raise _validation_error("this request asks for xmix apps, but xmix is not enabled "
                                        "on this engine (use xmix.LLM / xmix serve)")
            return req
        cfg, salt, skip = reg.admit(raw)
        if cfg is not None:
            # A new dict on the request's own copy: the caller's SamplingParams stays as given.
            sp.extra_args = {**(sp.extra_args or {}), XMIX_KEY: cfg}
        if salt is not None:
            req.cache_salt = f"{req.cache_salt}|{salt}" if req.cache_salt else salt
        if skip:
            sp.skip_reading_prefix_cache = True
        return req

    cls.process_inputs = process_inputs
    cls._xmix_patched = True


def patch_output_processor(out_cls, state_cls, request_output_cls) -> None:
    """Results live on each CompletionOutput (``.xmix``: one sequence's reads, so ``n > 1``
    keeps its sequences apart) and on the RequestOutput (``.xmix``: those of ``outputs[0]``,
    the only sequence when ``n == 1``)."""
    if getattr(out_cls, "_xmix_patched", False):
        return
    orig_process = out_cls.process_outputs
    orig_make = state_cls.make_request_output
    orig_new_completion = state_cls._new_completion_output
    orig_add = request_output_cls.add

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        from .worker import merge_results

        for eco in engine_core_outputs:
            kvp = eco.kv_transfer_params
            if kvp and XMIX_KEY in kvp:
                kvp = dict(kvp)
                res = kvp.pop(XMIX_KEY)
                eco.kv_transfer_params = kvp or None
                st = self.request_states.get(eco.request_id)
                if st is not None:
                    merge_results(st.__dict__.setdefault("_xmix_new", {}), res)
        return orig_process(self, engine_core_outputs, *args, **kwargs)

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
        return copy.deepcopy(acc)

    def _new_completion_output(self, *args, **kwargs):
        co = orig_new_completion(self, *args, **kwargs)
        co.xmix = take_results(self)
        return co

    def make_request_output(self, *args, **kwargs):
        out = orig_make(self, *args, **kwargs)
        if out is None:
            return out
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
        if self.outputs:
            self.xmix = getattr(self.outputs[0], XMIX_KEY, None) or {}

    out_cls.process_outputs = process_outputs
    state_cls.make_request_output = make_request_output
    state_cls._new_completion_output = _new_completion_output
    request_output_cls.add = add
    out_cls._xmix_patched = True


def results(output) -> dict:
    """Read results: {app: {read: {"positions": [...], "values": [...]}}}. ``output`` is a
    RequestOutput (its first sequence) or one CompletionOutput (that sequence, for n > 1)."""
    return getattr(output, "xmix", None) or {}


# ---------------------------------------------------------------------- control plane
def _load_app(app: App | str | Path | bytes, allow_custom: bool) -> App:
    if isinstance(app, App):
        return app
    if isinstance(app, (bytes, bytearray)):
        return App.from_bytes(bytes(app), allow_custom=allow_custom)
    return App.load(app) if allow_custom else App.from_bytes(Path(app).read_bytes(), str(app), False)


class Controller:
    """Deploy, switch and re-parameterise apps on a running engine (offline ``llm.xmix``).

    Each change is applied on every worker by a collective RPC, which vLLM's engine core runs
    between two steps: it takes effect at the next step boundary for requests in flight.
    """

    def __init__(self, input_processor, rpc):
        """rpc(method, args) runs a worker method on every worker and returns their results."""
        self._rpc = rpc
        cfg = input_processor.vllm_config.model_config
        self.registry = Registry(ModelShape.from_hf_config(cfg.hf_config, cfg.model),
                                 input_processor.tokenizer)
        input_processor._xmix_registry = self.registry

    def deploy(self, app: App | str | Path | bytes, mode: str = "request", *,
               allow_custom: bool = True) -> dict:
        if mode not in MODES:
            raise DeployError(f"mode must be one of {list(MODES)}, got {mode!r}")
        app = _load_app(app, allow_custom)
        lowered, data = self.registry.prepare(app)
        try:
            self._rpc("xmix_deploy", (data, mode))
        except Exception as e:
            # Nothing half-deployed: take it off every worker that has it.
            try:
                self._rpc("xmix_undeploy_if_present", (app.name,))
            except Exception:  # pragma: no cover - the engine is gone
                logger.exception("xmix: rollback of %s failed", app.name)
            raise DeployError(f"deploying app {app.name!r} failed on a worker: {_root(e)}") from None
        info = self.registry.add(app, lowered, mode).describe()
        self.registry.changed("deploy")
        return info

    def undeploy(self, name: str) -> None:
        self.registry.get(name)
        self._rpc("xmix_undeploy", (name,))
        self.registry.remove(name)
        self.registry.changed("undeploy")

    def set_mode(self, name: str, mode: str) -> None:
        d = self.registry.get(name)
        if mode not in MODES:
            raise DeployError(f"mode must be one of {list(MODES)}, got {mode!r}")
        self._rpc("xmix_set_mode", (name, mode))
        d.mode = mode
        self.registry.changed("mode")

    def set_params(self, name: str, params: dict) -> None:
        d = self.registry.get(name)
        new = self.registry.check_params(name, params)
        self._rpc("xmix_set_params", (name, params))
        d.defaults.update(new)
        self.registry.changed("params")

    def apps(self) -> list[dict]:
        return self.registry.describe()

    def status(self) -> list[dict]:
        """What each worker reports (apps, sites placed, step counters)."""
        return self._rpc("xmix_describe", ())


def _root(e: BaseException) -> str:
    msg = str(e)
    for marker in ("DeployError: ", "AppError: ", "RuntimeError: "):
        if marker in msg:
            msg = msg.split(marker, 1)[1]
    return msg.strip().splitlines()[-1] if msg.strip() else type(e).__name__
