"""The public app API: declare reads, writes and conditional writes at the hook surface.

    app = xmix.App("guarded_steer")
    app.read("probe", weight=w, bias=0.0).layers([18]).at("residual.post").named("p18")
    app.write("add", vector=v, scale=4.0).layers([22]).at("attention.post") \\
       .cond(when="token_in(trigger)", gate="p18 >= 0")
    app.token_set("trigger", strings=["\\n\\n"])
    app.save("guarded_steer.xmix"); xmix.App.load("guarded_steer.xmix")

An app is a description; nothing runs until it is deployed against a model
(``xmix.lang.lowering.lower``), which checks it against the model and turns it into site programs.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from xmix.lang import conditions, deploy_work
from xmix.lang.catalog import FLT_MAX, KERNELS, MAX_SAE_FEATURES, MAX_TOP_K, SAE_KERNELS
from xmix.lang.sites import SITE_NAMES

if TYPE_CHECKING:
    from xmix.lang.sae import SAE

FORMAT = "xmix.app/1"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class AppError(ValueError):
    """An app that cannot be built, saved, loaded or deployed; the message names the place."""


class LimitError(AppError):
    """An app over a configured size limit (ops, artifact bytes, capacity of the engine)."""


MAX_JSON_DEPTH = 32  # nesting of metadata objects and lists
SHOWN = reprlib.Repr()
SHOWN.maxstring, SHOWN.maxother, SHOWN.maxlevel, SHOWN.maxlist = 60, 60, 2, 6


def check_json_value(value: Any, what: str, depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse what strict JSON cannot carry or a listing could not encode: NaN/Inf, keys
    that are not strings, objects other than dict/list/str/number/bool/None, nesting
    deeper than ``depth`` (checked without recursion)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > depth:
            raise AppError(f"{what} is nested more than {depth} levels deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise AppError(f"{what}: key {k!r} is not a string")
                stack.append((x, d + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise AppError(f"{what} contains {v!r}, which JSON cannot carry")
        elif v is not None and not isinstance(v, (str, int, bool)):
            raise AppError(f"{what} contains a {type(v).__name__}, which JSON cannot carry")


def _check_name(kind: str, name: Any, pattern: re.Pattern[str] = _NAME) -> str:
    if not isinstance(name, str) or not pattern.match(name):
        raise AppError(
            f"{kind} name {SHOWN.repr(name)} is not valid (letters, digits, '_' ; at most 64)"
        )
    return name


@dataclass
class TokenSet:
    name: str
    ids: list[int] | None = None  # token ids
    strings: list[str] | None = None  # strings that must each be exactly one token
    contains: list[str] | None = None  # every vocab token whose text contains one of these

    def to_json(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in (
                ("name", self.name),
                ("ids", self.ids),
                ("strings", self.strings),
                ("contains", self.contains),
            )
            if v is not None
        }


@dataclass
class CustomKernel:
    """A user kernel with the xmix_custom_args ABI. Only loadable from local files."""

    primitive: str  # "read" or "write"
    cpu_library: str | None = None  # shared library exporting cpu_symbol
    cpu_symbol: str | None = None
    cuda_source: str | None = None  # CUDA C++ compiled with nvcc at deploy
    cuda_fatbin: str | None = None  # or a prebuilt fatbin / cubin file
    cuda_symbol: str | None = None
    params: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class Op:
    """One read or write of an app; the builder methods return the op for chaining."""

    def __init__(
        self,
        app: App,
        primitive: str,
        kernel: str,
        artifacts: dict[str, torch.Tensor],
        params: dict[str, float],
        options: dict[str, Any],
        custom: CustomKernel | None,
    ):
        self.app = app
        self.primitive = primitive
        self.kernel = kernel
        self.artifacts = artifacts
        self.params = params
        self.options = options
        self.custom = custom
        self.layer_spec: Any = None
        self.site: str | None = None
        self.name: str | None = None
        self.cond_expr: str | None = None
        self.cond_when: str | None = None
        self.cond_gate: str | None = None
        self.sae: SAE | None = None  # xmix.SAE of an SAE kernel (shared within the app)

    # -- builder ---------------------------------------------------------------------------
    def layers(self, layers: Any) -> Op:
        if isinstance(layers, str):
            if layers != "all":
                raise AppError(
                    f"app {self.app.name!r}, op {self.label}: layers must be a list, "
                    f"a range or 'all', got {layers!r}"
                )
            self.layer_spec = "all"
        elif isinstance(layers, int) and not isinstance(layers, bool):
            self.layer_spec = [layers]
        else:
            try:
                lst = list(layers)
            except TypeError:
                raise AppError(
                    f"app {self.app.name!r}, op {self.label}: layers must be a list, "
                    f"a range or 'all', got {layers!r}"
                ) from None
            if not lst or not all(isinstance(l, int) and not isinstance(l, bool) for l in lst):
                raise AppError(
                    f"app {self.app.name!r}, op {self.label}: layers must be a "
                    f"non-empty list of ints, got {layers!r}"
                )
            if len(set(lst)) != len(lst):
                raise AppError(
                    f"app {self.app.name!r}, op {self.label}: layer listed twice in {lst}"
                )
            self.layer_spec = lst
        return self

    def at(self, site: str) -> Op:
        """Place the op at hook site ``site`` of each of its layers: "residual.pre",
        "attention.post", "residual.mid", "router.logits", "mlp.post", "residual.post" (per
        layer, in forward order) or "final.post" (after the final norm; no layers).
        Raises AppError for a name outside the hook surface."""
        if site not in SITE_NAMES:
            raise AppError(
                f"app {self.app.name!r}, op {self.label}: unknown site {site!r}; "
                f"the hook surface is {', '.join(SITE_NAMES)}"
            )
        self.site = site
        return self

    def submodule(self, site: str) -> Op:
        """Deprecated: ``at(site)``. The name of the xMIx paper and of xmix's first releases,
        kept so that their apps run; it warns (DeprecationWarning) and places the op at the
        same site. Inside xmix a hook site is a *site* only."""
        warnings.warn(
            "Op.submodule(site) is deprecated; use Op.at(site), which places the op at the "
            "same hook site",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.at(site)

    def named(self, name: str) -> Op:
        _check_name(f"app {self.app.name!r}: op", name, OP_NAME)
        if name in conditions.RESERVED:
            raise AppError(
                f"app {self.app.name!r}: op name {name!r} is a word of the condition "
                f"language; a gate could not refer to it"
            )
        for other in self.app.ops:
            if other is not self and other.name == name:
                raise AppError(f"app {self.app.name!r}: two ops are named {name!r}")
        self.name = name
        return self

    def cond(
        self, expr: str | None = None, *, when: str | None = None, gate: str | None = None
    ) -> Op:
        try:
            conditions.combine(expr, when, gate)
        except conditions.ConditionError as e:
            raise AppError(f"app {self.app.name!r}, op {self.label}: {e}") from None
        self.cond_expr, self.cond_when, self.cond_gate = expr, when, gate
        return self

    # -- helpers ---------------------------------------------------------------------------
    @property
    def label(self) -> str:
        idx = self.app.ops.index(self) if self in self.app.ops else len(self.app.ops)
        return repr(self.name) if self.name else f"#{idx} ({self.primitive} {self.kernel!r})"

    @property
    def result_name(self) -> str:
        return self.name or self.kernel

    def condition(self) -> conditions.Node | None:
        return conditions.combine(self.cond_expr, self.cond_when, self.cond_gate)

    def to_json(self, index: int, keys: dict[int, str] | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "primitive": self.primitive,
            "kernel": self.kernel,
            "site": self.site,
            "layers": self.layer_spec,
            "params": self.params,
            "artifacts": {
                k: (keys or {}).get(id(t), f"op{index}.{k}") for k, t in self.artifacts.items()
            },
        }
        if self.name:
            d["name"] = self.name
        if self.options:
            d["options"] = self.options
        if self.sae is not None:
            d["sae"] = self.app._sae_key(self.sae)
        if self.custom:
            d["custom"] = self.custom.to_json()
        cond = {
            k: v
            for k, v in (
                ("expr", self.cond_expr),
                ("when", self.cond_when),
                ("gate", self.cond_gate),
            )
            if v is not None
        }
        if cond:
            d["cond"] = cond
        return d


def _as_artifact(app: str, what: str, name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
    else:
        try:
            t = torch.as_tensor(value)
        except Exception:
            raise AppError(f"app {app!r}, {what}: artifact {name!r} is not a tensor") from None
    if t.dtype == torch.bool or not (
        t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)
    ):
        raise AppError(
            f"app {app!r}, {what}: artifact {name!r} has dtype {t.dtype}; expected a float tensor"
        )
    # A private copy: the app must not change when the caller's tensor does, and safetensors
    # refuses to save two artifacts that share memory.
    return t.contiguous().clone()


def _as_param(app: str, what: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AppError(f"app {app!r}, {what}: parameter {name!r} must be a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:
        raise AppError(
            f"app {app!r}, {what}: parameter {name!r} is too large for a float"
        ) from None
    if math.isnan(v):
        raise AppError(f"app {app!r}, {what}: parameter {name!r} is NaN")
    # Kernels see parameters in fp32: beyond FLT_MAX a value is Inf there (and JSON has no Inf).
    if not -FLT_MAX <= v <= FLT_MAX:
        raise AppError(f"app {app!r}, {what}: parameter {name!r}={v!r} is outside the fp32 range")
    return v


class App:
    """A named MI app: reads, writes and conditional writes, with their artifacts."""

    def __init__(self, name: str, *, metadata: dict[str, Any] | None = None):
        self.name = _check_name("app", name)
        self.ops: list[Op] = []
        self.token_sets: dict[str, TokenSet] = {}
        self.app_params: dict[str, float] = {}
        if not isinstance(metadata or {}, dict):
            raise AppError(
                f"app {name!r}: metadata must be an object, got {type(metadata).__name__}"
            )
        self.metadata: dict[str, Any] = dict(metadata or {})
        # Listed over HTTP as strict JSON: refuse here what could not be listed there.
        check_json_value(self.metadata, f"app {name!r}: metadata")
        # One private copy per distinct source tensor: ops that name the same artifact
        # (a file whose ops share a tensor key) share it instead of each holding a copy.
        self._copies: dict[int, tuple[Any, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"App({self.name!r}, {len(self.ops)} ops)"

    def _op(self, primitive: str, kernel: str, kwargs: dict[str, Any]) -> Op:
        what = f"{primitive}({kernel!r})"
        if kernel not in KERNELS:
            raise AppError(
                f"app {self.name!r}, {what}: unknown kernel {kernel!r}; built-in "
                f"kernels are {', '.join(sorted(KERNELS))}"
            )
        spec = KERNELS[kernel]
        if kernel == "since":
            raise AppError(
                f"app {self.name!r}, {what}: since is a condition, not an op: write "
                f"since(...) in a .cond(...) or app.stop(when=...)"
            )
        if spec.primitive == "control" and primitive != "control":
            raise AppError(
                f"app {self.name!r}, {what}: {kernel!r} is not a {primitive}; use "
                f"app.{kernel}(when=...)"
            )
        if spec.primitive not in (primitive, "either"):
            raise AppError(f"app {self.name!r}, {what}: {kernel!r} is a {spec.primitive} kernel")
        if kernel == "stop" and any(o.kernel == "stop" for o in self.ops):
            raise AppError(
                f"app {self.name!r}: one stop condition per app; combine conditions with "
                f"'or' (app.stop(when=\"a or b\"))"
            )
        kwargs = dict(kwargs)
        custom = None
        artifacts: dict[str, torch.Tensor] = {}
        params: dict[str, float] = {}
        options: dict[str, Any] = {}
        sae = None
        if kernel in SAE_KERNELS:
            sae = _sae_options(self.name, what, kernel, kwargs, options)
        if kernel == "custom":
            custom = CustomKernel(
                primitive=primitive,
                **{
                    k: kwargs.pop(k)
                    for k in list(kwargs)
                    if k
                    in ("cpu_library", "cpu_symbol", "cuda_source", "cuda_fatbin", "cuda_symbol")
                },
            )
            if "artifact" in kwargs:
                artifacts["artifact"] = self._artifact(what, "artifact", kwargs.pop("artifact"))
            for k, v in dict(kwargs.pop("params", {}) or {}).items():
                params[k] = _as_param(self.name, what, k, v)
            custom.params = dict(params)
        else:
            for a in spec.artifacts:
                if a not in kwargs:
                    raise AppError(
                        f"app {self.name!r}, {what}: missing artifact {a!r} ({spec.artifacts[a]})"
                    )
                artifacts[a] = self._artifact(what, a, kwargs.pop(a))
            for p, pspec in spec.params.items():
                if p in kwargs:
                    v = kwargs.pop(p)
                    params[p] = pspec.default if v is None else _as_param(self.name, what, p, v)
            if kernel == "capture" and "dims" in kwargs:
                dims = kwargs.pop("dims")
                if dims is not None:
                    if (
                        not isinstance(dims, (list, tuple))
                        or len(dims) != 2
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in dims)
                        or not 0 <= dims[0] < dims[1]
                    ):
                        raise AppError(
                            f"app {self.name!r}, {what}: dims must be (start, stop) "
                            f"with 0 <= start < stop, got {dims!r}"
                        )
                    options["dims"] = [int(dims[0]), int(dims[1])]
        if kwargs:
            raise AppError(
                f"app {self.name!r}, {what}: unknown argument(s) {', '.join(sorted(kwargs))}; "
                f"{kernel!r} takes artifacts {list(spec.artifacts)} and params "
                f"{list(spec.params)}"
            )
        op = Op(self, primitive, kernel, artifacts, params, options, custom)
        self.ops.append(op)
        if sae is not None:
            op.sae = sae
            if sae.hook is not None:  # where the SAE was trained; .layers/.at override
                from xmix.lang.sae import parse_hook

                site, layer = parse_hook(sae.hook)
                op.site = site
                op.layer_spec = [layer] if layer is not None else None
        return op

    def _sae_key(self, sae: SAE) -> str:
        """The SAE's name in the app file: one entry per distinct SAE object."""
        for i, s in enumerate(self._saes()):
            if s is sae:
                return f"sae{i}"
        raise AppError(f"app {self.name!r}: SAE {sae!r} is not used by any op")

    def _saes(self) -> list[SAE]:
        out: list[SAE] = []
        for op in self.ops:
            if op.sae is not None and not any(op.sae is s for s in out):
                out.append(op.sae)
        return out

    def _artifact(self, what: str, name: str, value: Any) -> torch.Tensor:
        hit = self._copies.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        t = _as_artifact(self.name, what, name, value)
        self._copies[id(value)] = (value, t)  # the source is kept, so its id stays unique
        return t

    def read(self, kernel: str, **kwargs: Any) -> Op:
        """Read the activation at a site: probe, capture, cosine, distance, sae (or custom)."""
        return self._op("read", kernel, kwargs)

    def write(self, kernel: str, **kwargs: Any) -> Op:
        """Change the activation at a site: add, ablate, affine, clamp, router, sae_steer,
        sae_clamp (or custom)."""
        return self._op("write", kernel, kwargs)

    def stop(self, when: str) -> Op:
        """End a request at the first token where ``when`` holds: a read at position t is
        computed while the model reads token t, so the request ends with token t and nothing
        sampled after it is emitted (a trigger in the prompt: no token at all). The response
        finishes with ``finish_reason "stop"`` and names the trigger in its provenance
        (``xmix_applied.stopped``: app, read, position, value of the first read ``when``
        names). ``when`` is any condition (gates, latches, token sets, ``since(...)``,
        and/or/not; thresholds may be parameters). The check runs at ``final.post`` by
        default; ``.at(site).layers([l])`` on the returned op moves it (it must come after
        the reads it names). One stop per app."""
        if not isinstance(when, str):
            raise AppError(f"app {self.name!r}: stop(when=...) needs a condition, got {when!r}")
        op = self._op("control", "stop", {})
        try:
            op.cond(when=when)
        except AppError:
            self.ops.remove(op)
            raise
        return op

    def token_set(
        self, name: str, ids: Any = None, strings: Any = None, contains: Any = None
    ) -> App:
        """A set of token ids for conditions: ids, single-token strings (resolved with the
        tokenizer at deploy), or every token whose text contains a substring."""
        _check_name(f"app {self.name!r}: token set", name, OP_NAME)
        if name in self.token_sets:
            raise AppError(f"app {self.name!r}: token set {name!r} declared twice")
        if ids is None and strings is None and contains is None:
            raise AppError(f"app {self.name!r}: token set {name!r} needs ids, strings or contains")
        if ids is not None:
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise AppError(
                    f"app {self.name!r}: token set {name!r}: ids must be non-negative ints"
                )
            ids = [int(i) for i in ids]
        for what, lst in (("strings", strings), ("contains", contains)):
            if lst is not None and (
                isinstance(lst, str) or not all(isinstance(s, str) and s for s in lst)
            ):
                raise AppError(
                    f"app {self.name!r}: token set {name!r}: {what} must be a list "
                    f"of non-empty strings"
                )
        self.token_sets[name] = TokenSet(
            name,
            ids,
            list(strings) if strings is not None else None,
            list(contains) if contains is not None else None,
        )
        return self

    def param(self, name: str, default: float) -> App:
        """An app-level scalar usable in conditions (``gate="p18 >= theta"``), per request."""
        _check_name(f"app {self.name!r}: parameter", name, OP_NAME)
        self.app_params[name] = _as_param(self.name, "param()", name, default)
        return self

    # -- serialisation: one safetensors file, the JSON spec in its metadata ---------------
    def spec(self) -> dict[str, Any]:
        keys = self._artifact_keys()
        return {
            "format": FORMAT,
            "name": self.name,
            "metadata": self.metadata,
            "params": self.app_params,
            "token_sets": [s.to_json() for s in self.token_sets.values()],
            "ops": [op.to_json(i, keys) for i, op in enumerate(self.ops)],
            **(
                {"saes": {f"sae{i}": s.config() for i, s in enumerate(self._saes())}}
                if self._saes()
                else {}
            ),
        }

    def _artifact_keys(self) -> dict[int, str]:
        """One file key per distinct artifact tensor: the first op that holds it names it."""
        keys: dict[int, str] = {}
        for i, op in enumerate(self.ops):
            for k, t in op.artifacts.items():
                keys.setdefault(id(t), f"op{i}.{k}")
        return keys

    def tensors(self) -> dict[str, torch.Tensor]:
        keys = self._artifact_keys()
        out = {keys[id(t)]: t for op in self.ops for t in op.artifacts.values()}
        for i, s in enumerate(self._saes()):
            out.update({f"sae{i}.{k}": t for k, t in s.tensors().items()})
        return out

    def artifact_bytes(self) -> int:
        """Bytes of the distinct artifacts and SAE tensors as fp32 (what lowering and the
        engine keep)."""
        seen: dict[int, int] = {}
        for op in self.ops:
            for t in op.artifacts.values():
                seen[id(t)] = 4 * t.numel()
        for s in self._saes():
            for t in s.tensors().values():
                seen[id(t)] = 4 * t.numel()
        return sum(seen.values())

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        data: bytes = save(
            self.tensors(), metadata={"xmix.spec": json.dumps(self.spec(), sort_keys=True)}
        )
        return data

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.to_bytes())
        return path

    @staticmethod
    def load(path: str | Path) -> App:
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise AppError(f"cannot read app file {str(path)!r}: {e.strerror}") from None
        return App.from_bytes(data, source=str(path), allow_custom=True)

    @staticmethod
    def from_bytes(data: bytes, source: str = "<bytes>", allow_custom: bool = False) -> App:
        """Parse an app file. ``allow_custom=False`` (the network path) refuses apps that
        would load code (custom kernels). The checks: ``xmix.lang.app_file``."""
        from xmix.lang.app_file import app_from_bytes

        deploy_work.count("app_parses")
        return app_from_bytes(data, source, allow_custom)

    @staticmethod
    def from_spec(
        spec: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        source: str = "<spec>",
        allow_custom: bool = False,
    ) -> App:
        from xmix.lang.app_file import app_from_spec

        return app_from_spec(spec, tensors, source, allow_custom)


def _sae_options(
    app: str, what: str, kernel: str, kwargs: dict[str, Any], options: dict[str, Any]
) -> SAE:
    """Take the SAE and its options out of an SAE kernel's arguments."""
    from xmix.lang.sae import SAE, SAEError

    sae = kwargs.pop("sae", None)
    if not isinstance(sae, SAE):
        raise AppError(
            f"app {app!r}, {what}: needs sae=<xmix.SAE> (load one with xmix.SAE.load "
            f"or xmix.interop.load_sae), got {type(sae).__name__}"
        )
    try:
        if kernel == "sae":
            top_k, features = kwargs.pop("top_k", None), kwargs.pop("features", None)
            if (top_k is None) == (features is None):
                raise AppError(
                    f"app {app!r}, {what}: give exactly one of top_k=K (the K largest "
                    f"active features per token) or features=[...] (those features)"
                )
            if top_k is not None:
                if (
                    isinstance(top_k, bool)
                    or not isinstance(top_k, int)
                    or not 1 <= top_k <= MAX_TOP_K
                ):
                    raise AppError(
                        f"app {app!r}, {what}: top_k must be an int in [1, {MAX_TOP_K}], "
                        f"got {top_k!r}"
                    )
                options["top_k"] = int(top_k)
            else:
                options["features"] = sae.check_features(features, "features")
        else:
            if "feature" not in kwargs:
                raise AppError(f"app {app!r}, {what}: needs feature=<id> or feature=[ids]")
            options["feature"] = sae.check_features(kwargs.pop("feature"), "feature")
            if kernel == "sae_steer" and sae.normalize_activations != "none":
                raise AppError(
                    f"app {app!r}, {what}: the SAE normalises each token "
                    f"({sae.normalize_activations}), so a decoder row has no fixed "
                    f"direction in the stream; use sae_clamp, or write('add', "
                    f"vector=sae.W_dec[f]) for the raw row"
                )
        key = "features" if "features" in options else "feature"
        if len(options.get(key, ())) > MAX_SAE_FEATURES:
            raise AppError(
                f"app {app!r}, {what}: at most {MAX_SAE_FEATURES} features per op, "
                f"got {len(options[key])}"
            )
    except SAEError as e:
        raise AppError(f"app {app!r}, {what}: {e}") from None
    return sae
