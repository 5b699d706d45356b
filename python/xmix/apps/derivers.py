"""One recipe per app for ``xmix derive``: which prompts to collect where, the math of
``xmix.apps.derive`` on the activations, and the app (with its metadata) that results.

Each ``derive_<app>(args, llm)`` takes the parsed command line (``derive_cli.build_parser``)
and a running engine; ``DERIVERS`` maps the app key to its recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from xmix.apps import derive as D
from xmix.apps.collect import (
    DeriveError,
    collect_activations,
    encode,
    model_shape,
    read_prompts,
    read_traces,
)
from xmix.lang.api import App


def _one_layer(args, default: int, what: str = "--layer") -> int:
    layers = args.layer
    if layers is None:
        return default
    if len(layers) != 1:
        raise DeriveError(f"{args.app} takes one {what}, got {layers}")
    return layers[0]


def _relative_layer(n_layers: int, fraction: float) -> int:
    return max(0, min(n_layers - 1, int(fraction * n_layers + 0.5)))


def _paper_default(table: dict, model: str, key: str):
    from xmix.apps._common import model_defaults

    return model_defaults(table, model).get(key)


def _files(args, **extra) -> dict:
    out = {"positive": str(args.positive), "negative": str(args.negative)}
    out.update({k: str(v) for k, v in extra.items() if v is not None})
    return out


def _meta(args, shape, method: str, files: dict, counts: dict, **more) -> dict:
    """What every derived app records besides the factory's metadata."""
    meta = {
        "model": args.model,
        "model_path": args.model_path,
        "hidden_size": shape.hidden_size,
        "n_layers": shape.n_layers,
        "method": method,
        "prompt_files": files,
        "counts": counts,
        "chat_template": bool(args.chat),
        "derived_with": "xmix derive " + args.app,
    }
    meta.update(more)
    return meta


def _collect(args, llm, prompts, desc, **kw):
    return collect_activations(
        llm,
        prompts,
        chat=args.chat,
        batch_size=args.batch_size,
        progress=not args.quiet,
        desc=desc,
        **kw,
    )


# ---------------------------------------------------------------------------- the apps
def derive_refusal(args, llm) -> App:
    """Arditi et al.: r = mean(harmful) - mean(harmless) of residual.pre at one layer, at the
    last (post-instruction) token; ablated at every layer or added at that layer."""
    from xmix.apps import refusal
    from xmix.apps.refusal import DEFAULTS

    shape = model_shape(llm)
    default = _paper_default(DEFAULTS, args.model, "layer")
    layer = _one_layer(
        args, default if default is not None else _relative_layer(shape.n_layers, 0.375)
    )
    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    hp = _collect(args, llm, pos, "refusal: harmful", layers=[layer], position=args.position)
    hn = _collect(args, llm, neg, "refusal: harmless", layers=[layer], position=args.position)
    r = D.mean_difference(hp[:, 0], hn[:, 0])
    meta = _meta(
        args,
        shape,
        "difference of means (Arditi et al. 2024)",
        _files(args),
        {"positive": len(pos), "negative": len(neg)},
        site="residual.pre",
        direction_layer=layer,
        position=args.position,
        direction_norm=float(r.norm()),
    )
    if args.variant == "add":
        return refusal(
            r,
            variant="add",
            layer=layer,
            coeff=args.coeff,
            model=args.model,
            name=args.name,
            metadata=meta,
        )
    return refusal(r, model=args.model, name=args.name, metadata=meta)


def derive_cast(args, llm) -> App:
    """CAST (Lee et al.): condition vector = first PC of paired prompt means at the condition
    layer; θ and the comparator by CAST's grid search of F1 over cos(h̄, tanh(P h̄)); with
    several condition layers, the best F1 wins (CAST's layer search). Behaviour vectors = first
    PC of paired behaviour examples (last token) at each behaviour layer."""
    from xmix.apps import cast
    from xmix.apps.cast import DEFAULTS

    shape = model_shape(llm)
    b_layers = args.behavior_layers or _paper_default(DEFAULTS, args.model, "behavior_layers")
    c_layers = args.condition_layer
    if c_layers is None:
        c = _paper_default(DEFAULTS, args.model, "condition_layer")
        c_layers = [c] if c is not None else None
    if b_layers is None or c_layers is None:
        raise DeriveError(
            "cast needs --condition-layer C [C ...] and --behavior-layers B [B ...] "
            "(defaults exist only for the paper's models)"
        )
    early = [c for c in c_layers if c >= min(b_layers)]
    if early:
        raise DeriveError(
            f"condition layer(s) {early} are not before the first behaviour layer "
            f"{min(b_layers)}: the condition is a latch decided on the prompt and may "
            f"only steer later sites"
        )
    if not (args.behavior_positive and args.behavior_negative):
        raise DeriveError(
            "cast needs --behavior-positive and --behavior-negative: paired examples "
            "with and without the behaviour to steer toward (e.g. refusing vs "
            "complying prompts or prompt+response texts)"
        )
    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    bpos, bneg = read_prompts(args.behavior_positive), read_prompts(args.behavior_negative)
    for what, a, b in (
        ("--positive/--negative", pos, neg),
        ("--behavior-positive/--behavior-negative", bpos, bneg),
    ):
        if len(a) != len(b):
            raise DeriveError(
                f"CAST pairs line i of the two files {what}; they have {len(a)} and {len(b)} lines"
            )
    # The cosine read averages residual.pre over every prompt token, so the condition
    # vector and θ are computed from exactly that mean.
    mp = _collect(args, llm, pos, "cast: condition +", layers=c_layers, position="mean")
    mn = _collect(args, llm, neg, "cast: condition -", layers=c_layers, position="mean")
    per_layer = []
    best = None
    for i, cl in enumerate(c_layers):
        v = D.pca_direction(mp[:, i], mn[:, i], method=args.method)
        fit = D.cast_threshold(
            D.cast_similarity(mp[:, i], v),
            D.cast_similarity(mn[:, i], v),
            lo=args.threshold_lo,
            hi=args.threshold_hi,
            step=args.threshold_step,
        )
        per_layer.append(
            {"layer": cl, "threshold": fit.threshold, "comparator": fit.comparator, "f1": fit.f1}
        )
        if best is None or fit.f1 > best[2].f1:
            best = (cl, v, fit)
    if best is None:
        raise DeriveError("cast: no condition layer to choose from")
    cl, v, fit = best
    up = _collect(args, llm, bpos, "cast: behaviour +", layers=b_layers, position="last")
    un = _collect(args, llm, bneg, "cast: behaviour -", layers=b_layers, position="last")
    u = D.pca_direction(up, un, method=args.method)  # [L_sel, d], one PC per layer
    meta = _meta(
        args,
        shape,
        f"CAST: pca_{args.method} condition and behaviour vectors, F1 grid "
        f"search of the threshold (Lee et al. 2025)",
        _files(
            args, behavior_positive=args.behavior_positive, behavior_negative=args.behavior_negative
        ),
        {
            "positive": len(pos),
            "negative": len(neg),
            "behavior_positive": len(bpos),
            "behavior_negative": len(bneg),
        },
        site="residual.pre",
        condition_search=per_layer,
        f1=fit.f1,
        cast_comparator=fit.cast_direction,
        threshold_grid=[args.threshold_lo, args.threshold_hi, args.threshold_step],
    )
    return cast(
        v,
        u,
        condition_layer=cl,
        behavior_layers=b_layers,
        threshold=fit.threshold,
        comparator=fit.comparator,
        alpha=args.alpha,
        model=args.model,
        name=args.name,
        metadata=meta,
    )


def derive_truth_probe(args, llm) -> App:
    """Orgad et al.: logistic regression (scikit-learn's objective, C) on mlp.post at one layer,
    true statements labelled 1, false 0, at the last token (the answer's last token when each
    line ends with the answer)."""
    from xmix.apps import truth_probe
    from xmix.apps.truth_probe import DEFAULTS

    shape = model_shape(llm)
    default = _paper_default(DEFAULTS, args.model, "layer")
    layer = _one_layer(
        args, default if default is not None else _relative_layer(shape.n_layers, 0.47)
    )
    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    xp = _collect(
        args, llm, pos, "truth_probe: true", layers=[layer], site="mlp.post", position=args.position
    )[:, 0]
    xn = _collect(
        args,
        llm,
        neg,
        "truth_probe: false",
        layers=[layer],
        site="mlp.post",
        position=args.position,
    )[:, 0]
    w, b = D.probe_from_sets(xp, xn, C=args.C)
    acc = float(torch.cat([(xp @ w + b) > 0, (xn @ w + b) <= 0]).float().mean())
    meta = _meta(
        args,
        shape,
        f"logistic regression, L2, C={args.C} (Orgad et al. 2025)",
        _files(args),
        {"positive": len(pos), "negative": len(neg)},
        site="mlp.post",
        probe_layer=layer,
        position=args.position,
        train_accuracy=acc,
    )
    return truth_probe(
        w, b, layer, tokens=args.tokens, model=args.model, name=args.name, metadata=meta
    )


def derive_harm_monitor(args, llm) -> App:
    """A probe for harmful intent (logistic regression, harmful = 1) and the refusal direction
    (difference of means), both on residual.pre of one layer at the last prompt token; served
    as a monitor that switches refusal steering on from the first flagged token and stops a
    request the probe is sure about (xmix.apps.harm_monitor)."""
    from xmix.apps import harm_monitor
    from xmix.apps.harm_monitor import DEFAULTS

    shape = model_shape(llm)
    default = _paper_default(DEFAULTS, args.model, "layer")
    layer = _one_layer(
        args, default if default is not None else _relative_layer(shape.n_layers, 0.375)
    )
    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    xp = _collect(args, llm, pos, "harm_monitor: harmful", layers=[layer], position=args.position)
    xn = _collect(args, llm, neg, "harm_monitor: harmless", layers=[layer], position=args.position)
    xp, xn = xp[:, 0], xn[:, 0]
    w, b = D.probe_from_sets(xp, xn, C=args.C)
    r = D.mean_difference(xp, xn)
    acc = float(torch.cat([(xp @ w + b) > 0, (xn @ w + b) <= 0]).float().mean())
    meta = _meta(
        args,
        shape,
        f"logistic regression, L2, C={args.C}; difference of means (Arditi et al. 2024)",
        _files(args),
        {"positive": len(pos), "negative": len(neg)},
        site="residual.pre",
        probe_layer=layer,
        position=args.position,
        train_accuracy=acc,
        direction_norm=float(r.norm()),
    )
    return harm_monitor(
        w,
        b,
        r,
        layer,
        threshold=args.threshold,
        stop_threshold=args.stop_threshold,
        coeff=args.coeff,
        model=args.model,
        name=args.name,
        metadata=meta,
    )


def derive_kl_then_steer(args, llm) -> App:
    """KTS (Stickland et al.): per-layer steering vectors at residual.post (last token) from the
    contrastive sets, and the gate = logistic probe on the prompt mean (or last token) at
    residual.post of the probe layer."""
    from xmix.apps import kl_then_steer
    from xmix.apps.kl_then_steer import DEFAULTS

    shape = model_shape(llm)
    layers = args.layer or _paper_default(DEFAULTS, args.model, "layers")
    if layers is None:
        raise DeriveError(
            "kl_then_steer needs --layer L [L ...] (the steered layers); defaults exist "
            "only for the paper's models"
        )
    probe_layer = args.probe_layer if args.probe_layer is not None else min(layers) - 1
    if probe_layer < 0:
        raise DeriveError(
            f"the first steered layer is {min(layers)}: there is no earlier layer for "
            f"the probe; steer from layer 1 on or give --probe-layer"
        )
    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    sp = _collect(
        args, llm, pos, "kts: steer +", layers=layers, site="residual.post", position="last"
    )
    sn = _collect(
        args, llm, neg, "kts: steer -", layers=layers, site="residual.post", position="last"
    )
    u, s = D.kts_directions(sp, sn, method=args.method, scale=args.scale)
    ppos = read_prompts(args.probe_positive) if args.probe_positive else pos
    pneg = read_prompts(args.probe_negative) if args.probe_negative else neg
    reduce_pos = "mean" if args.reduce == "prompt_mean" else "last"
    xp = _collect(
        args,
        llm,
        ppos,
        "kts: probe +",
        layers=[probe_layer],
        site="residual.post",
        position=reduce_pos,
    )[:, 0]
    xn = _collect(
        args,
        llm,
        pneg,
        "kts: probe -",
        layers=[probe_layer],
        site="residual.post",
        position=reduce_pos,
    )[:, 0]
    w, b = D.probe_from_sets(xp, xn, C=args.C)
    meta = _meta(
        args,
        shape,
        f"KTS directions ({args.method}, scale {args.scale}) and logistic "
        f"prompt probe (Stickland et al. 2024)",
        _files(args, probe_positive=args.probe_positive, probe_negative=args.probe_negative),
        {
            "positive": len(pos),
            "negative": len(neg),
            "probe_positive": len(ppos),
            "probe_negative": len(pneg),
        },
        site="residual.post",
        steer_layers=list(layers),
        probe_layer=probe_layer,
    )
    return kl_then_steer(
        u,
        s,
        w,
        b,
        probe_layer=probe_layer,
        layers=layers,
        coeff=args.coeff,
        threshold=args.threshold,
        reduce=args.reduce,
        model=args.model,
        name=args.name,
        metadata=meta,
    )


def derive_sake(args, llm) -> App:
    """SAKE (Scialanga et al.): Gaussian optimal-transport map between final.post activations at
    the last token of source prompts (--positive) and target prompts (--negative); t from the
    in-scope distances (Youden's J against --unrelated prompts, else a quantile)."""
    from xmix.apps import sake

    shape = model_shape(llm)
    src, tgt = read_prompts(args.positive), read_prompts(args.negative)
    xs = _collect(args, llm, src, "sake: source", site="final.post", position="last")[:, 0]
    xt = _collect(args, llm, tgt, "sake: target", site="final.post", position="last")[:, 0]
    A, mu_s, mu_t = D.gaussian_transport(xs, xt, reg=args.reg, shrinkage=args.shrinkage)
    din = D.min_distance(xs, mu_s[None])
    unrelated = None
    if args.unrelated:
        unrelated = read_prompts(args.unrelated)
        xu = _collect(args, llm, unrelated, "sake: unrelated", site="final.post", position="last")[
            :, 0
        ]
        t = D.distance_threshold(din, D.min_distance(xu, mu_s[None]))
    else:
        t = D.distance_threshold(din, quantile=args.quantile)
    counts = {"positive": len(src), "negative": len(tgt)}
    if unrelated is not None:
        counts["unrelated"] = len(unrelated)
    meta = _meta(
        args,
        shape,
        f"Gaussian OT map (reg={args.reg}, shrinkage={args.shrinkage}), "
        f"distance threshold (Scialanga et al. 2025)",
        _files(args, unrelated=args.unrelated),
        counts,
        site="final.post",
    )
    return sake(A, mu_s, mu_t, t, model=args.model, name=args.name, metadata=meta)


def _router_weights(model_path: str, moe_layers) -> tuple[dict, dict]:
    """post_attention_layernorm and router (gate) weights of each MoE layer, from the checkpoint."""
    from safetensors import safe_open

    folder = Path(model_path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(model_path, allow_patterns=["*.safetensors", "*.json"]))
    want_norm = {f"model.layers.{l}.post_attention_layernorm.weight": l for l in moe_layers}
    want_gate = {
        f"model.layers.{l}.{m}.gate.weight": l
        for l in moe_layers
        for m in ("mlp", "block_sparse_moe")
    }
    norms, gates = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k in want_norm:
                    norms[want_norm[k]] = st.get_tensor(k).double()
                elif k in want_gate:
                    gates[want_gate[k]] = st.get_tensor(k).double()
    missing = sorted((set(moe_layers) - set(norms)) | (set(moe_layers) - set(gates)))
    if missing:
        raise DeriveError(
            f"the checkpoint in {folder} lacks the router or post-attention norm weights "
            f"of MoE layer(s) {missing}"
        )
    return norms, gates


_SOFTMAX_TOPK_ROUTERS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def derive_steer_moe(args, llm) -> App:
    """SteerMoE (Fayyaz et al.): which experts each prompt token selects at every MoE layer,
    counted per set; risk difference of activation rates; top experts by sign forced on / off.

    Router logits cannot be captured (lowering refuses capture at router.logits), so the router
    input is captured instead: residual.mid, the stream the post-attention RMSNorm receives;
    the router is then applied from the checkpoint: logits = W_gate · RMSNorm(x), top-k."""
    from xmix.apps import steer_moe

    shape = model_shape(llm)
    if not shape.n_experts:
        raise DeriveError(f"{args.model} is not a mixture-of-experts model")
    if shape.architecture not in _SOFTMAX_TOPK_ROUTERS:
        # DeepSeek-V2's group-limited choice and GPT-OSS's biased router pick other experts
        # than the softmax top-k recomputed below; counts from it would be silently wrong.
        raise DeriveError(
            f"xmix derive steer_moe recomputes routing as softmax top-k "
            f"({', '.join(_SOFTMAX_TOPK_ROUTERS)}); {shape.architecture} routes "
            f"otherwise (docs/models.md, router.logits per family)"
        )
    cfg = llm.llm_engine.model_config.hf_config
    text = getattr(cfg, "text_config", None) or cfg
    top_k = int(text.num_experts_per_tok)
    eps = float(getattr(text, "rms_norm_eps", 1e-5))
    layers = list(shape.moe_layers)
    norms, gates = _router_weights(args.model_path, layers)

    def counts(prompts, desc):
        acts = _collect(
            args, llm, prompts, desc, layers=layers, site="residual.mid", position="all"
        )
        sel, n_tok = [], 0
        for a in acts:  # [T, L, d]
            x = a.double()
            xs = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            ids = []
            for j, l in enumerate(layers):
                logits = (xs[:, j] * norms[l]) @ gates[l].T
                ids.append(torch.topk(logits, top_k, dim=-1).indices)
            sel.append(torch.stack(ids, dim=1))  # [T, L, k]
            n_tok += a.shape[0]
        return D.expert_counts(torch.cat(sel), shape.n_experts), n_tok

    pos, neg = read_prompts(args.positive), read_prompts(args.negative)
    cp, tp = counts(pos, "steer_moe: +")
    cn, tn = counts(neg, "steer_moe: -")
    delta = D.routing_difference(cp, tp, cn, tn)
    mask = D.steer_moe_mask(
        delta,
        n_activate=args.n_activate,
        n_deactivate=args.n_deactivate,
        top_k=top_k,
        per_layer=args.per_layer,
    )
    if not bool((mask != 0).any()):
        raise DeriveError(
            "no expert's activation rate differs between the two sets; nothing to steer"
        )
    meta = _meta(
        args,
        shape,
        "risk difference of expert activation rates (Fayyaz et al. 2026), "
        "routing recomputed from residual.mid with the checkpoint's router",
        _files(args),
        {"positive": len(pos), "negative": len(neg), "positive_tokens": tp, "negative_tokens": tn},
        site="router.logits",
        moe_layers=layers,
        top_k=top_k,
        max_abs_risk_difference=float(delta.abs().max()),
    )
    return steer_moe(mask, delta=args.delta, model=args.model, name=args.name, metadata=meta)


# SEAL's keyword classification of thoughts (its repository, via EasySteer's replication):
# transition first, then reflection, else execution.
SEAL_TRANSITION = (
    "alternatively",
    "think differently",
    "another way",
    "another approach",
    "another method",
    "another solution",
    "another strategy",
    "another technique",
)
SEAL_REFLECTION = (
    "wait",
    "verify",
    "make sure",
    "hold on",
    "think again",
    "'s correct",
    "'s incorrect",
    "let me check",
    "seems right",
)


def classify_thought(text: str) -> str:
    low = text.lower()
    if any(k in low for k in SEAL_TRANSITION):
        return "transition"
    if any(k in low for k in SEAL_REFLECTION):
        return "reflection"
    return "execution"


def seal_separators(tokenizer, ids: list[int], separator: str = "\n\n") -> list[tuple[int, str]]:
    """(index of each separator token, kind of the thought that follows it)."""
    pieces = [tokenizer.decode([t]) for t in ids]
    seps = [i for i, p in enumerate(pieces) if separator in p]
    out = []
    for j, i in enumerate(seps):
        end = seps[j + 1] if j + 1 < len(seps) else len(ids)
        thought = tokenizer.decode(ids[i + 1 : end], skip_special_tokens=True).strip()
        if thought:
            out.append((i, classify_thought(thought)))
    return out


def derive_seal(args, llm) -> App:
    """SEAL (Chen et al.): residual.pre at one layer at the "\\n\\n" token before each thought of
    reasoning traces; thoughts classified by SEAL's keywords; S = mean(E) - mean(R ∪ T)."""
    from xmix.apps import seal
    from xmix.apps.seal import DEFAULTS

    if not args.traces:
        raise DeriveError(
            "seal needs --traces FILE: reasoning traces (JSON lines), whose thoughts are "
            'separated by "\\n\\n"'
        )
    shape = model_shape(llm)
    default = _paper_default(DEFAULTS, args.model, "layer")
    layer = _one_layer(
        args, default if default is not None else _relative_layer(shape.n_layers, 0.71)
    )
    traces = read_traces(args.traces)
    tok = llm.get_tokenizer()
    ids = encode(tok, traces)
    kinds = {i: dict(seal_separators(tok, p)) for i, p in enumerate(ids)}
    by_ids = {tuple(p): i for i, p in enumerate(ids)}
    acts = _collect(
        args,
        llm,
        ids,
        "seal: traces",
        layers=[layer],
        position=lambda p: sorted(kinds[by_ids[tuple(p)]]),
    )
    groups: dict[str, list[torch.Tensor]] = {"execution": [], "reflection": [], "transition": []}
    for i, a in enumerate(acts):
        for row, pos in zip(a[:, 0], sorted(kinds[i])):
            groups[kinds[i][pos]].append(row)
    if not groups["execution"] or not (groups["reflection"] or groups["transition"]):
        n = {k: len(v) for k, v in groups.items()}
        raise DeriveError(
            f"SEAL needs execution thoughts and reflection or transition thoughts; "
            f"the traces gave {n}"
        )
    e = torch.stack(groups["execution"])
    r = torch.stack(groups["reflection"]) if groups["reflection"] else None
    t = torch.stack(groups["transition"]) if groups["transition"] else None
    if r is None:
        r, t = t, None
    s = D.seal_vector(e, r, t)
    counts = {k: len(v) for k, v in groups.items()}
    counts["traces"] = len(traces)
    meta = _meta(
        args,
        shape,
        "S = mean(execution) - mean(reflection ∪ transition) at '\\n\\n' "
        "tokens, thoughts classified by SEAL's keywords (Chen et al. 2025)",
        {"traces": str(args.traces)},
        counts,
        site="residual.pre",
        steer_layer=layer,
    )
    return seal(s, layer, coeff=args.coeff, model=args.model, name=args.name, metadata=meta)


DERIVERS: dict[str, Callable] = {
    "refusal": derive_refusal,
    "seal": derive_seal,
    "cast": derive_cast,
    "truth_probe": derive_truth_probe,
    "sake": derive_sake,
    "kl_then_steer": derive_kl_then_steer,
    "steer_moe": derive_steer_moe,
    "harm_monitor": derive_harm_monitor,
}
