"""Activations of prompt sets at hook sites, collected with xmix capture reads on an engine.

Every prompt is one request with ``max_tokens=1``, so the reads see exactly the prompt's
forward pass as the server computes it. ``collect_activations`` takes an ``xmix.LLM`` or an
existing ``vllm.LLM``; ``xmix derive`` (``derive_cli``) and the per-app recipes
(``derivers``) build on it; tests and notebooks call it directly.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from xmix.lang.api import App
from xmix.lang.sites import LAYER_SITES

POSITIONS = ("last", "mean", "all")
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
def model_shape(llm):
    """The served model's shape (layers, hidden size, experts) as xmix placed it."""
    return llm.xmix.registry.shape


def _normalise_sites(llm, layers, site, sites) -> list[tuple[str, int | None]]:
    shape = model_shape(llm)
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
    from xmix.lang.lowering import DeployError

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
    d = model_shape(llm).hidden_size
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
