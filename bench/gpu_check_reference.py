"""The oracle of bench/gpu_check.py: what each check case's app does to one step of the
decoder, written out by hand per case over xmix.lang.reference's PyTorch primitives.

The check compares its CUDA graph kinds with each other and with eager execution; all of those
run xmix's kernels, so a kernel that is wrong the same way everywhere would pass them. The
reference decoder runs the same model with these functions at the hook sites instead of
``torch.ops.xmix.site``, and its outputs and reads are what eager execution must match.

Each case is written here again from its definition in gpu_check.check_cases (the app objects
are read only for their artifacts and parameters, never for what they mean), with the
documented semantics (python/xmix/lang/conditions.py): ``last_token`` is every token whose logits
are sampled (the last prompt token and generated tokens); a latch is decided at the request's
last prompt token and, for an op at a later site than its read, holds from that token on; a
CAST read reports once, at the last prompt token, from the mean over the request's prompt;
every step of the check admits fresh requests, so no span or latch state carries over.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from xmix.lang import reference as ref


@dataclass
class Tokens:
    """Per token of a step: request index, position, prompt length, token id, and whether
    its request uses the case's app."""

    req: list[int]
    pos: list[int]
    plen: list[int]
    ids: list[int]
    uses: list[bool]

    @property
    def n(self) -> int:
        return len(self.req)

    def mask(self, pred: Callable[[int], bool], device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows of requests that use the app where ``pred`` holds."""
        sel = [self.uses[t] and pred(t) for t in range(self.n)]
        return torch.tensor(sel, dtype=torch.bool, device=device)

    def prompt(self, t: int) -> bool:
        return self.pos[t] < self.plen[t]

    def generated(self, t: int) -> bool:
        return self.pos[t] >= self.plen[t]

    def last(self, t: int) -> bool:  # sampled this step
        return self.pos[t] >= self.plen[t] - 1

    def last_prompt(self, t: int) -> bool:
        return self.pos[t] == self.plen[t] - 1


def tokens(rows, ids: torch.Tensor, mode: str, app: str) -> Tokens:
    """rows: gpu_check.mixed_rows' (n_tokens, start, prompt_len, apps) per request."""
    req, pos, plen, uses = [], [], [], []
    for i, (n, start, pl, apps) in enumerate(rows):
        on = mode == "all" or (mode == "request" and app in apps)
        for k in range(n):
            req.append(i)
            pos.append(start + k)
            plen.append(pl)
            uses.append(on)
    return Tokens(req, pos, plen, [int(x) for x in ids[: len(req)].tolist()], uses)


@dataclass
class Step:
    """One step of one case: the token table, the app's parameters for it, the reads the
    reference produced ({key: {request index: {position: value or vector}}})."""

    tok: Tokens
    params: dict[str, float]
    reads: dict[str, dict[int, dict[int, object]]] = field(default_factory=dict)

    def note(self, key: str, t: int, value) -> None:
        self.reads.setdefault(key, {}).setdefault(self.tok.req[t], {})[self.tok.pos[t]] = value


def _art(app, i: int, name: str) -> torch.Tensor:
    return app.ops[i].artifacts[name].float()


def _param(app, i: int, name: str) -> float:
    return float(app.ops[i].params[name])


def _on(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return t.to(h.device)


SiteFn = Callable[[Step, torch.Tensor, "torch.Tensor | None"], None]


class CaseReference:
    """The reference of one case: per (site, layer), what runs there, in the site's op order.
    A site function changes h in place (as the kernel does) and notes its reads."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, int], list[SiteFn]] = {}

    def at(self, site: str, layer: int, fn: SiteFn) -> None:
        self.sites.setdefault((site, layer), []).append(fn)

    def run(self, step: Step, site: str, layer: int, h, r) -> None:
        for fn in self.sites.get((site, layer), ()):
            fn(step, h, r)


def _span(st: Step, open_ids: set[int], close_ids: set[int]) -> list[bool]:
    """in_span per token, each request's tokens scanned in order from a closed span."""
    flags = [False] * st.tok.n
    by_req: dict[int, list[int]] = {}
    for t in range(st.tok.n):
        by_req.setdefault(st.tok.req[t], []).append(t)
    for ts in by_req.values():
        f, _ = ref.span_flags([st.tok.ids[t] for t in ts], open_ids, close_ids)
        for t, v in zip(ts, f):
            flags[t] = v
    return flags


def _add_case(app, site: str, layer: int, cond: Callable[[Step, int], bool]) -> CaseReference:
    c = CaseReference()
    v, s = _art(app, 0, "vector"), _param(app, 0, "scale")

    def fn(st: Step, h, r):
        m = st.tok.mask(lambda t: cond(st, t), h.device)
        h.copy_(ref.add(h, r, m, _on(v, h), s))

    c.at(site, layer, fn)
    return c


def _note_all(st: Step, key: str, values: torch.Tensor, pred=lambda t: True) -> None:
    for t in range(st.tok.n):
        if st.tok.uses[t] and pred(t):
            st.note(key, t, float(values[t]))


def build(name: str, app, n_layers: int) -> CaseReference:
    """The reference of gpu_check.check_cases' case ``name`` (its app passed for the data)."""
    mid = n_layers // 2
    l1, l2 = min(1, n_layers - 1), min(2, n_layers - 1)
    tok_set, open_set, close_set = {7, 14, 21}, {7}, {21}
    everyone = lambda t: True  # noqa: E731
    if name == "add_all":
        return _add_case(app, "residual.pre", mid, lambda st, t: True)
    if name == "add_last_token":
        return _add_case(app, "residual.pre", mid, lambda st, t: st.tok.last(t))
    if name == "add_prompt":
        return _add_case(app, "residual.pre", mid, lambda st, t: st.tok.prompt(t))
    if name == "add_generated":
        return _add_case(app, "attention.post", mid, lambda st, t: st.tok.generated(t))
    if name == "add_token_in":
        return _add_case(app, "mlp.post", mid, lambda st, t: st.tok.ids[t] in tok_set)
    if name == "add_in_span":
        return _add_case(app, "residual.pre", mid, lambda st, t: _span(st, open_set, close_set)[t])

    c = CaseReference()
    if name == "ablate_all_layers":
        u = _art(app, 0, "direction")

        def abl(st, h, r):
            h.copy_(ref.ablate(h, r, st.tok.mask(everyone, h.device), _on(u, h)))

        for layer in range(n_layers):
            c.at("residual.pre", layer, abl)
    elif name == "clamp_not_last":
        u = _art(app, 0, "direction")
        lo, hi = _param(app, 0, "min"), _param(app, 0, "max")

        def clamp(st, h, r):
            m = st.tok.mask(lambda t: not st.tok.last(t), h.device)
            h.copy_(ref.clamp(h, r, m, _on(u, h), lo, hi))

        c.at("mlp.post", mid, clamp)
    elif name == "affine_last":
        A, ms, mt = (_art(app, 0, k) for k in ("matrix", "mu_s", "mu_t"))

        def affine(st, h, r):
            m = st.tok.mask(st.tok.last, h.device)
            h.copy_(ref.affine(h, r, m, _on(A, h), _on(ms, h), _on(mt, h)))

        c.at("residual.pre", mid, affine)
    elif name == "probe_reads":
        layers = sorted({l1, mid})
        w, b = _art(app, 0, "weight"), _param(app, 0, "bias")
        for layer in layers:
            key = f"p.{layer}" if len(layers) > 1 else "p"

            def probe(st, h, r, key=key):
                _note_all(st, key, ref.probe(ref.stream(h, r), _on(w, h), b))

            c.at("residual.pre", layer, probe)
    elif name == "capture_last":

        def cap(st, h, r):
            x = ref.stream(h, r)
            for t in range(st.tok.n):
                if st.tok.uses[t] and st.tok.last(t):
                    st.note("cap", t, x[t, 0:16].cpu())

        c.at("mlp.post", mid, cap)
    elif name == "distance_read":
        mu = _art(app, 0, "centroids")

        def dist(st, h, r):
            _note_all(st, "dist", ref.distance(ref.stream(h, r), _on(mu, h)))

        c.at("attention.post", mid, dist)
    elif name == "cosine_prompt":
        v = _art(app, 0, "vector")

        def cos(st, h, r):
            x = ref.stream(h, r)
            for t in range(st.tok.n):
                if not (st.tok.uses[t] and st.tok.last_prompt(t)):
                    continue
                prompt = [
                    u
                    for u in range(st.tok.n)
                    if st.tok.req[u] == st.tok.req[t] and st.tok.prompt(u)
                ]
                st.note("cast", t, float(ref.cast_cosine(x[prompt].mean(dim=0), _on(v, h))))

        c.at("residual.pre", l2, cos)
    elif name in ("gated_write", "latched_ablate"):
        w = _art(app, 0, "weight")
        p_of: list[float] = []  # this step's p per token (NaN where the app is not used)

        def read_p(st, h, r):
            p = ref.probe(ref.stream(h, r), _on(w, h), 0.0)
            p_of[:] = [float(p[t]) if st.tok.uses[t] else math.nan for t in range(st.tok.n)]
            _note_all(st, "p", p)

        c.at("residual.pre", l1, read_p)
        if name == "gated_write":
            v, s = _art(app, 1, "vector"), _param(app, 1, "scale")

            def gated(st, h, r):
                theta = st.params["theta"]
                m = st.tok.mask(lambda t: ref.compare(p_of[t], ">=", theta), h.device)
                h.copy_(ref.add(h, r, m, _on(v, h), s))

            c.at("mlp.post", mid, gated)
        else:
            u = _art(app, 1, "direction")

            def latched(st, h, r):
                theta = st.params["theta"]
                # prompt_last(p): p at the request's last prompt token, where that token is in
                # this step (fresh requests: otherwise the latch is undecided, false); the
                # ablation sits at a later site than the read, so it holds from that token on
                last_p = {st.tok.req[t]: p_of[t] for t in range(st.tok.n) if st.tok.last_prompt(t)}

                def sel(t):
                    lp = last_p.get(st.tok.req[t])
                    latch = lp is not None and st.tok.last(t) and ref.compare(lp, ">=", theta)
                    return latch or ref.compare(p_of[t], ">=", theta)

                h.copy_(ref.ablate(h, r, st.tok.mask(sel, h.device), _on(u, h)))

            c.at("mlp.post", mid, latched)
    elif name == "three_ops_one_site":
        wq = _art(app, 0, "weight")
        v, s = _art(app, 1, "vector"), _param(app, 1, "scale")
        u = _art(app, 2, "direction")

        def three(st, h, r):
            # site order: the read sees the stream before the add; the gate reads it
            q = ref.probe(ref.stream(h, r), _on(wq, h), 0.0)
            _note_all(st, "q", q)
            h.copy_(ref.add(h, r, st.tok.mask(everyone, h.device), _on(v, h), s))
            gate = st.tok.mask(lambda t: ref.compare(float(q[t]), ">=", 0.5), h.device)
            h.copy_(ref.ablate(h, r, gate, _on(u, h)))

        c.at("attention.post", mid, three)
    elif name == "custom_write":
        a = _art(app, 0, "artifact")

        def user(st, h, r):
            # the user kernel (gpu_check.CUSTOM_CPU / CUSTOM_CUDA): h[t][i] += k * a[i % n]
            # on the generated tokens of requests that use the app
            k = _param(app, 0, "k")
            reps = math.ceil(h.shape[1] / a.numel())
            add = k * _on(a, h).repeat(reps)[: h.shape[1]]
            h.copy_(ref.written(h, h.float() + add, st.tok.mask(st.tok.generated, h.device)))

        c.at("mlp.post", mid, user)
    else:
        raise KeyError(f"no reference for case {name!r}")
    return c
