"""The oracle of the paper-app tests (tests/engine/test_app_*.py): the seven paper apps
(xmix.apps) on the vLLM CPU engine, against the papers' math.

The oracle here is written from the papers' definitions, on a transformers model with plain
forward hooks (``Hooked``): ablation x - (x·r̂)r̂ at the block input and the attention
and MLP outputs (Arditi et al.); SEAL's add on "\\n\\n" tokens inside <think>…</think>; CAST's
cos(h̄, tanh(P h̄)) on the prompt mean and its latched behaviour add; a logistic probe on
mlp.post (Orgad et al.); SAKE's A(h - mu_s) + mu_t when ||h - mu_s|| <= t; KTS's probe-gated
add at block outputs; SteerMoE's log-softmax rewrite of the router scores before top-k. It does
not use xmix.lang.reference or xmix.integrations.hf. Greedy generation recomputes the whole sequence
each step, so every position sees exactly the writes that the serving semantics give it
(last_token = last prompt token and fed-back generated tokens; latches decided at the last
prompt token; spans opener-inclusive, closer-exclusive; the last generated token never fed back).

Where a write fired is measured on the engine itself: capture apps deployed before ("pre")
and after ("post") the paper apps read the same site around the write, so post - pre is the
write's effect per position (bit-identical rows where it did not fire).

Two engines for the session (``shared_llm``): tiny-llama hosts #1-#6 (and test_derive.py's
derivations), tiny-mixtral hosts #7 and then all seven together. The artifacts (derived on the
transformers model, the costly part) are built once per model and session (``oracle``); each
test module deploys them on entry and undeploys them on exit (``deploy_env``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import xmix
from engine_util import assert_reads_match, hf_model, make_llm, shutdown
from xmix.apps import cast, kl_then_steer, refusal, sake, seal, steer_moe, truth_probe
from xmix.apps import derive as D
from xmix.models.tiny import tiny_model_path

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "examples" / "prompts"
G = 12  # generated tokens per request
RTOL, ATOL = 1e-4, 1e-5
F64 = torch.float64


def lines(name: str) -> list[str]:
    return [
        l.strip()
        for l in (PROMPTS_DIR / f"{name}.txt").read_text(encoding="utf-8").splitlines()
        if l.strip()
    ]


# ============================================================================ shared engines
_ENGINES: dict[str, Any] = {}


def shared_llm(kind: str, config) -> Any:
    """One engine per tiny model for the whole session (test_derive.py reuses tiny-llama's).
    Eager: what these modules check is each app against its paper's math; the compiled path
    with every kind of op and condition is tests/engine/test_engine.py's Llama, and a cold
    compile per engine cost ~70 s of the suite's budget."""
    if kind not in _ENGINES:
        llm = make_llm(str(tiny_model_path(kind)))
        _ENGINES[kind] = llm
        config.add_cleanup(lambda: release(kind))
    return _ENGINES[kind]


def release(kind: str) -> None:
    if kind in _ENGINES:
        shutdown(_ENGINES.pop(kind))


# ============================================================================ the oracle
@dataclass
class Ctx:
    ids: list[int]
    P: int  # prompt length
    reads: dict = field(default_factory=dict)  # app -> key -> {"positions", "values"}
    state: dict = field(default_factory=dict)  # latches decided in this forward
    routing: dict = field(default_factory=dict)  # layer -> [T, k] experts chosen

    def read(self, app: str, key: str, positions: list[int], values: list) -> None:
        self.reads.setdefault(app, {})[key] = {"positions": positions, "values": values}


Op = tuple[str, Any, Callable]  # (site, layer or None, fn(x [T, d], ctx) -> new x or None)


class Hooked:
    """A transformers Llama / Mixtral with a hook at every xmix site; ``plan`` maps
    (site, layer) to the functions to run there, in order."""

    def __init__(self, path: str):
        self.model = hf_model(path)
        self.plan: dict[tuple[str, Any], list[Callable]] = {}
        self.ctx: Ctx | None = None
        m = self.model.model
        self.handles = []
        for l, layer in enumerate(m.layers):
            self.handles += [
                layer.register_forward_pre_hook(self._pre(("residual.pre", l)), with_kwargs=True),
                layer.self_attn.register_forward_hook(self._out(("attention.post", l))),
                layer.post_attention_layernorm.register_forward_pre_hook(
                    self._pre(("residual.mid", l)), with_kwargs=True
                ),
                layer.mlp.register_forward_hook(self._out(("mlp.post", l))),
                layer.register_forward_hook(self._out(("residual.post", l))),
            ]
            if hasattr(layer.mlp, "experts"):
                self.handles.append(layer.mlp.gate.register_forward_hook(self._router(l)))
        self.handles.append(m.norm.register_forward_hook(self._out(("final.post", None))))

    def _apply(self, key, x: torch.Tensor) -> torch.Tensor:
        for fn in self.plan.get(key, ()):
            y = fn(x, self.ctx)
            if y is not None:
                x = y
        return x

    def _pre(self, key):
        def hook(mod, args, kwargs):
            if key not in self.plan:
                return None
            if args:
                return (self._apply(key, args[0][0])[None],) + tuple(args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = self._apply(key, kwargs["hidden_states"][0])[None]
            return args, kwargs

        return hook

    def _out(self, key):
        def hook(mod, args, out):
            if key not in self.plan:
                return None
            if isinstance(out, tuple):
                return (self._apply(key, out[0][0])[None],) + tuple(out[1:])
            return self._apply(key, out[0])[None]

        return hook

    def _router(self, layer):
        key = ("router.logits", layer)

        def hook(mod, args, out):
            logits, scores, idx = out
            if key in self.plan:
                logits = self._apply(key, logits)
                # Mixtral's own routing on the rewritten scores: softmax, top-k, renormalise.
                probs = torch.softmax(logits.float(), dim=-1)
                scores, idx = torch.topk(probs, mod.top_k, dim=-1)
                scores = scores / scores.sum(-1, keepdim=True)
            if self.ctx is not None:
                self.ctx.routing[layer] = idx.detach().clone()
            return logits, scores, idx

        return hook

    def set_plan(self, ops: list[Op]) -> None:
        self.plan = {}
        for site, layer, fn in ops:
            self.plan.setdefault((site, layer), []).append(fn)

    @torch.no_grad()
    def forward(self, ids: list[int], P: int) -> tuple[torch.Tensor, Ctx]:
        self.ctx = Ctx(list(ids), P)
        logits = self.model(torch.tensor([ids])).logits[0]
        ctx, self.ctx = self.ctx, None
        return logits, ctx

    def generate(
        self, prompt: list[int], ops: list[Op], n: int = G, allowed: list[int] | None = None
    ) -> tuple[list[int], dict, Ctx]:
        """Greedy tokens, and the reads of the last forward (prompt + all generated tokens
        but the last, which is never fed back)."""
        self.set_plan(ops)
        seq = list(prompt)
        ctx = None
        for _ in range(n):
            logits, ctx = self.forward(seq, len(prompt))
            last = logits[-1]
            if allowed is not None:
                masked = torch.full_like(last, -torch.inf)
                masked[allowed] = last[allowed]
                last = masked
            seq.append(int(last.argmax()))
        self.set_plan([])
        return seq[len(prompt) :], ctx.reads, ctx


# ---------------------------------------------------------------------------- the papers' math
def _rows(x: torch.Tensor, mask: list[bool], new: torch.Tensor) -> torch.Tensor:
    m = torch.tensor(mask)[:, None]
    return torch.where(m, new.to(x.dtype), x)


def ref_capture(app: str, key: str, cond: Callable[[Ctx, int], bool] = lambda c, p: True):
    def fn(x, ctx):
        pos = [p for p in range(x.shape[0]) if cond(ctx, p)]
        ctx.read(app, key, pos, [x[p].double().tolist() for p in pos])

    return fn


def ref_ablate(r: torch.Tensor):
    u = r.double() / r.double().norm()

    def fn(x, ctx):
        xd = x.double()
        return (xd - (xd @ u)[:, None] * u[None]).to(x.dtype)

    return fn


def ref_add(v: torch.Tensor, scale: float, mask: Callable[[Ctx, int], bool] = lambda c, p: True):
    def fn(x, ctx):
        return _rows(x, [mask(ctx, p) for p in range(x.shape[0])], x.double() + scale * v.double())

    return fn


def think_spans(ids: list[int], open_id: int, close_id: int) -> list[bool]:
    """SEAL's "while thinking": from <think> (inclusive) to </think> (exclusive)."""
    out, inside = [], False
    for t in ids:
        if t == open_id:
            inside = True
        if t == close_id:
            inside = False
        out.append(inside)
    return out


def seal_mask(ctx: Ctx, nl2: set[int], open_id: int, close_id: int) -> list[bool]:
    span = think_spans(ctx.ids, open_id, close_id)
    return [t in nl2 and s for t, s in zip(ctx.ids, span)]


def cast_score(mean: torch.Tensor, v: torch.Tensor) -> float:
    """Lee et al.: cos(h̄, tanh(P h̄)), P = v vᵀ / vᵀv."""
    m, v = mean.double(), v.double()
    proj = torch.tanh(v * (v @ m) / (v @ v))
    return float(m @ proj / (m.norm() * proj.norm()))


CMP = {
    ">=": lambda a, b: a >= b,
    ">": lambda a, b: a > b,
    "<=": lambda a, b: a <= b,
    "<": lambda a, b: a < b,
}


def sigmoid_probe(x: torch.Tensor, w: torch.Tensor, b: float) -> torch.Tensor:
    return torch.sigmoid(x.double() @ w.double() + b)


def last_token(ctx: Ctx, p: int) -> bool:
    return p >= ctx.P - 1


# ---------------------------------------------------------------------------- app references
@dataclass
class Spec:
    """A paper app, and its reference: ``ops(params)`` -> the oracle's functions per site."""

    app: xmix.App
    ops: Callable[[dict], list[Op]]
    params: dict = field(default_factory=dict)  # the app's defaults, overridable per request


def spec_refusal(r: torch.Tensor, n_layers: int) -> Spec:
    def ops(p):
        return [
            (site, l, ref_ablate(r))
            for l in range(n_layers)
            for site in ("residual.pre", "attention.post", "mlp.post")
        ]

    return Spec(refusal(r), ops)


def spec_refusal_add(r: torch.Tensor, layer: int, coeff: float) -> Spec:
    def ops(p):
        return [("residual.pre", layer, ref_add(r, p["scale"]))]

    return Spec(
        refusal(r, variant="add", layer=layer, coeff=coeff, name="refusal_add"),
        ops,
        {"scale": coeff},
    )


def spec_seal(S: torch.Tensor, layer: int, coeff: float, tok) -> Spec:
    nl2 = {i for i in range(len(tok)) if "\n\n" in tok.decode([i])}
    o, c = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")

    def ops(p):
        def fn(x, ctx):
            return _rows(x, seal_mask(ctx, nl2, o, c), x.double() + p["scale"] * S.double())

        return [("residual.pre", layer, fn)]

    return Spec(seal(S, layer, coeff=coeff), ops, {"scale": coeff})


def spec_cast(v, u, cl: int, bl: list[int], theta: float, cmp: str, alpha: float) -> Spec:
    def ops(p):
        def read(x, ctx):
            score = cast_score(x[: ctx.P].double().mean(0), v)
            ctx.read("cast", "cast_sim", [ctx.P - 1], [score])
            ctx.state["cast"] = CMP[cmp](score, p["theta"])

        out = [("residual.pre", cl, read)]
        for i, l in enumerate(bl):
            out.append(
                (
                    "residual.pre",
                    l,
                    ref_add(u[i], p["scale"], lambda c, q: c.state["cast"] and q >= c.P - 1),
                )
            )
        return out

    return Spec(
        cast(
            v,
            u,
            condition_layer=cl,
            behavior_layers=bl,
            threshold=theta,
            comparator=cmp,
            alpha=alpha,
        ),
        ops,
        {"theta": theta, "scale": alpha},
    )


def spec_truth(w, b: float, layer: int, tokens: str, name: str = "truth_probe") -> Spec:
    which = {
        "generated": lambda c, q: q >= c.P,
        "last_token": last_token,
        "all": lambda c, q: True,
    }[tokens]

    def ops(p):
        def fn(x, ctx):
            pos = [q for q in range(x.shape[0]) if which(ctx, q)]
            ctx.read(name, "truth", pos, sigmoid_probe(x[pos], w, p["bias"]).tolist())

        return [("mlp.post", layer, fn)]

    return Spec(truth_probe(w, b, layer, tokens=tokens, name=name), ops, {"bias": b})


def spec_sake(A, mu_s, mu_t, t: float) -> Spec:
    def ops(p):
        def fn(x, ctx):
            pos = [q for q in range(x.shape[0]) if last_token(ctx, q)]
            dist = (x.double() - mu_s.double()).norm(dim=1)
            ctx.read("sake", "dist", pos, dist[pos].tolist())
            fire = [last_token(ctx, q) and float(dist[q]) <= p["t"] for q in range(x.shape[0])]
            ctx.state["sake_fire"] = fire
            new = (x.double() - mu_s.double()) @ A.double().T + mu_t.double()
            return _rows(x, fire, new)

        return [("final.post", None, fn)]

    return Spec(sake(A, mu_s, mu_t, t), ops, {"t": t})


def spec_kts(u, s, w, b: float, pl: int, layers: list[int], coeff: float, threshold: float) -> Spec:
    def ops(p):
        def read(x, ctx):
            vals = sigmoid_probe(x[: ctx.P], w, b)
            ctx.read("kl_then_steer", "kts_probe", list(range(ctx.P)), vals.tolist())
            ctx.state["kts"] = float(vals.mean()) >= p["threshold"]

        out = [("residual.post", pl, read)]
        for i, l in enumerate(layers):
            out.append(
                (
                    "residual.post",
                    l,
                    ref_add(s[i] * u[i], p["scale"], lambda c, q: c.state["kts"] and q >= c.P - 1),
                )
            )
        return out

    return Spec(
        kl_then_steer(u, s, w, b, probe_layer=pl, layers=layers, coeff=coeff, threshold=threshold),
        ops,
        {"threshold": threshold, "scale": coeff},
    )


def spec_steer_moe(mask: torch.Tensor, moe_layers: list[int], delta: float) -> Spec:
    def ops(p):
        out = []
        for i, l in enumerate(moe_layers):
            m = mask[i]

            def fn(x, ctx, m=m):
                s = torch.log_softmax(x.double(), dim=-1)
                hi = s.max(-1, keepdim=True).values + p["delta"]
                lo = s.min(-1, keepdim=True).values - p["delta"]
                new = torch.where(m > 0, hi, torch.where(m < 0, lo, s))
                return new.to(x.dtype)

            out.append(("router.logits", l, fn))
        return out

    return Spec(steer_moe(mask, delta=delta), ops, {"delta": delta})


# ---------------------------------------------------------------------------- observers
def observers(n_layers: int) -> tuple[xmix.App, xmix.App, Callable, Callable]:
    """Capture apps around the paper apps: "pre" (deployed first) and "post" (deployed last)."""
    pre = xmix.App("pre")
    pre.read("capture").layers([2]).at("residual.pre").named("rp2")
    pre.read("capture").layers([1]).at("residual.post").named("ro1")
    pre.read("capture").at("final.post").named("fin").cond("last_token")
    post = xmix.App("post")
    post.read("capture").layers([2]).at("residual.pre").named("rp2")
    post.read("capture").layers(list(range(n_layers))).at("residual.post").named("ro")
    post.read("capture").at("final.post").named("fin").cond("last_token")

    def pre_ops(p):
        return [
            ("residual.pre", 2, ref_capture("pre", "rp2")),
            ("residual.post", 1, ref_capture("pre", "ro1")),
            ("final.post", None, ref_capture("pre", "fin", last_token)),
        ]

    def post_ops(p):
        return (
            [("residual.pre", 2, ref_capture("post", "rp2"))]
            + [("residual.post", l, ref_capture("post", f"ro.{l}")) for l in range(n_layers)]
            + [("final.post", None, ref_capture("post", "fin", last_token))]
        )

    return pre, post, pre_ops, post_ops


# ============================================================================ environments
@dataclass
class Env:
    kind: str
    llm: Any
    ref: Hooked
    tok: Any
    specs: dict[str, Spec]  # in deployment order
    vanilla: dict = field(default_factory=dict)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def ops(self, apps: list[str], params: dict | None = None) -> list[Op]:
        """The oracle's plan for a request using ``apps``: deployment order, not request order."""
        out = []
        for name, spec in self.specs.items():
            if name in apps:
                out += spec.ops({**spec.params, **((params or {}).get(name, {}))})
        return out


def hf_acts(ref: Hooked, prompts: list[str], tok, site: str, layer, position: str) -> torch.Tensor:
    """Activations at a site straight from the transformers model (no writes)."""
    rows = []
    grab = {}
    ref.set_plan([(site, layer, lambda x, c: grab.__setitem__("x", x.detach().clone()))])
    for p in prompts:
        ids = tok.encode(p)
        ref.forward(ids, len(ids))
        x = grab["x"]
        rows.append(x[-1] if position == "last" else x.double().mean(0).float())
    ref.set_plan([])
    return torch.stack(rows)


def build_specs(ref: Hooked, tok, n_layers: int, moe_layers: list[int]) -> dict[str, Spec]:
    """The seven apps with artifacts derived from the example prompts by the papers' recipes
    (on the transformers model), scaled so that the writes change answers without near-ties."""
    specs: dict[str, Spec] = {}
    rp, rn = lines("refusal_pos"), lines("refusal_neg")
    r = D.mean_difference(
        hf_acts(ref, rp, tok, "residual.pre", 2, "last"),
        hf_acts(ref, rn, tok, "residual.pre", 2, "last"),
    )
    specs["refusal"] = spec_refusal(r, n_layers)
    specs["refusal_add"] = spec_refusal_add(r, 2, 4.0)

    # SEAL: "\n\n" states of a short trace, grouped by the thought that follows (SEAL's keywords)
    trace = (
        "<think> Add the two numbers first.\n\nThe sum is seven.\n\nWait, check the second "
        "number.\n\nAlternatively, count them one by one.\n\nSo the answer is seven.</think>"
    )
    ids = tok.encode(trace)
    grab = {}
    ref.set_plan([("residual.pre", 2, lambda x, c: grab.__setitem__("x", x.clone()))])
    ref.forward(ids, len(ids))
    ref.set_plan([])
    nl = [i for i, t in enumerate(ids) if "\n\n" in tok.decode([t])]
    kinds = ["execution", "reflection", "transition", "execution"]  # the thought after each "\n\n"
    assert len(nl) == 4
    groups = {
        k: torch.stack([grab["x"][i] for i, kk in zip(nl, kinds) if kk == k]) for k in set(kinds)
    }
    S = D.seal_vector(groups["execution"], groups["reflection"], groups["transition"])
    specs["seal"] = spec_seal(S, 2, 6.0 / float(S.norm()), tok)

    cp, cn = lines("cast_pos"), lines("cast_neg")
    v = D.pca_direction(
        hf_acts(ref, cp, tok, "residual.pre", 1, "mean"),
        hf_acts(ref, cn, tok, "residual.pre", 1, "mean"),
    )
    bp = torch.stack([hf_acts(ref, rp, tok, "residual.pre", l, "last") for l in (2, 3)], 1)
    bn = torch.stack([hf_acts(ref, rn, tok, "residual.pre", l, "last") for l in (2, 3)], 1)
    u = D.pca_direction(bp, bn)
    specs["cast"] = spec_cast(v, u, 1, [2, 3], 0.1, ">", 8.0)

    tp, tn = lines("truth_pos"), lines("truth_neg")
    w, b = D.probe_from_sets(
        hf_acts(ref, tp, tok, "mlp.post", 2, "last"), hf_acts(ref, tn, tok, "mlp.post", 2, "last")
    )
    specs["truth_probe"] = spec_truth(w, b, 2, "generated")
    specs["truth_last"] = spec_truth(w, b, 2, "last_token", name="truth_last")

    A, mu_s, mu_t = D.gaussian_transport(
        hf_acts(ref, tp, tok, "final.post", None, "last"),
        hf_acts(ref, tn, tok, "final.post", None, "last"),
        shrinkage=0.5,
    )
    specs["sake"] = spec_sake(A, mu_s, mu_t, 12.0)

    kp = torch.stack([hf_acts(ref, rp, tok, "residual.post", l, "last") for l in (1, 2)], 1)
    kn = torch.stack([hf_acts(ref, rn, tok, "residual.post", l, "last") for l in (1, 2)], 1)
    ku, ks = D.kts_directions(kp, kn)
    kw, kb = D.probe_from_sets(
        hf_acts(ref, rp, tok, "residual.post", 0, "mean"),
        hf_acts(ref, rn, tok, "residual.post", 0, "mean"),
        C=0.05,
    )
    specs["kl_then_steer"] = spec_kts(ku, ks, kw, kb, 0, [1, 2], 3.0, 0.5)

    if moe_layers:
        E = ref.model.config.num_local_experts
        k = ref.model.config.num_experts_per_tok

        def counts(prompts):
            sel, n = [], 0
            for p in prompts:
                ids = tok.encode(p)
                _, ctx = ref.forward(ids, len(ids))
                sel.append(torch.stack([ctx.routing[l] for l in moe_layers], 1))
                n += len(ids)
            return D.expert_counts(torch.cat(sel), E), n

        ref.set_plan([])
        (pc, pn), (nc, nn) = counts(cp), counts(cn)
        mask = D.steer_moe_mask(
            D.routing_difference(pc, pn, nc, nn),
            n_activate=1,
            n_deactivate=1,
            top_k=k,
            per_layer=True,
        )
        specs["steer_moe"] = spec_steer_moe(mask, moe_layers, 0.01)
    return specs


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The oracle's small matmuls run ~50x faster on one thread next to busy engine processes."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


_ORACLES: dict[str, tuple[Any, Hooked, dict[str, Spec], dict]] = {}


def oracle(kind: str) -> tuple[Any, Hooked, dict[str, Spec], dict]:
    """(tokenizer, hooked transformers model, the apps' specs, vanilla-answer cache) of a tiny
    model, built once per session: deriving the artifacts is the costly part of a module."""
    if kind not in _ORACLES:
        from transformers import AutoTokenizer

        path = str(tiny_model_path(kind))
        tok = AutoTokenizer.from_pretrained(path)
        ref = Hooked(path)
        cfg = ref.model.config
        moe = list(range(cfg.num_hidden_layers)) if getattr(cfg, "num_local_experts", 0) else []
        with one_thread():
            specs = build_specs(ref, tok, cfg.num_hidden_layers, moe)
        _ORACLES[kind] = (tok, ref, specs, {})
    return _ORACLES[kind]


def deploy_env(kind: str, config, order: list[str]) -> Env:
    """The apps in ``order`` between the observers, deployed on the session's engine."""
    tok, ref, specs, vanilla_cache = oracle(kind)
    n_layers = ref.model.config.num_hidden_layers
    pre, post, pre_ops, post_ops = observers(n_layers)
    ordered = {"pre": Spec(pre, pre_ops)}
    ordered.update({k: specs[k] for k in order})
    ordered["post"] = Spec(post, post_ops)
    llm = shared_llm(kind, config)
    for spec in ordered.values():
        llm.xmix.deploy(spec.app)
    return Env(kind, llm, ref, tok, ordered, vanilla_cache)


def undeploy_env(env: Env) -> None:
    if env.kind not in _ENGINES:  # released already
        return
    for name in env.specs:
        with contextlib.suppress(Exception):
            env.llm.xmix.undeploy(name)


LLAMA_APPS = [
    "refusal",
    "refusal_add",
    "seal",
    "cast",
    "truth_probe",
    "truth_last",
    "sake",
    "kl_then_steer",
]
MIXTRAL_APPS = ["refusal", "seal", "cast", "truth_probe", "sake", "kl_then_steer", "steer_moe"]


# ============================================================================ running both sides
@dataclass
class Req:
    ids: list[int]
    apps: list[str]
    params: dict | None = None
    allowed: list[int] | None = None


def run_engine(env: Env, reqs: list[Req]):
    from vllm import SamplingParams

    sps = []
    for r in reqs:
        ctl = {"apps": r.apps}
        if r.params:
            ctl["params"] = r.params
        sps.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=G,
                ignore_eos=True,
                allowed_token_ids=r.allowed,
                extra_args={"xmix": ctl} if r.apps else None,
            )
        )
    outs = env.llm.generate([{"prompt_token_ids": r.ids} for r in reqs], sps, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), xmix.results(o)) for o in outs]


def check(env: Env, reqs: list[Req]) -> list[tuple[list[int], dict, dict, Ctx]]:
    """Run ``reqs`` in one engine batch; each must match its own oracle run. Returns
    (tokens, engine reads, oracle reads, oracle context of the last forward) per request."""
    got = run_engine(env, reqs)
    out = []
    for i, (r, (toks, res)) in enumerate(zip(reqs, got)):
        o_toks, o_reads, ctx = env.ref.generate(r.ids, env.ops(r.apps, r.params), G, r.allowed)
        what = f"{env.kind} request {i} apps={r.apps} params={r.params}"
        assert toks == o_toks, f"{what}: tokens {toks} != oracle {o_toks}"
        assert_reads_match(res, o_reads, what, rtol=RTOL, atol=ATOL)
        out.append((toks, res, o_reads, ctx))
    return out


def vanilla(env: Env, ids: list[int], allowed=None) -> list[int]:
    key = (tuple(ids), tuple(allowed or ()))
    if key not in env.vanilla:
        env.vanilla[key] = env.ref.generate(ids, [], G, allowed)[0]
    return env.vanilla[key]


def fired(res: dict, key: str) -> list[bool]:
    """Per position, whether a write changed the site between the "pre" and "post" captures;
    rows where nothing fired must be bit-identical."""
    pre = res["pre"][key]
    post = res["post"][key if key != "ro1" else "ro.1"]
    assert pre["positions"] == post["positions"]
    return [a != b for a, b in zip(pre["values"], post["values"])]


def effect(res: dict, key: str) -> np.ndarray:
    pre = np.asarray(res["pre"][key]["values"], dtype=np.float64)
    post = np.asarray(res["post"][key if key != "ro1" else "ro.1"]["values"], dtype=np.float64)
    return post - pre


OBS = ["pre", "post"]
