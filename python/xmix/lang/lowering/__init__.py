"""Deploy-time lowering: check an app against a model and turn it into per-site ops.

The result (``LoweredApp``) is engine independent: fp32 artifacts per (layer, site), each
op's scalar parameters with defaults, resolved token sets and spans, and conditions whose
references have been checked. ``xmix.runtime.control`` places it in the control block;
``xmix.integrations.hf`` runs it with ``xmix.lang.reference`` as the oracle.

Order at a site: apps in deployment order, then ops in declaration order.

This module holds what a lowered app is and ``lower``'s steps; ``pack`` holds one packing
function per kernel (what a lowered op carries at one layer), ``errors`` the errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from xmix.lang import conditions as C
from xmix.lang import deploy_work
from xmix.lang.api import App
from xmix.lang.catalog import CENTROIDS, EXPERTS, FLT_MAX, KERNELS, MAT_DD, SAE_KERNELS, VEC
from xmix.lang.lowering.errors import DeployError as DeployError
from xmix.lang.lowering.errors import RequestError as RequestError
from xmix.lang.lowering.errors import fail
from xmix.lang.lowering.pack import PACK, OpAt, Shared
from xmix.lang.sites import ModelShape, site_id, site_of

if TYPE_CHECKING:
    from xmix.lang.api import Op


# How a deployed app applies: to nobody, to requests that name it, to every request.
APP_MODES = ("off", "request", "all")


# The largest magnitude a write may give an element of the stream. Far beyond any model's
# activations, and far enough below fp32's 3.4e38 that sums of writes and the model's own
# residual additions stay finite: a stream driven to Inf/NaN puts Inf/NaN into the KV cache,
# and vLLM reuses freed KV blocks without clearing them, which would change the answers of
# later requests that get those blocks.
WRITE_BOUND = 1e30


def param_bounds(o: LoweredOp) -> dict[str, tuple[float, float]]:
    """Ranges of an op's parameters within which its write stays within WRITE_BOUND (on top
    of the kernel's own ranges); checked for defaults at deploy and for every request."""
    if o.kernel in ("add", "sae_steer"):  # x += scale * a0 (sae_steer: summed decoder rows)
        m = float(o.artifacts["a0"].abs().max()) if o.artifacts["a0"].numel() else 0.0
        return {"scale": (-WRITE_BOUND / m, WRITE_BOUND / m)} if m > 0 else {}
    if o.kernel == "sae_clamp":  # x += sum_f (value - a_f) W_dec[f]: |value| sum_f |W_dec[f]|
        # a1 is the SAE's W_dec [F, d] as the kernel reads it (a decoded program has no SAE)
        rows = o.artifacts["a1"][list(o.features)].double().abs().sum(0)
        m = float(rows.max()) if rows.numel() else 0.0
        return {"value": (-WRITE_BOUND / m, WRITE_BOUND / m)} if m > 0 else {}
    if o.kernel == "clamp":  # a bound pulls the component along u to it
        return {"min": (-FLT_MAX, WRITE_BOUND), "max": (-WRITE_BOUND, FLT_MAX)}
    if o.kernel == "router":
        return {"delta": (0.0, WRITE_BOUND)}
    return {}


@dataclass
class LoweredOp:
    app: str
    op_index: int  # declaration index in the app
    label: str
    primitive: str
    kernel: str
    site: str  # site name (Op.at)
    layer: int | None
    site_id: int
    result_key: str | None  # reads: key under which results are reported
    artifacts: dict[str, torch.Tensor]  # fp32, already per layer (a0, a1, a2 by kernel)
    params: list[tuple[str, float]]  # (name, default), in the kernel's ParamIndex order
    cond: Any  # conditions.Node or None
    n: int = 0
    m: int = 0
    state_width: int = 0  # floats of per-slot vector state (cosine)
    capture_width: int = 0
    custom: Any = None  # api.CustomKernel
    name: str | None = None  # the op's .named() name, for per-op parameters
    flags: int = 0  # OpDesc.flags (SAE kernels: architecture, normalisation)
    n_channels: int = 1  # result channels (an SAE features read: one per feature)
    sae: Any = None  # xmix.SAE of an SAE kernel
    features: list[int] = field(default_factory=list)  # SAE features of the op, in order
    top_k: int = 0  # "sae" read: ids + activations per token
    # Monitors (kernels "stop" and "since"): the read a stop or a switch is reported with
    # (the first read the condition names; None for a condition on tokens alone), and for
    # "since" the text of its since(...) term, which ops' conditions refer to it by.
    monitor_read: str | None = None
    sticky: str | None = None

    @property
    def is_read(self) -> bool:
        return self.primitive == "read"

    @property
    def is_control(self) -> bool:
        return self.primitive == "control"


@dataclass
class LoweredApp:
    name: str
    app: App
    shape: ModelShape
    ops: list[LoweredOp]  # sorted by (site_id, op_index)
    token_sets: dict[str, list[int]]  # name -> sorted token ids
    spans: list[tuple[str, str]]  # (open set, close set)
    app_params: dict[str, float]
    reads: dict[str, LoweredOp] = field(default_factory=dict)
    # "name.f<id>": (result key, channel index) of one feature of an SAE features read
    aliases: dict[str, tuple[str, int]] = field(default_factory=dict)
    # since(...) terms of the app's conditions by their text -> the op that decides them
    sinces: dict[str, LoweredOp] = field(default_factory=dict)
    # program_codec.app_digest of the app it was lowered from, once the frontend computed it
    # (a lowered program carries it: a server compares an app file given at start with it)
    digest: str = ""

    @property
    def stop(self) -> LoweredOp | None:
        return next((o for o in self.ops if o.kernel == "stop"), None)

    def read_op(self, key: str) -> LoweredOp | None:
        """The read a condition names: a result key, or one feature of an SAE read."""
        if key in self.aliases:
            return self.reads[self.aliases[key][0]]
        return self.reads.get(key)

    @property
    def sites(self) -> list[str]:
        from xmix.lang.sites import site_name

        return sorted({site_name(o.site_id, self.shape.n_layers) for o in self.ops})

    @property
    def writes(self) -> bool:
        return any(o.primitive == "write" for o in self.ops)

    @property
    def stateful(self) -> bool:
        """Needs every prompt token computed by this request (no prefix-cache reads)."""
        if self.spans or self.sinces or any(o.kernel in ("cosine", "stop") for o in self.ops):
            return True
        return any(isinstance(n, C.Latch) for o in self.ops if o.cond for n in C.walk(o.cond))

    @property
    def reads_prompt(self) -> bool:
        return any(o.is_read for o in self.ops)


def _check_finite(app: str, what: str, name: str, t: torch.Tensor) -> None:
    # Checked as the kernels will see it: in fp32 (a float64 1e39 is Inf there).
    f = t.float()
    if not torch.isfinite(f).all():
        bad = (~torch.isfinite(f)).nonzero()[0].tolist()
        raise fail(
            app, what, f"artifact {name!r} contains NaN or Inf in fp32 (first at index {bad})"
        )


def _per_layer(
    app: str,
    what: str,
    name: str,
    t: torch.Tensor,
    kind: str,
    layers: list[int | None],
    shape: ModelShape,
) -> list[torch.Tensor]:
    """Split an artifact into one fp32 tensor per layer, checking its shape against the model."""
    d, L = shape.hidden_size, shape.n_layers
    base_rank = {VEC: 1, EXPERTS: 1, MAT_DD: 2, CENTROIDS: 2}[kind]

    def check_base(x: torch.Tensor) -> None:
        if kind == VEC and tuple(x.shape) != (d,):
            raise fail(
                app,
                what,
                f"artifact {name!r} has shape {tuple(t.shape)}; expected "
                f"[{d}] (hidden size) or [n_layers, {d}]",
            )
        if kind == MAT_DD and tuple(x.shape) != (d, d):
            raise fail(
                app, what, f"artifact {name!r} has shape {tuple(t.shape)}; expected [{d}, {d}]"
            )
        if kind == CENTROIDS and (x.dim() != 2 or x.shape[1] != d or x.shape[0] < 1):
            raise fail(
                app, what, f"artifact {name!r} has shape {tuple(t.shape)}; expected [k, {d}]"
            )
        if kind == EXPERTS:
            if tuple(x.shape) != (shape.n_experts,):
                raise fail(
                    app,
                    what,
                    f"artifact {name!r} has shape {tuple(t.shape)}; expected "
                    f"[{shape.n_experts}] (experts) or [n_layers, {shape.n_experts}]",
                )

    if t.dim() == base_rank:
        check_base(t)
        return [t.float()] * len(layers)
    if t.dim() == base_rank + 1:
        if layers == [None]:
            raise fail(
                app, what, f"artifact {name!r} has a layer dimension but the site is model level"
            )
        if t.shape[0] == L:
            rows = [t[l] for l in layers]
        elif t.shape[0] == len(layers):
            rows = [t[i] for i in range(len(layers))]
        else:
            raise fail(
                app,
                what,
                f"artifact {name!r} has {t.shape[0]} layer rows; expected "
                f"{L} (one per model layer) or {len(layers)} (one per selected layer)",
            )
        for r in rows:
            check_base(r)
        return [r.float().contiguous() for r in rows]
    raise fail(app, what, f"artifact {name!r} has shape {tuple(t.shape)}; expected {kind}")


def resolve_token_sets(app: App, shape: ModelShape, tokenizer: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for ts in app.token_sets.values():
        ids: set[int] = set()
        what = f"token set {ts.name!r}"
        for i in ts.ids or []:
            if i >= shape.vocab_size:
                raise fail(
                    app.name, what, f"token id {i} is outside the vocabulary ({shape.vocab_size})"
                )
            ids.add(i)
        if (ts.strings or ts.contains) and tokenizer is None:
            raise fail(app.name, what, "strings need the model's tokenizer, which is not available")
        for s in ts.strings or []:
            enc = tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise fail(
                    app.name,
                    what,
                    f"string {s!r} is {len(enc)} tokens {enc}, not one; "
                    f"use contains=[...] or ids=[...]",
                )
            ids.add(int(enc[0]))
        if ts.contains:
            n = min(len(tokenizer), shape.vocab_size)
            for i in range(n):
                text = tokenizer.decode([i])
                if any(sub in text for sub in ts.contains):
                    ids.add(i)
            if not any(True for _ in ids):
                raise fail(app.name, what, f"no token of the vocabulary contains {ts.contains!r}")
        out[ts.name] = sorted(ids)
    return out


def _layers_of(op: Op, shape: ModelShape) -> int:
    if op.site == "final.post" or op.layer_spec is None:
        return 1
    if op.layer_spec == "all":
        return len(shape.moe_layers) if op.site == "router.logits" else shape.n_layers
    return len(op.layer_spec)


def lower(
    app: App, shape: ModelShape, tokenizer: Any = None, max_ops: int | None = None
) -> LoweredApp:
    """Check ``app`` against ``shape`` and lower it. Raises DeployError naming app, op, field.
    ``max_ops`` bounds the lowered ops (one per op and layer), checked before any work.

    The steps, each a function below: every op placed on its layers and packed per layer
    (``_lower_op``, one packing function per kernel in ``pack.PACK``), the reads indexed by result
    name (``_index_reads``), one op per since(...) term (``_since_ops``), the conditions'
    references checked (``_check_conditions``), then the order of gates and since terms."""
    deploy_work.count("lowerings")
    name = app.name
    if max_ops is not None:
        n = sum(_layers_of(op, shape) for op in app.ops)
        if n > max_ops:
            raise DeployError(
                f"app {name!r}: {n} ops once placed on their layers; the engine has "
                f"room for {max_ops} more"
            )
    token_sets = resolve_token_sets(app, shape, tokenizer)
    shared = Shared()
    ops: list[LoweredOp] = []
    for idx, op in enumerate(app.ops):
        ops.extend(_lower_op(name, idx, op, shape, shared))
    reads, aliases = _index_reads(name, ops)
    sinces = _since_ops(app, ops, reads, aliases, shape)
    ops.extend(sinces.values())
    # At a site: the app's ops in declaration order, monitors after them (a stop placed at a
    # read's site sees that read whatever the order the app declared them in).
    ops.sort(key=lambda o: (o.site_id, o.is_control, o.op_index))
    spans = _check_conditions(app, ops, token_sets)
    _check_gate_order(name, ops, reads, aliases)
    _check_since_order(name, ops, sinces, shape)
    return LoweredApp(
        name=name,
        app=app,
        shape=shape,
        ops=ops,
        token_sets=token_sets,
        spans=spans,
        app_params=dict(app.app_params),
        reads=reads,
        aliases=aliases,
        sinces=sinces,
    )


def _lower_op(app: str, idx: int, op: Op, shape: ModelShape, shared: Shared) -> list[LoweredOp]:
    """One op of the app: checked, then one LoweredOp per layer it is placed on."""
    what = f"op {op.label}"
    spec = KERNELS[op.kernel]
    layers = _placement(app, what, op, spec, shape)
    _check_op(app, what, op, spec, layers, shape, shared)
    per_layer = _artifacts_per_layer(app, what, op, spec, layers, shape, shared)
    params = _op_params(app, what, op, spec)
    multi = len(layers) > 1
    out = []
    for li, layer in enumerate(layers):
        assert op.site is not None  # _placement refuses an op without a site
        k = PACK[op.kernel](OpAt(app, what, op, per_layer, li, shape, shared))
        key = None
        if op.primitive == "read":
            key = f"{op.result_name}.{layer}" if multi else op.result_name
        lop = LoweredOp(
            app=app,
            op_index=idx,
            label=op.label,
            primitive=op.primitive,
            kernel=op.kernel,
            site=op.site,
            layer=layer,
            site_id=site_id(op.site, layer, shape.n_layers),
            result_key=key,
            artifacts=k.arts,
            params=list(params),
            cond=op.condition(),
            n=k.n,
            m=k.m,
            state_width=k.state,
            capture_width=k.cap,
            custom=op.custom,
            name=op.name,
            flags=k.flags,
            n_channels=len(k.features) if op.kernel == "sae" and k.features else 1,
            sae=op.sae,
            features=k.features,
            top_k=k.top_k,
            monitor_read=next(iter(C.reads_named(op.condition())), None)
            if op.kernel == "stop"
            else None,
        )
        for p, (lo, hi) in param_bounds(lop).items():
            v = dict(lop.params)[p]
            if not lo <= v <= hi:
                raise fail(
                    app,
                    what,
                    f"parameter {p!r}={v} would write values beyond "
                    f"{WRITE_BOUND:g}; it must lie in [{lo:g}, {hi:g}]",
                )
        out.append(lop)
    return out


def _placement(app: str, what: str, op: Op, spec: Any, shape: ModelShape) -> list[int | None]:
    """The layers an op runs at (``[None]`` for the model-level site), its site checked
    against the kernel and the model."""
    if op.kernel == "stop":
        if op.condition() is None:
            raise fail(app, what, "a stop needs a condition (app.stop(when=...))")
        if op.site is None and op.layer_spec is None:
            op.site = "final.post"  # after every read: the condition sees them all
    if op.site is None:
        raise fail(app, what, "no site: call .at(site)")
    if spec.sites is not None and op.site not in spec.sites:
        raise fail(
            app,
            what,
            f"kernel {op.kernel!r} only runs at {', '.join(spec.sites)}, not {op.site!r}",
        )
    if spec.sites is None and op.site == "router.logits" and op.kernel != "custom":
        raise fail(app, what, f"kernel {op.kernel!r} does not run on router logits")
    if op.site == "final.post":
        if op.layer_spec is not None:
            raise fail(app, what, "final.post is a model-level site; do not give .layers(...)")
        return [None]
    if op.layer_spec is None:
        raise fail(app, what, f"site {op.site!r} needs .layers(...)")
    layers: list[int | None]
    if op.site == "router.logits":
        if not shape.n_experts:
            raise fail(
                app,
                what,
                "router.logits needs a mixture-of-experts model; "
                f"{shape.model_name or 'this model'} has no experts",
            )
        layers = list(shape.moe_layers) if op.layer_spec == "all" else list(op.layer_spec)
        for l in layers:
            if l not in shape.moe_layers:
                raise fail(
                    app,
                    what,
                    f"layer {l} has no router (MoE layers: {list(shape.moe_layers)})",
                )
    else:
        layers = list(range(shape.n_layers)) if op.layer_spec == "all" else list(op.layer_spec)
    for l in layers:
        if l is None or not 0 <= l < shape.n_layers:
            raise fail(app, what, f"layer {l} out of range (model has {shape.n_layers} layers)")
    return layers


def _check_op(
    app: str,
    what: str,
    op: Op,
    spec: Any,
    layers: list[int | None],
    shape: ModelShape,
    shared: Shared,
) -> None:
    """What does not depend on the layer: one site for a stop and an SAE, finite artifacts,
    the SAE's width, the parameters within the kernel's range."""
    if op.kernel == "stop" and len(layers) != 1:
        raise fail(app, what, f"a stop runs at one site; give one layer, got {len(layers)}")
    for a, t in op.artifacts.items():
        if id(t) not in shared.checked:
            _check_finite(app, what, a, t)
            shared.checked.add(id(t))
    if op.kernel in SAE_KERNELS:
        if len(layers) != 1:
            raise fail(
                app,
                what,
                f"an SAE runs at the one site it was trained on; give one layer, got {len(layers)}",
            )
        assert op.sae is not None  # App sets it for every SAE kernel
        if op.sae.d_in != shape.hidden_size:
            raise fail(
                app,
                what,
                f"the SAE reads vectors of width {op.sae.d_in}, the "
                f"model's hidden size is {shape.hidden_size}",
            )
    for p, v in op.params.items():
        pspec = spec.params.get(p)
        if pspec and not (pspec.lo <= v <= pspec.hi):
            raise fail(app, what, f"parameter {p!r}={v} out of range [{pspec.lo}, {pspec.hi}]")


def _artifacts_per_layer(
    app: str,
    what: str,
    op: Op,
    spec: Any,
    layers: list[int | None],
    shape: ModelShape,
    shared: Shared,
) -> dict[str, list[torch.Tensor]]:
    """Each artifact as one fp32 tensor per layer, its shape checked against the model."""
    per_layer: dict[str, list[torch.Tensor]] = {}
    if op.kernel == "custom" and "artifact" in op.artifacts:
        per_layer["artifact"] = [op.artifacts["artifact"].float().reshape(-1).contiguous()] * len(
            layers
        )
    for a, kind in dict(spec.artifacts).items():
        per_layer[a] = _per_layer(
            app, what, a, shared.as_fp32(op.artifacts[a]), kind, layers, shape
        )
    if op.kernel == "router":
        for mask in per_layer["mask"]:
            if not torch.isin(mask, torch.tensor([-1.0, 0.0, 1.0])).all():
                raise fail(app, what, "artifact 'mask' must hold only -1, 0 and 1")
    return per_layer


def _op_params(app: str, what: str, op: Op, spec: Any) -> list[tuple[str, float]]:
    """The op's scalar parameters in the kernel's order, defaults filled in."""
    if op.kernel == "custom":
        assert op.custom is not None  # App sets it for every custom kernel
        params = [(p, v) for p, v in (op.custom.params or {}).items()]
    else:
        params = [(p, op.params.get(p, ps.default)) for p, ps in spec.params.items()]
    if op.kernel == "clamp":
        lo = dict(params)["min"]
        hi = dict(params)["max"]
        if lo > hi:
            raise fail(app, what, f"min ({lo}) is greater than max ({hi})")
    return params


def _index_reads(
    app: str, ops: list[LoweredOp]
) -> tuple[dict[str, LoweredOp], dict[str, tuple[str, int]]]:
    """Result name -> its read, and each feature of an SAE read (``name.f<id>``) -> (the
    read's name, its channel); a name used twice is refused."""
    reads: dict[str, LoweredOp] = {}
    aliases: dict[str, tuple[str, int]] = {}
    for o in ops:
        if o.result_key is not None:
            if o.result_key in reads:
                raise fail(app, f"op {o.label}", f"result name {o.result_key!r} is used twice")
            reads[o.result_key] = o
            if o.kernel == "sae" and o.features:
                for i, f in enumerate(o.features):
                    aliases[f"{o.result_key}.f{f}"] = (o.result_key, i)
    for a in aliases:
        if a in reads:
            raise fail(
                app,
                f"op {reads[a].label}",
                f"result name {a!r} is also a feature of the SAE read {aliases[a][0]!r}",
            )
    return reads, aliases


def _check_conditions(
    app: App, ops: list[LoweredOp], token_sets: dict[str, list[int]]
) -> list[tuple[str, str]]:
    """Every token set and parameter a condition names exists, no condition is nested too
    deeply; returns the app's distinct spans (open, close) in order of first use."""
    spans: list[tuple[str, str]] = []
    for o in ops:
        if o.cond is None:
            continue
        what = f"op {o.label}"
        if C.stack_depth(o.cond) > 16:
            raise fail(app.name, what, "condition is nested too deeply (more than 16 levels)")
        for node in C.walk(o.cond):
            if isinstance(node, C.TokenIn) and node.set not in token_sets:
                raise fail(
                    app.name,
                    what,
                    f"unknown token set {node.set!r} (declare it with app.token_set)",
                )
            if isinstance(node, C.InSpan):
                for s in (node.open, node.close):
                    if s not in token_sets:
                        raise fail(app.name, what, f"unknown token set {s!r} in in_span")
                if (node.open, node.close) not in spans:
                    spans.append((node.open, node.close))
            if isinstance(node, (C.Gate, C.Latch)):
                if isinstance(node.value, str) and node.value not in app.app_params:
                    raise fail(
                        app.name,
                        what,
                        f"unknown parameter {node.value!r} in condition "
                        f"(declare it with app.param)",
                    )
    return spans


def _read_site(
    key: str, reads: dict[str, LoweredOp], aliases: dict[str, tuple[str, int]]
) -> int | None:
    src = reads.get(aliases[key][0]) if key in aliases else reads.get(key)
    return src.site_id if src is not None else None


def _since_ops(
    app: App,
    ops: list[LoweredOp],
    reads: dict[str, LoweredOp],
    aliases: dict[str, tuple[str, int]],
    shape: ModelShape,
) -> dict[str, LoweredOp]:
    """One op per distinct since(...) term of the app's conditions: it decides the term's
    state right after the site of the last read the term names (the first site of layer 0
    for a term on tokens alone), for every token of the step, in position order."""
    out: dict[str, LoweredOp] = {}
    for o in list(ops):
        for s in C.sinces(o.cond):
            text = C.to_text(s)
            if text in out:
                continue
            named = C.reads_named(s.a)
            sites = [x for x in (_read_site(r, reads, aliases) for r in named) if x is not None]
            sid = max(sites) if sites else site_id("residual.pre", 0, shape.n_layers)
            layer, site = site_of(sid, shape.n_layers)
            out[text] = LoweredOp(
                app=app.name,
                op_index=len(app.ops) + len(out),
                label=text,
                primitive="control",
                kernel="since",
                site=site,
                layer=layer,
                site_id=sid,
                result_key=None,
                artifacts={},
                params=[],
                cond=s.a,
                monitor_read=named[0] if named else None,
                sticky=text,
            )
    return out


def _check_since_order(
    app: str, ops: list[LoweredOp], sinces: dict[str, LoweredOp], shape: ModelShape
) -> None:
    """An op sees a since(...) term from the next site after the one deciding it: the term
    is decided across every token of the step there (on a GPU by every token's block of that
    site's kernel), so an op at that site or before it would see it one step late."""
    from xmix.lang.sites import site_name

    for o in ops:
        for s in C.sinces(o.cond):
            d = sinces[C.to_text(s)]
            if o.site_id <= d.site_id:
                raise fail(
                    app,
                    f"op {o.label}",
                    f"{C.to_text(s)} is decided after {site_name(d.site_id, shape.n_layers)} "
                    f"(the site of the last read it names); an op using it must be at a later "
                    f"site",
                )


def latch_from_generated(lowered: LoweredApp, op: LoweredOp, latch: C.Latch) -> bool:
    """Whether ``op`` sees ``latch`` only from the first generated token on. The prompt's
    reduction is complete once the read's site has seen the last prompt token; an op at a
    later site of that forward sees the latch from the last prompt token on, an op at the
    read's site or before it only from the next step, the first generated token."""
    read = lowered.read_op(latch.read)
    assert read is not None  # lowering refuses a condition on a read the app does not have
    return read.site_id >= op.site_id


def _check_gate_order(
    app: str, ops: list[LoweredOp], reads: dict[str, LoweredOp], aliases: dict[str, tuple[str, int]]
) -> None:
    # Dependencies between ops (by position in the lowered list) through gates and latches.
    deps: dict[int, list[tuple[int, str, bool]]] = {}
    pos = {id(o): i for i, o in enumerate(ops)}
    for i, o in enumerate(ops):
        if o.cond is None:
            continue
        # a since(...) term's reads are the deciding op's (_since_ops), checked there
        for node in C.walk(o.cond, into_since=False):
            if not isinstance(node, (C.Gate, C.Latch)):
                continue
            src = reads[aliases[node.read][0]] if node.read in aliases else reads.get(node.read)
            if src is not None and src.n_channels > 1 and node.read == src.result_key:
                raise fail(
                    app,
                    f"op {o.label}",
                    f"{node.read!r} reads {src.n_channels} SAE "
                    f"features; name one: "
                    f"{', '.join(sorted(k for k, v in aliases.items() if v[0] == node.read)[:4])}",
                )
            if src is None:
                multi = sorted(k for k in reads if k.startswith(node.read + "."))
                hint = f"; it is on several layers, name one of {multi}" if multi else ""
                raise fail(
                    app,
                    f"op {o.label}",
                    f"condition reads {node.read!r}, which is not a read of this app{hint}",
                )
            deps.setdefault(i, []).append((pos[id(src)], node.read, isinstance(node, C.Latch)))
    # A cycle first (it would also be "later"), then the forward-order rule. Depth-first
    # with an explicit stack: a chain of gates is as deep as it is long.
    state: dict[int, int] = {}
    for root in deps:
        if state.get(root) is not None:
            continue
        state[root] = 1
        path = [root]
        stack = [iter(deps.get(root, []))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            j = nxt[0]
            if state.get(j) == 1:
                cyc = " -> ".join(ops[k].label for k in path[path.index(j) :] + [j])
                raise fail(app, f"op {ops[path[-1]].label}", f"conditions form a cycle: {cyc}")
            if state.get(j) is None:
                state[j] = 1
                path.append(j)
                stack.append(iter(deps.get(j, [])))
    for i, lst in deps.items():
        o = ops[i]
        for j, rname, latch in lst:
            src = ops[j]
            if latch:
                continue  # any site: see latch_from_generated
            elif src.kernel == "cosine" and src.site_id >= o.site_id:
                raise fail(
                    app, f"op {o.label}", f"gate on cosine read {rname!r} must be at a later site"
                )
            elif src.kernel == "custom" and src.site_id >= o.site_id:
                # user kernels run after a site's built-in ops
                raise fail(
                    app, f"op {o.label}", f"gate on custom read {rname!r} must be at a later site"
                )
            elif not (
                src.site_id < o.site_id
                or (
                    src.site_id == o.site_id
                    and (src.op_index < o.op_index or (o.is_control and not src.is_control))
                )
            ):
                raise fail(
                    app,
                    f"op {o.label}",
                    f"gate on {rname!r}, which runs later in the forward "
                    f"pass; gates may only read earlier reads",
                )
