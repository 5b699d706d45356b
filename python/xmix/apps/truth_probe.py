"""App #4, truthfulness probe (Orgad et al. 2025, arXiv 2410.02707;
github.com/technion-cs-nlp/LLMsKnow).

A linear probe on the MLP output of one layer predicts whether the model's answer is
correct: σ(w·a + b), trained (scikit-learn logistic regression) on the activation at the
last token of the exact answer. The paper finds the signal concentrated on the exact-answer
tokens, which an extractor locates after the fact.

xmix mapping: ``read("probe", weight=w, bias=b)`` at mlp.post of one layer, named
``truth``, its per-token value returned to the client. A server does not know during
decoding which tokens form the exact answer, so it scores every generated token
(``tokens="generated"``, default) and the client reads the score at the answer's last
token; ``"all"`` also scores the prompt, ``"last_token"`` the last prompt token and every
generated token.

Defaults: layer 15 for Mistral-7B-Instruct-v0.2 (the paper's example command probes ``mlp``
at layer 15 of it, 32 layers), and the same layer for Llama-3.1-8B-Instruct and
Mixtral-8x7B-Instruct (our transfer); our choice 17 for Qwen3-8B (same relative depth).
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "truth_probe"
TOKENS = {"generated": "generated", "all": None, "last_token": "last_token"}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b-instruct": {"layer": 15},
    "mixtral-8x7b-instruct": {"layer": 15},
    "qwen3-8b": {"layer": 17},
    "mistral-7b-instruct-v0.2": {"layer": 15},
}


def truth_probe(
    weight: Any,
    bias: float,
    layer: int | None = None,
    *,
    tokens: str = "generated",
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """Truthfulness probe. ``weight``: w [d]; ``bias``: b; read at mlp.post of ``layer``."""
    if tokens not in TOKENS:
        raise c.fail(APP, f"tokens must be one of {sorted(TOKENS)}, got {tokens!r}")
    w = c.vector(APP, "weight", weight)
    b = c.number(APP, "bias", bias)
    c.check(APP, {"weight": w, "bias": b}, {"d": int(w.shape[0])}, model)
    (layer,) = c.with_defaults(
        APP, DEFAULTS, model, "the layer the probe was trained on", layer=layer
    )
    layer = c.layer(APP, "layer", layer)
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=int(w.shape[0]),
        sites=["mlp.post"],
        layers=[layer],
        params={"tokens": tokens},
        derivation="logistic regression (L2, C=1) on mlp.post activations at the last "
        "exact-answer token, label 1 = correct answer",
        extra=metadata,
    )
    op = app.read("probe", weight=w, bias=b).layers([layer]).at("mlp.post").named("truth")
    if TOKENS[tokens] is not None:
        op.cond(TOKENS[tokens])
    return app
