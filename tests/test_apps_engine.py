"""The seven paper apps (xmix.apps) on the vLLM CPU engine, against the papers' math.

The oracle here is written in this file from the papers' definitions, on a transformers model
with plain forward hooks (``Hooked``): ablation x - (x·r̂)r̂ at the block input and the attention
and MLP outputs (Arditi et al.); SEAL's add on "\\n\\n" tokens inside <think>…</think>; CAST's
cos(h̄, tanh(P h̄)) on the prompt mean and its latched behaviour add; a logistic probe on
mlp.post (Orgad et al.); SAKE's A(h - mu_s) + mu_t when ||h - mu_s|| <= t; KTS's probe-gated
add at block outputs; SteerMoE's log-softmax rewrite of the router scores before top-k. It does
not use xmix.reference or xmix.integrations.hf. Greedy generation recomputes the whole sequence
each step, so every position sees exactly the writes that the serving semantics give it
(last_token = last prompt token and fed-back generated tokens; latches decided at the last
prompt token; spans opener-inclusive, closer-exclusive; the last generated token never fed back).

Where a write fired is measured on the engine itself: capture apps deployed before ("pre")
and after ("post") the paper apps read the same site around the write, so post - pre is the
write's effect per position (bit-identical rows where it did not fire).

Two engines: tiny-llama hosts #1-#6, tiny-mixtral hosts #7 and then all seven together.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

import xmix
from xmix.apps import cast, derive as D, kl_then_steer, refusal, sake, seal, steer_moe, truth_probe
from xmix.models.tiny import tiny_model_path

from engine_util import hf_model, make_llm, shutdown

pytestmark = pytest.mark.engine

PROMPTS_DIR = Path(__file__).resolve().parents[1] / "examples" / "prompts"
G = 12                       # generated tokens per request
RTOL, ATOL = 1e-4, 1e-5
F64 = torch.float64


def lines(name: str) -> list[str]:
    return [l.strip() for l in (PROMPTS_DIR / f"{name}.txt").read_text(encoding="utf-8").splitlines()
            if l.strip()]


# ============================================================================ shared engines
_ENGINES: dict[str, Any] = {}


def shared_llm(kind: str, config) -> Any:
    """One engine per tiny model for the whole session (test_derive.py reuses tiny-llama's)."""
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
    P: int                                    # prompt length
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
                    self._pre(("residual.mid", l)), with_kwargs=True),
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

    def generate(self, prompt: list[int], ops: list[Op], n: int = G,
                 allowed: list[int] | None = None) -> tuple[list[int], dict, Ctx]:
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
        return seq[len(prompt):], ctx.reads, ctx


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


CMP = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
       "<": lambda a, b: a < b}


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
    params: dict = field(default_factory=dict)   # the app's defaults, overridable per request


def spec_refusal(r: torch.Tensor, n_layers: int) -> Spec:
    def ops(p):
        return [(site, l, ref_ablate(r)) for l in range(n_layers)
                for site in ("residual.pre", "attention.post", "mlp.post")]
    return Spec(refusal(r), ops)


def spec_refusal_add(r: torch.Tensor, layer: int, coeff: float) -> Spec:
    def ops(p):
        return [("residual.pre", layer, ref_add(r, p["scale"]))]
    return Spec(refusal(r, variant="add", layer=layer, coeff=coeff, name="refusal_add"), ops,
                {"scale": coeff})


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
            score = cast_score(x[:ctx.P].double().mean(0), v)
            ctx.read("cast", "cast_sim", [ctx.P - 1], [score])
            ctx.state["cast"] = CMP[cmp](score, p["theta"])

        out = [("residual.pre", cl, read)]
        for i, l in enumerate(bl):
            out.append(("residual.pre", l, ref_add(u[i], p["scale"],
                                                   lambda c, q: c.state["cast"] and q >= c.P - 1)))
        return out
    return Spec(cast(v, u, condition_layer=cl, behavior_layers=bl, threshold=theta, comparator=cmp,
                     alpha=alpha), ops, {"theta": theta, "scale": alpha})


def spec_truth(w, b: float, layer: int, tokens: str, name: str = "truth_probe") -> Spec:
    which = {"generated": lambda c, q: q >= c.P, "last_token": last_token,
             "all": lambda c, q: True}[tokens]

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
            vals = sigmoid_probe(x[:ctx.P], w, b)
            ctx.read("kl_then_steer", "kts_probe", list(range(ctx.P)), vals.tolist())
            ctx.state["kts"] = float(vals.mean()) >= p["threshold"]

        out = [("residual.post", pl, read)]
        for i, l in enumerate(layers):
            out.append(("residual.post", l, ref_add(s[i] * u[i], p["scale"],
                                                    lambda c, q: c.state["kts"] and q >= c.P - 1)))
        return out
    return Spec(kl_then_steer(u, s, w, b, probe_layer=pl, layers=layers, coeff=coeff,
                              threshold=threshold), ops, {"threshold": threshold, "scale": coeff})


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
    pre.read("capture").layers([2]).submodule("residual.pre").named("rp2")
    pre.read("capture").layers([1]).submodule("residual.post").named("ro1")
    pre.read("capture").submodule("final.post").named("fin").cond("last_token")
    post = xmix.App("post")
    post.read("capture").layers([2]).submodule("residual.pre").named("rp2")
    post.read("capture").layers(list(range(n_layers))).submodule("residual.post").named("ro")
    post.read("capture").submodule("final.post").named("fin").cond("last_token")

    def pre_ops(p):
        return [("residual.pre", 2, ref_capture("pre", "rp2")),
                ("residual.post", 1, ref_capture("pre", "ro1")),
                ("final.post", None, ref_capture("pre", "fin", last_token))]

    def post_ops(p):
        return ([("residual.pre", 2, ref_capture("post", "rp2"))]
                + [("residual.post", l, ref_capture("post", f"ro.{l}")) for l in range(n_layers)]
                + [("final.post", None, ref_capture("post", "fin", last_token))])
    return pre, post, pre_ops, post_ops


# ============================================================================ fixtures
@dataclass
class Env:
    kind: str
    llm: Any
    ref: Hooked
    tok: Any
    specs: dict[str, Spec]          # in deployment order
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
    r = D.mean_difference(hf_acts(ref, rp, tok, "residual.pre", 2, "last"),
                          hf_acts(ref, rn, tok, "residual.pre", 2, "last"))
    specs["refusal"] = spec_refusal(r, n_layers)
    specs["refusal_add"] = spec_refusal_add(r, 2, 4.0)

    # SEAL: "\n\n" states of a short trace, grouped by the thought that follows (SEAL's keywords)
    trace = ("<think> Add the two numbers first.\n\nThe sum is seven.\n\nWait, check the second "
             "number.\n\nAlternatively, count them one by one.\n\nSo the answer is seven.</think>")
    ids = tok.encode(trace)
    grab = {}
    ref.set_plan([("residual.pre", 2, lambda x, c: grab.__setitem__("x", x.clone()))])
    ref.forward(ids, len(ids))
    ref.set_plan([])
    nl = [i for i, t in enumerate(ids) if "\n\n" in tok.decode([t])]
    kinds = ["execution", "reflection", "transition", "execution"]  # the thought after each "\n\n"
    assert len(nl) == 4
    groups = {k: torch.stack([grab["x"][i] for i, kk in zip(nl, kinds) if kk == k]) for k in set(kinds)}
    S = D.seal_vector(groups["execution"], groups["reflection"], groups["transition"])
    specs["seal"] = spec_seal(S, 2, 6.0 / float(S.norm()), tok)

    cp, cn = lines("cast_pos"), lines("cast_neg")
    v = D.pca_direction(hf_acts(ref, cp, tok, "residual.pre", 1, "mean"),
                        hf_acts(ref, cn, tok, "residual.pre", 1, "mean"))
    bp = torch.stack([hf_acts(ref, rp, tok, "residual.pre", l, "last") for l in (2, 3)], 1)
    bn = torch.stack([hf_acts(ref, rn, tok, "residual.pre", l, "last") for l in (2, 3)], 1)
    u = D.pca_direction(bp, bn)
    specs["cast"] = spec_cast(v, u, 1, [2, 3], 0.1, ">", 8.0)

    tp, tn = lines("truth_pos"), lines("truth_neg")
    w, b = D.probe_from_sets(hf_acts(ref, tp, tok, "mlp.post", 2, "last"),
                             hf_acts(ref, tn, tok, "mlp.post", 2, "last"))
    specs["truth_probe"] = spec_truth(w, b, 2, "generated")
    specs["truth_last"] = spec_truth(w, b, 2, "last_token", name="truth_last")

    A, mu_s, mu_t = D.gaussian_transport(hf_acts(ref, tp, tok, "final.post", None, "last"),
                                         hf_acts(ref, tn, tok, "final.post", None, "last"),
                                         shrinkage=0.5)
    specs["sake"] = spec_sake(A, mu_s, mu_t, 12.0)

    kp = torch.stack([hf_acts(ref, rp, tok, "residual.post", l, "last") for l in (1, 2)], 1)
    kn = torch.stack([hf_acts(ref, rn, tok, "residual.post", l, "last") for l in (1, 2)], 1)
    ku, ks = D.kts_directions(kp, kn)
    kw, kb = D.probe_from_sets(hf_acts(ref, rp, tok, "residual.post", 0, "mean"),
                               hf_acts(ref, rn, tok, "residual.post", 0, "mean"), C=0.05)
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
        mask = D.steer_moe_mask(D.routing_difference(pc, pn, nc, nn), n_activate=1, n_deactivate=1,
                                top_k=k, per_layer=True)
        specs["steer_moe"] = spec_steer_moe(mask, moe_layers, 0.01)
    return specs


def make_env(kind: str, config, order: list[str]) -> Env:
    from transformers import AutoTokenizer

    path = str(tiny_model_path(kind))
    tok = AutoTokenizer.from_pretrained(path)
    ref = Hooked(path)
    cfg = ref.model.config
    moe = list(range(cfg.num_hidden_layers)) if getattr(cfg, "num_local_experts", 0) else []
    specs = build_specs(ref, tok, cfg.num_hidden_layers, moe)
    pre, post, pre_ops, post_ops = observers(cfg.num_hidden_layers)
    ordered = {"pre": Spec(pre, pre_ops)}
    ordered.update({k: specs[k] for k in order})
    ordered["post"] = Spec(post, post_ops)
    llm = shared_llm(kind, config)
    for spec in ordered.values():
        llm.xmix.deploy(spec.app)
    return Env(kind, llm, ref, tok, ordered)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The oracle's small matmuls run ~50x faster on one thread next to busy engine processes."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def llama(request):
    env = make_env("tiny-llama", request.config,
                   ["refusal", "refusal_add", "seal", "cast", "truth_probe", "truth_last", "sake",
                    "kl_then_steer"])
    yield env
    for name in env.specs:
        with contextlib.suppress(Exception):
            env.llm.xmix.undeploy(name)


@pytest.fixture(scope="module")
def mixtral(request):
    env = make_env("tiny-mixtral", request.config,
                   ["refusal", "seal", "cast", "truth_probe", "sake", "kl_then_steer", "steer_moe"])
    yield env
    release("tiny-mixtral")  # no other module uses it


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
        sps.append(SamplingParams(temperature=0.0, max_tokens=G, ignore_eos=True,
                                  allowed_token_ids=r.allowed,
                                  extra_args={"xmix": ctl} if r.apps else None))
    outs = env.llm.generate([{"prompt_token_ids": r.ids} for r in reqs], sps, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), xmix.results(o)) for o in outs]


def assert_reads(engine: dict, oracle: dict, what: str) -> None:
    assert set(engine) == set(oracle), f"{what}: apps with results {sorted(engine)} != {sorted(oracle)}"
    for app, reads in oracle.items():
        assert set(engine[app]) == set(reads), \
            f"{what}: reads of {app}: {sorted(engine[app])} != {sorted(reads)}"
        for key, o in reads.items():
            e = engine[app][key]
            assert e["positions"] == o["positions"], f"{what}: {app}.{key} positions"
            np.testing.assert_allclose(np.asarray(e["values"], dtype=np.float64),
                                       np.asarray(o["values"], dtype=np.float64),
                                       rtol=RTOL, atol=ATOL, err_msg=f"{what}: {app}.{key}")


def check(env: Env, reqs: list[Req]) -> list[tuple[list[int], dict, dict, Ctx]]:
    """Run ``reqs`` in one engine batch; each must match its own oracle run. Returns
    (tokens, engine reads, oracle reads, oracle context of the last forward) per request."""
    got = run_engine(env, reqs)
    out = []
    for i, (r, (toks, res)) in enumerate(zip(reqs, got)):
        o_toks, o_reads, ctx = env.ref.generate(r.ids, env.ops(r.apps, r.params), G, r.allowed)
        what = f"{env.kind} request {i} apps={r.apps} params={r.params}"
        assert toks == o_toks, f"{what}: tokens {toks} != oracle {o_toks}"
        assert_reads(res, o_reads, what)
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


# ============================================================================ #1 refusal
def test_refusal_ablation_and_addition(llama):
    """Arditi et al.: with r̂ projected out at every block input, attention output and MLP
    output, no block output keeps a component along r̂; adding r at one layer shifts every
    token by exactly coeff·r there."""
    env = llama
    r = env.specs["refusal"].app.ops[0].artifacts["direction"].double()
    u = r / r.norm()
    prompts = lines("refusal_pos")[:3] + lines("refusal_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [Req(ids, ["pre", "refusal", "post"]), Req(ids, ["pre", "refusal_add", "post"]),
                 Req(ids, ["pre", "post"])]
    res = check(env, reqs)
    changed = 0
    for i in range(0, len(reqs), 3):
        (t_abl, e_abl, _, _), (t_add, e_add, _, _), (t_van, e_van, _, _) = res[i:i + 3]
        assert t_van == vanilla(env, reqs[i].ids)
        for l in range(4):
            x = np.asarray(e_abl["post"][f"ro.{l}"]["values"])
            xv = np.asarray(e_van["post"][f"ro.{l}"]["values"])
            proj, proj_v = np.abs(x @ u.numpy()), np.abs(xv @ u.numpy())
            assert proj.max() < 1e-4 * np.linalg.norm(x, axis=1).max(), f"layer {l}: {proj.max()}"
            assert proj_v.max() > 0.1
        eff = effect(e_add, "rp2")
        np.testing.assert_allclose(eff, np.broadcast_to(4.0 * r.numpy(), eff.shape), rtol=RTOL, atol=1e-4)
        changed += (t_abl != t_van) + (t_add != t_van)
    assert changed >= 3, "the refusal writes should change some answers"


# ============================================================================ #2 SEAL
def test_seal_fires_on_separators_inside_think(llama):
    env = llama
    tok = env.tok
    nl2 = tok.encode("\n\n", add_special_tokens=False)
    assert len(nl2) == 1
    nl2 = nl2[0]
    separators = {i for i in range(len(tok)) if "\n\n" in tok.decode([i])}  # SEAL's "\n\n" tokens
    think, unthink = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" the", " so", " we")]
    cases = [
        # separators before, inside and after a closed thought in the prompt; a thought opened
        # at the end, closed by the first generated token, then separators outside it
        ("Question: what is two plus two?\n\n<think> Add them.\n\nThe sum is four.</think>\n\nSo"
         " the answer:\n\n<think> Check", [nl2, unthink, tok.encode(".", add_special_tokens=False)[0]]),
        # a thought open at the end of the prompt: generated separators inside it (steered, so
        # the next steps differ), then </think> and separators after it
        ("<think> Let me think.\n\nOk", [nl2, unthink]),
        # no thought in the prompt; generation may open and close one
        ("One line.\n\nAnother line.\n\nThe end", [nl2, think, unthink] + words),
        ("Plan the trip.\n\n<think> First the train", None),
    ]
    reqs = [Req(env.ids(p), ["pre", "seal", "post"], allowed=a) for p, a in cases]
    res = check(env, reqs)
    S = env.specs["seal"].app.ops[0].artifacts["vector"].double().numpy()
    coeff = env.specs["seal"].params["scale"]
    seen = {"prompt_in": 0, "prompt_out": 0, "gen_in": 0, "gen_out": 0}
    for r, (toks, eng, _, ctx) in zip(reqs, res):
        seq = r.ids + toks[:-1]
        span = think_spans(seq, think, unthink)
        want = [t in separators and s for t, s in zip(seq, span)]
        assert fired(eng, "rp2") == want, f"SEAL fired on the wrong tokens of {tok.decode(seq)!r}"
        eff = effect(eng, "rp2")
        for p, w in enumerate(want):
            if w:
                np.testing.assert_allclose(eff[p], coeff * S, rtol=RTOL, atol=1e-4)
            if seq[p] in separators:
                seen[("gen_" if p >= len(r.ids) else "prompt_") + ("in" if span[p] else "out")] += 1
    # the batch covers separators in and out of a thought, in the prompt and generated
    assert all(n > 0 for n in seen.values()), seen
    assert any(toks != vanilla(env, r.ids, r.allowed) for r, (toks, *_) in zip(reqs, res))


# ============================================================================ #3 CAST
def test_cast_latch_on_prompt_mean(llama):
    env = llama
    spec = env.specs["cast"]
    v = spec.app.ops[0].artifacts["vector"]
    u = spec.app.ops[1].artifacts["vector"].double()
    prompts = lines("cast_pos")[:4] + lines("cast_neg")[:4]
    # one prompt longer than the engine's 64-token prefill chunk: the mean spans chunks
    prompts.append(" ".join(lines("cast_pos")[4:12]))
    ids = [env.ids(p) for p in prompts]
    assert len(ids[-1]) > 64
    scores = []
    for x in ids:
        grab = {}
        env.ref.set_plan([("residual.pre", 1, lambda h, c: grab.__setitem__("x", h.clone()))])
        env.ref.forward(x, len(x))
        scores.append(cast_score(grab["x"].double().mean(0), v))
    env.ref.set_plan([])
    # θ in the widest gap near the middle of the scores: prompts on both sides, no near-tie
    srt = sorted(scores)
    gaps = [(srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(2, len(srt) - 3)]
    gap, theta = max(gaps)
    assert gap > 1e-3
    reqs = [Req(x, ["pre", "cast", "post"], {"cast": {"theta": theta}}) for x in ids]
    res = check(env, reqs)
    n_fire = 0
    for x, s, (toks, eng, _, _) in zip(ids, scores, res):
        assert eng["cast"]["cast_sim"]["positions"] == [len(x) - 1]
        assert eng["cast"]["cast_sim"]["values"][0] == pytest.approx(s, rel=RTOL, abs=ATOL)
        latch = s > theta
        want = [latch and p >= len(x) - 1 for p in range(len(x) + G - 1)]
        assert fired(eng, "rp2") == want
        if latch:
            eff = effect(eng, "rp2")[len(x) - 1:]
            np.testing.assert_allclose(eff, np.broadcast_to(8.0 * u[0].numpy(), eff.shape),
                                       rtol=RTOL, atol=1e-4)
            assert toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += latch
    assert 0 < n_fire < len(ids)


def test_cast_behaviour_layers_around_the_condition(llama):
    """CAST with behaviour layers before, at and after its condition layer (1, 2, 3; the
    condition at residual.pre of 2): after it, steering from the last prompt token; at or
    before it, from the first generated token, once the prompt mean is known (CAST's hooks
    steer layers before c from the first generated token)."""
    env = llama
    base = env.specs["cast"]
    v = base.app.ops[0].artifacts["vector"]
    u2 = base.app.ops[1].artifacts["vector"]
    U = torch.stack([u2[1], u2[0], u2[1]])  # behaviour vectors of layers 1, 2, 3
    layers, cl, alpha, name = [1, 2, 3], 2, 8.0, "cast_around"
    prompts = lines("cast_pos")[:4] + lines("cast_neg")[:4]
    ids = [env.ids(p) for p in prompts]
    scores = []
    for x in ids:  # the prompt mean at the condition site; writes on generated tokens cannot
        grab = {}  # reach prompt positions (causal attention), so a vanilla pass gives it
        env.ref.set_plan([("residual.pre", cl, lambda h, c: grab.__setitem__("x", h.clone()))])
        env.ref.forward(x, len(x))
        scores.append(cast_score(grab["x"].double().mean(0), v))
    env.ref.set_plan([])
    srt = sorted(scores)
    gap, theta = max((srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(1, len(srt) - 2))
    assert gap > 1e-3
    latch = {tuple(x): s > theta for x, s in zip(ids, scores)}

    def ops(p):
        def read(x, ctx):
            ctx.read(name, "cast_sim", [ctx.P - 1], [cast_score(x[:ctx.P].double().mean(0), v)])

        out = [("residual.pre", cl, read)]
        for i, l in enumerate(layers):
            start = 0 if l <= cl else 1  # from position P, or from P - 1
            out.append(("residual.pre", l, ref_add(
                U[i], p["scale"], lambda c, q, s=start: latch[tuple(c.ids[:c.P])] and q >= c.P - s)))
        return out

    spec = Spec(cast(v, U, condition_layer=cl, behavior_layers=layers, threshold=theta,
                     comparator=">", alpha=alpha, name=name), ops, {"theta": theta, "scale": alpha})
    # deployed between the observers, so "post" sees its write at residual.pre of layer 2
    post = env.specs["post"]
    env.llm.xmix.undeploy("post")
    env.llm.xmix.deploy(spec.app)
    env.llm.xmix.deploy(post.app)
    specs = {k: v for k, v in env.specs.items() if k != "post"}
    env2 = Env(env.kind, env.llm, env.ref, env.tok, {**specs, name: spec, "post": post}, env.vanilla)
    try:
        res = check(env2, [Req(x, ["pre", name, "post"]) for x in ids])
    finally:
        env.llm.xmix.undeploy(name)
    n_fire = changed = 0
    for x, s, (toks, eng, _, _) in zip(ids, scores, res):
        P, on = len(x), latch[tuple(x)]
        assert eng[name]["cast_sim"]["positions"] == [P - 1]
        assert eng[name]["cast_sim"]["values"][0] == pytest.approx(s, rel=RTOL, abs=ATOL)
        # at the condition's own site the write starts at the first generated token
        assert fired(eng, "rp2") == [on and q >= P for q in range(P + G - 1)]
        if on:
            eff = effect(eng, "rp2")[P:]
            np.testing.assert_allclose(eff, np.broadcast_to(alpha * U[1].double().numpy(), eff.shape),
                                       rtol=RTOL, atol=1e-4)
            changed += toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += on
    assert 0 < n_fire < len(ids) and changed >= 1


# ============================================================================ #4 truth probe
def test_truth_probe_scores(llama):
    env = llama
    prompts = lines("truth_pos")[:3] + lines("truth_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [Req(ids, ["truth_probe"]), Req(ids, ["truth_last", "refusal"])]
    res = check(env, reqs)
    for r, (toks, eng, _, _) in zip(reqs, res):
        P = len(r.ids)
        if "truth_probe" in r.apps:
            assert eng["truth_probe"]["truth"]["positions"] == list(range(P, P + G - 1))
            assert toks == vanilla(env, r.ids)   # a read does not change the answer
        else:
            assert eng["truth_last"]["truth"]["positions"] == list(range(P - 1, P + G - 1))


# ============================================================================ #5 SAKE
def test_sake_edits_only_within_distance(llama):
    env = llama
    spec = env.specs["sake"]
    prompts = lines("truth_pos")[3:6] + lines("cast_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        # t between distances the unedited run sees, such that the edited run (whose later
        # distances move) has steps on both sides and none within 0.1 % of t
        _, reads, _ = env.ref.generate(ids, spec.ops({"t": -1.0}), G)
        d = sorted(reads["sake"]["dist"]["values"])
        for _, t in sorted(((d[i + 1] - d[i], (d[i] + d[i + 1]) / 2) for i in range(len(d) - 1)),
                           reverse=True):
            _, edited, _ = env.ref.generate(ids, spec.ops({"t": t}), G)
            de = edited["sake"]["dist"]["values"]
            if min(abs(x - t) for x in de) > 1e-3 * t and min(de) < t < max(de):
                break
        else:
            pytest.fail(f"no clear threshold for {p!r}")
        reqs.append(Req(ids, ["pre", "sake", "post"], {"sake": {"t": t}}))
    res = check(env, reqs)
    A, mu_s, mu_t = (spec.app.ops[1].artifacts[k].double().numpy() for k in ("matrix", "mu_s", "mu_t"))
    both = changed = 0
    for r, (toks, eng, o_reads, ctx) in zip(reqs, res):
        t = r.params["sake"]["t"]
        dist = eng["sake"]["dist"]["values"]
        assert eng["sake"]["dist"]["positions"] == list(range(len(r.ids) - 1, len(r.ids) + G - 1))
        assert min(abs(x - t) for x in dist) > 1e-3 * t, "a distance at the threshold"
        want = [x <= t for x in dist]
        assert fired(eng, "fin") == want
        h = np.asarray(eng["pre"]["fin"]["values"], dtype=np.float64)
        edited = np.asarray(eng["post"]["fin"]["values"], dtype=np.float64)
        for k in np.nonzero(want)[0]:
            np.testing.assert_allclose(edited[k], (h[k] - mu_s) @ A.T + mu_t, rtol=RTOL, atol=1e-4)
        both += any(want) and not all(want)
        changed += toks != vanilla(env, r.ids)
    assert both >= 3 and changed >= 1


# ============================================================================ #6 KL-then-steer
def test_kts_latch(llama):
    env = llama
    spec = env.specs["kl_then_steer"]
    prompts = lines("refusal_pos")[6:10] + lines("refusal_neg")[6:10]
    ids = [env.ids(p) for p in prompts]
    means = []
    for x in ids:
        _, reads, _ = env.ref.generate(x, spec.ops({**spec.params, "threshold": 2.0}), 1)
        means.append(float(np.mean(reads["kl_then_steer"]["kts_probe"]["values"])))
    srt = sorted(means)
    gap, theta = max((srt[i + 1] - srt[i], (srt[i] + srt[i + 1]) / 2) for i in range(1, len(srt) - 2))
    assert gap > 1e-4
    reqs = [Req(x, ["pre", "kl_then_steer", "post"], {"kl_then_steer": {"threshold": theta}}) for x in ids]
    res = check(env, reqs)
    add = spec.app.ops[1].artifacts["vector"][0].double().numpy() * spec.params["scale"]  # c·s_1·û_1
    n_fire = 0
    for x, m, (toks, eng, _, _) in zip(ids, means, res):
        assert eng["kl_then_steer"]["kts_probe"]["positions"] == list(range(len(x)))
        latch = m >= theta
        assert fired(eng, "ro1") == [latch and p >= len(x) - 1 for p in range(len(x) + G - 1)]
        if latch:
            eff = effect(eng, "ro1")[len(x) - 1:]
            np.testing.assert_allclose(eff, np.broadcast_to(add, eff.shape), rtol=RTOL, atol=1e-4)
            assert toks != vanilla(env, x)
        else:
            assert toks == vanilla(env, x)
        n_fire += latch
    assert 0 < n_fire < len(ids)


# ============================================================================ #7 SteerMoE
def test_steer_moe_changes_routing(mixtral):
    env = mixtral
    spec = env.specs["steer_moe"]
    mask = spec.app.ops[0].artifacts["mask"]
    prompts = lines("cast_pos")[:3] + lines("cast_neg")[:3]
    reqs = []
    for p in prompts:
        ids = env.ids(p)
        reqs += [Req(ids, ["steer_moe", "post"]), Req(ids, ["post"])]
    res = check(env, reqs)
    changed = 0
    for i in range(0, len(reqs), 2):
        (t_s, e_s, _, ctx_s), (t_v, e_v, _, ctx_v) = res[i], res[i + 1]
        for l in range(mask.shape[0]):
            on = [int(e) for e in (mask[l] > 0).nonzero().flatten()]
            off = [int(e) for e in (mask[l] < 0).nonzero().flatten()]
            sel = ctx_s.routing[l]
            assert all(bool((sel == e).any(-1).all()) for e in on)
            assert not any(bool((sel == e).any()) for e in off)
        moved = sum(not torch.equal(ctx_s.routing[l].sort(-1).values, ctx_v.routing[l].sort(-1).values)
                    for l in range(mask.shape[0]))
        assert moved > 0
        # the served stream follows the steered routing, not the vanilla one
        x_s = np.asarray(e_s["post"]["ro.3"]["values"])
        x_v = np.asarray(e_v["post"]["ro.3"]["values"])
        assert np.abs(x_s - x_v).max() > 1e-2
        changed += t_s != t_v
    assert changed >= 1


# ============================================================================ all seven, one engine
def test_all_seven_on_one_engine(mixtral):
    """tiny-mixtral hosts the seven apps; one batch, every request a different subset, each
    matching the oracle that composes its apps in deployment order."""
    env = mixtral
    p_think = env.ids("Think first.\n\n<think> The numbers are two and three.\n\nAdd them")
    base = [env.ids(p) for p in lines("cast_pos")[:4] + lines("refusal_pos")[:4] + lines("truth_neg")[:4]]
    subsets = [
        [], ["refusal"], ["seal"], ["cast"], ["truth_probe"], ["sake"], ["kl_then_steer"],
        ["steer_moe"], ["refusal", "truth_probe"], ["seal", "cast", "sake"],
        ["kl_then_steer", "steer_moe", "truth_probe"],
        ["refusal", "seal", "cast", "truth_probe", "sake", "kl_then_steer", "steer_moe"],
        ["steer_moe", "refusal", "post"],
    ]
    # the request with all seven makes every conditional write fire (latches on, SAKE in scope)
    everything = {"cast": {"theta": -1.0}, "sake": {"t": 1e3}, "kl_then_steer": {"threshold": 0.0}}
    reqs = []
    for i, apps in enumerate(subsets):
        ids = p_think if "seal" in apps else base[i % len(base)]
        reqs.append(Req(ids, apps, everything if len(apps) == 7 else None))
    res = check(env, reqs)
    assert sum(toks != vanilla(env, r.ids) for r, (toks, *_) in zip(reqs, res)) >= 5
    assert res[0][1] == {}
    states = [ctx.state for *_, ctx in res]
    assert {s["cast"] for s in states if "cast" in s} == {True, False}
    assert {s["kts"] for s in states if "kts" in s} == {True, False}
    assert {any(s["sake_fire"]) for s in states if "sake_fire" in s} == {True, False}
    full = states[subsets.index(max(subsets, key=len))]
    assert full["cast"] and full["kts"] and any(full["sake_fire"])


def test_derive_steer_moe_matches_the_routing(mixtral, tmp_path):
    """``xmix derive steer_moe`` on this engine: routing recomputed from the captured router
    input gives the same expert counts as the transformers router, hence the same mask."""
    from xmix.apps import derive_cli as DC

    out = tmp_path / "moe.xmix"
    rc = DC.main(["steer_moe", "--model", "tiny-mixtral", "--positive", str(PROMPTS_DIR / "cast_pos.txt"),
                  "--negative", str(PROMPTS_DIR / "cast_neg.txt"), "--n-activate", "1",
                  "--n-deactivate", "1", "--per-layer", "--out", str(out), "--quiet"], llm=mixtral.llm)
    assert rc == 0
    app = xmix.App.load(out)
    want = mixtral.specs["steer_moe"].app.ops[0].artifacts["mask"]
    torch.testing.assert_close(app.ops[0].artifacts["mask"], want)
    meta = app.metadata
    assert meta["top_k"] == 2 and meta["moe_layers"] == [0, 1, 2, 3]
    n_tok = sum(len(mixtral.tok.encode(p)) for p in lines("cast_pos"))
    assert meta["counts"]["positive_tokens"] == n_tok
