"""``xmix derive``: compute an app's artifacts from contrastive prompt sets on a serving engine.

    xmix derive refusal     --model M --positive harmful.txt --negative harmless.txt [--layer L]
    xmix derive cast        --model M --positive cond.txt --negative other.txt \\
                            --behavior-positive refuse.txt --behavior-negative comply.txt \\
                            --condition-layer C [C ...] --behavior-layers B [B ...]
    xmix derive truth_probe --model M --positive true.txt --negative false.txt [--layer L]
    xmix derive kl_then_steer --model M --positive bad.txt --negative benign.txt --layer L [L ...]
    xmix derive sake        --model M --positive source.txt --negative target.txt [--unrelated other.txt]
    xmix derive steer_moe   --model M --positive with.txt --negative without.txt
    xmix derive seal        --model M --traces traces.jsonl --layer L
    xmix derive harm_monitor --model M --positive harmful.txt --negative harmless.txt [--layer L]

Activations are collected with xmix's own ``capture`` reads on a vLLM engine (``xmix.LLM``):
every prompt is one request with ``max_tokens=1``, so the reads see exactly the prompt's
forward pass as the server computes it. ``collect_activations`` is the reusable part (it also
takes an existing ``vllm.LLM``); the math is ``xmix.apps.derive``; the result is an app file
(``App.save``) whose metadata records the model, hidden size, layers, method, prompt files and
counts. ``main(argv, llm=...)`` runs the verb in-process on an engine that is already up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from xmix.api import App, AppError
from xmix.apps import derive as D
from xmix.hooks import LAYER_SITES

POSITIONS = ("last", "mean", "all")
DERIVABLE = (
    "refusal",
    "seal",
    "cast",
    "truth_probe",
    "sake",
    "kl_then_steer",
    "steer_moe",
    "harm_monitor",
)
_counter = itertools.count()


class DeriveError(RuntimeError):
    """A derivation that cannot run with the given inputs; the message says what to change."""


# ---------------------------------------------------------------------------- inputs
def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines are skipped."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise DeriveError(f"cannot read prompt file {str(p)!r}: {e.strerror}") from None
    out = [line.strip() for line in text.splitlines() if line.strip()]
    if not out:
        raise DeriveError(f"prompt file {str(p)!r} has no prompts (one per line)")
    return out


def read_traces(path: str | Path) -> list[str]:
    """JSON lines, each a string or an object with "text": traces keep their "\\n\\n"."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DeriveError(
                f"{path}:{i}: not JSON ({e.msg}); a traces file has one JSON string "
                f'or {{"text": ...}} per line'
            ) from None
        text = obj.get("text") if isinstance(obj, dict) else obj
        if not isinstance(text, str) or not text:
            raise DeriveError(f'{path}:{i}: expected a string or an object with a "text" string')
        out.append(text)
    if not out:
        raise DeriveError(f"traces file {str(path)!r} is empty")
    return out


def resolve_model(model: str) -> str:
    """A tiny-model kind name (tiny-llama, ...) becomes its local folder; anything else is
    passed to vLLM as given (a folder or a Hugging Face id)."""
    from xmix.models.tiny import KINDS, tiny_model_path

    if model in KINDS:
        return str(tiny_model_path(model))
    return model


def encode(
    tokenizer, prompts: Sequence[str | Sequence[int]], chat: bool = False
) -> list[list[int]]:
    """Token ids as the server builds them: the tokenizer's special tokens (BOS) included; with
    ``chat`` each prompt is a user turn of the model's chat template, generation prompt added
    (so the last tokens are the template's post-instruction tokens, as in Arditi et al.)."""
    out = []
    for p in prompts:
        if not isinstance(p, str):
            out.append([int(t) for t in p])
        elif chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            )
            out.append(list(tokenizer.encode(text, add_special_tokens=False)))
        else:
            out.append(list(tokenizer.encode(p)))
    return out


# ---------------------------------------------------------------------------- collection
def _shape(llm):
    return llm.xmix.registry.shape


def _normalise_sites(llm, layers, site, sites) -> list[tuple[str, int | None]]:
    shape = _shape(llm)
    if sites is None:
        if site == "final.post":
            sites = [("final.post", None)]
        else:
            if layers is None or layers == "all":
                layers = range(shape.n_layers)
            elif isinstance(layers, int):
                layers = [layers]
            sites = [(site, int(l)) for l in layers]
    out = []
    for s, l in sites:
        if s not in LAYER_SITES and s != "final.post":
            known = ", ".join(list(LAYER_SITES) + ["final.post"])
            raise DeriveError(f"unknown site {s!r}; sites are {known}")
        if s == "router.logits":
            raise DeriveError(
                "router.logits cannot be captured (the capture kernel does not run on "
                "router logits); capture residual.mid and apply the router instead "
                "(see derive_steer_moe)"
            )
        if s != "final.post" and not (isinstance(l, int) and 0 <= l < shape.n_layers):
            raise DeriveError(
                f"layer {l!r} is out of range (the model has {shape.n_layers} layers)"
            )
        out.append((s, None if s == "final.post" else int(l)))
    if not out:
        raise DeriveError("no sites to collect")
    return out


def _capture_app(pieces, cond: str) -> tuple[App, list[str]]:
    name = f"xmix_derive_{os.getpid()}_{next(_counter)}"
    app = App(name, metadata={"purpose": "xmix derive: activation collection"})
    keys = []
    for i, (site, layer, lo, hi) in enumerate(pieces):
        op = app.read("capture", dims=(lo, hi)).at(site).named(f"c{i}").cond(cond)
        if layer is not None:
            op.layers([layer])
        keys.append(f"c{i}")  # one layer per op: the result key is the op name
    return app, keys


def _deploy_groups(llm, pieces, cond):
    """Deploy the capture ops in as few apps as the control block's capture buffer allows:
    a group that does not fit is halved, a single site that does not fit is split by dims."""
    from xmix.lowering import DeployError

    todo = [list(pieces)]
    while todo:
        group = todo.pop(0)
        app, keys = _capture_app(group, cond)
        try:
            llm.xmix.deploy(app)
        except DeployError as e:
            if "capture buffer" not in str(e):
                raise
            if len(group) > 1:
                half = len(group) // 2
                todo[:0] = [group[:half], group[half:]]
                continue
            site, layer, lo, hi = group[0]
            if hi - lo <= 1:
                raise DeriveError(
                    f"the engine's capture buffer cannot hold even one float per token "
                    f"({e}); lower max_num_batched_tokens"
                ) from None
            mid = (lo + hi) // 2
            todo[:0] = [[(site, layer, lo, mid)], [(site, layer, mid, hi)]]
            continue
        yield app, keys, group


def collect_activations(
    llm,
    prompts: Sequence[str | Sequence[int]],
    layers: Any = None,
    site: str = "residual.pre",
    position: str | Callable = "last",
    *,
    sites: Sequence[tuple[str, int | None]] | None = None,
    chat: bool = False,
    batch_size: int = 16,
    progress: bool = True,
    desc: str | None = None,
):
    """Activations of ``prompts`` at hook sites, read with xmix capture reads on ``llm``.

    ``sites``: ``[(site, layer), ...]`` (layer None for final.post), or ``layers`` (ints,
    ``"all"``) at one ``site``. Each prompt runs as one request with ``max_tokens=1`` (the
    generated token is never fed back, so only the prompt's forward is read). ``position``:

    - ``"last"``: the last prompt token -> ``[N, S, d]`` (S = number of sites, in order);
    - ``"mean"``: the mean over all prompt tokens (BOS included, as the server computes the
      prompt) -> ``[N, S, d]``;
    - ``"all"``: every prompt token -> a list of ``[T_i, S, d]``;
    - a callable ``f(ids) -> list[int]``: those token indices -> a list of ``[k_i, S, d]``.

    Tensors are float32 on the CPU. Prompts are strings (encoded as the server does, with the
    chat template if ``chat``) or token-id lists. The capture apps are removed again.
    """
    from vllm import SamplingParams

    import xmix

    if not (callable(position) or position in POSITIONS):
        raise DeriveError(f"position must be one of {POSITIONS} or a callable, got {position!r}")
    if batch_size < 1:
        raise DeriveError("batch_size must be >= 1")
    site_list = _normalise_sites(llm, layers, site, sites)
    d = _shape(llm).hidden_size
    ids = encode(llm.get_tokenizer(), prompts, chat)
    if not ids:
        raise DeriveError("no prompts")
    pieces = [(s, l, 0, d) for s, l in site_list]
    index = {(s, l): i for i, (s, l) in enumerate(site_list)}
    cond = "last_token" if position == "last" else "prompt"
    reduce_now = position in ("last", "mean")
    acc: list[torch.Tensor] = [
        torch.zeros(len(site_list), d) if reduce_now else torch.zeros(len(p), len(site_list), d)
        for p in ids
    ]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(ids), desc=desc or "collecting activations", unit="prompt", file=sys.stderr
        )
    passes = 0
    try:
        for app, keys, group in _deploy_groups(llm, pieces, cond):
            passes += 1
            if bar is not None and passes > 1:
                bar.total += len(ids)
                bar.refresh()
            try:
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=1,
                    ignore_eos=True,
                    extra_args={"xmix": {"apps": [app.name]}},
                )
                for start in range(0, len(ids), batch_size):
                    chunk = ids[start : start + batch_size]
                    outs = llm.generate(
                        [{"prompt_token_ids": p} for p in chunk], sp, use_tqdm=False
                    )
                    for j, out in enumerate(outs):
                        i = start + j
                        res = xmix.results(out).get(app.name, {})
                        n = len(ids[i])
                        want = [n - 1] if position == "last" else list(range(n))
                        for key, (s, l, lo, hi) in zip(keys, group):
                            r = res.get(key)
                            if r is None or list(r["positions"]) != want:
                                got = None if r is None else r["positions"]
                                raise DeriveError(
                                    f"prompt {i}: the capture at {s} layer {l} read "
                                    f"positions {got}, expected {want}"
                                )
                            vals = torch.tensor(r["values"], dtype=torch.float32).reshape(
                                len(want), hi - lo
                            )
                            col = index[(s, l)]
                            if position == "mean":
                                acc[i][col, lo:hi] = vals.double().mean(0).float()
                            elif position == "last":
                                acc[i][col, lo:hi] = vals[0]
                            else:
                                acc[i][:, col, lo:hi] = vals
                    if bar is not None:
                        bar.update(len(chunk))
            finally:
                llm.xmix.undeploy(app.name)
    finally:
        if bar is not None:
            bar.close()
    if reduce_now:
        return torch.stack(acc)
    if callable(position):
        out = []
        for p, a in zip(ids, acc):
            idx = [int(t) for t in position(p)]
            bad = [t for t in idx if not 0 <= t < len(p)]
            if bad:
                raise DeriveError(f"position function returned indices {bad} outside the prompt")
            out.append(a[idx])
        return out
    return acc


# ---------------------------------------------------------------------------- helpers
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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

    shape = _shape(llm)
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
    shape = _shape(llm)
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


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xmix derive",
        description="Compute an app's artifacts from contrastive prompt sets (one prompt per line), "
        "collecting activations with xmix capture reads on a vLLM engine, and write the "
        "app file. Docs: docs/apps.md.",
    )
    p.add_argument("app", choices=DERIVABLE)
    p.add_argument(
        "--model",
        required=True,
        help="model folder, Hugging Face id, or tiny-llama / tiny-qwen3 / tiny-mixtral",
    )
    p.add_argument(
        "--positive",
        help="prompts with the property (harmful, condition, true, source, ...); one per line",
    )
    p.add_argument("--negative", help="prompts without it (harmless, other, false, target, ...)")
    p.add_argument(
        "--layer",
        type=int,
        nargs="+",
        help="layer(s): refusal/truth_probe/seal one; kl_then_steer the steered layers",
    )
    p.add_argument("--out", help="app file to write (default: <app>.xmix)")
    p.add_argument("--name", help="app name (default: the app key)")
    p.add_argument(
        "--position",
        choices=("last", "mean"),
        default="last",
        help="refusal / truth_probe: the last prompt token or the prompt mean",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (generation prompt added)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="prompts per engine call")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("refusal")
    g.add_argument("--variant", choices=("ablate", "add"), default="ablate")
    g.add_argument(
        "--coeff", type=float, default=1.0, help="refusal add / seal / kl_then_steer coefficient"
    )
    g = p.add_argument_group("cast")
    g.add_argument(
        "--condition-layer",
        type=int,
        nargs="+",
        help="candidate condition layers; the best F1 wins",
    )
    g.add_argument("--behavior-layers", type=int, nargs="+")
    g.add_argument(
        "--behavior-positive",
        help="examples showing the behaviour (paired with --behavior-negative)",
    )
    g.add_argument("--behavior-negative")
    g.add_argument(
        "--method",
        default=None,
        help="cast: pairwise|diff|center (default pairwise); "
        "kl_then_steer: mean|pca (default mean)",
    )
    g.add_argument("--alpha", type=float, default=1.0)
    g.add_argument("--threshold-lo", type=float, default=0.0)
    g.add_argument("--threshold-hi", type=float, default=1.0)
    g.add_argument("--threshold-step", type=float, default=0.01)
    g = p.add_argument_group("truth_probe / kl_then_steer probes")
    g.add_argument("--C", type=float, default=1.0, help="inverse L2 strength (scikit-learn's C)")
    g.add_argument(
        "--tokens",
        choices=("generated", "all", "last_token"),
        default="generated",
        help="truth_probe: which tokens the served probe scores",
    )
    g = p.add_argument_group("kl_then_steer")
    g.add_argument("--probe-layer", type=int)
    g.add_argument("--probe-positive")
    g.add_argument("--probe-negative")
    g.add_argument("--scale", choices=("norm", "unit"), default="norm")
    g.add_argument(
        "--threshold",
        type=float,
        default=0.5,
        help="kl_then_steer's latch; harm_monitor: the probe score that switches steering on",
    )
    g.add_argument(
        "--stop-threshold",
        type=float,
        default=0.95,
        help="harm_monitor: the probe score that stops a request",
    )
    g.add_argument("--reduce", choices=("prompt_mean", "prompt_last"), default="prompt_mean")
    g = p.add_argument_group("sake")
    g.add_argument("--unrelated", help="out-of-scope prompts for the distance threshold")
    g.add_argument("--reg", type=float, default=1e-2)
    g.add_argument("--shrinkage", type=float, default=0.0)
    g.add_argument("--quantile", type=float, default=0.95)
    g = p.add_argument_group("steer_moe")
    g.add_argument("--n-activate", type=int, default=1)
    g.add_argument("--n-deactivate", type=int, default=1)
    g.add_argument("--per-layer", action="store_true")
    g.add_argument("--delta", type=float, default=0.01)
    g = p.add_argument_group("seal")
    g.add_argument("--traces", help='reasoning traces, JSON lines (a string or {"text": ...} each)')
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other vllm.LLM argument (VALUE parsed as JSON when it can be)",
    )
    return p


def _check_args(args, parser) -> None:
    if args.app == "seal":
        if not args.traces:
            parser.error("seal needs --traces FILE")
    elif not (args.positive and args.negative):
        parser.error(f"{args.app} needs --positive FILE and --negative FILE")
    if args.method is None:
        args.method = "mean" if args.app == "kl_then_steer" else "pairwise"
    valid = ("mean", "pca") if args.app == "kl_then_steer" else D.PCA_METHODS
    if args.app in ("cast", "kl_then_steer") and args.method not in valid:
        parser.error(f"--method for {args.app} must be one of {valid}")
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")


def engine_kwargs(args) -> dict:
    kw: dict[str, Any] = {
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        kw["enforce_eager"] = True
    for item in args.engine_arg:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise DeriveError(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            kw[k.replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            kw[k.replace("-", "_")] = v
    return kw


def run(args, llm=None) -> tuple[App, Path]:
    """Derive the app of ``args`` (from ``build_parser``) on ``llm`` (started when None) and save it."""
    args.model_path = resolve_model(args.model)
    own = llm is None
    if own:
        import xmix

        llm = xmix.LLM(model=args.model_path, **engine_kwargs(args))
    else:
        served = str(llm.llm_engine.model_config.model)
        same = (
            os.path.realpath(served) == os.path.realpath(args.model_path)
            if os.path.exists(served) and os.path.exists(args.model_path)
            else served == args.model_path
        )
        if not same:
            # The artifacts would fit the served model, but the metadata would name another.
            raise DeriveError(
                f"--model {args.model} is {args.model_path}, but the engine serves {served}"
            )
    try:
        app = DERIVERS[args.app](args, llm)
    finally:
        if own:
            _shutdown(llm)
    out = Path(args.out or f"{app.name}.xmix")
    app.save(out)
    return app, out


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # the process exits next; a failed shutdown must not hide the result
        pass


def _summary(app: App, out: Path) -> str:
    m = app.metadata
    keep = ("xmix_app", "model", "hidden_size", "n_layers", "layers", "method", "counts", "params")
    return f"wrote {out}\n" + json.dumps({k: m.get(k) for k in keep}, indent=2, default=str)


def main(argv: list[str] | None = None, llm=None) -> int:
    """``xmix derive ...``; ``llm``: an engine already running the same model (tests, notebooks)."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    _check_args(args, parser)
    try:
        app, out = run(args, llm)
    except (DeriveError, AppError) as e:
        print(f"xmix derive {args.app}: {e}", file=sys.stderr)
        return 2
    print(_summary(app, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
