"""App #7, SteerMoE (Fayyaz et al. 2026, arXiv 2509.09660; github.com/adobe-research/SteerMoE).

Some experts of a mixture-of-experts model are tied to behaviours (safety, faithfulness).
SteerMoE finds them from the difference in routing frequency on paired prompts and, at
inference, rewrites the router's scores: logits -> log-softmax s; experts to activate get
max(s) + ε, experts to deactivate min(s) - ε; then the model's usual top-k.

xmix mapping: ``write("router", mask=M, delta=ε)`` at router.logits of every MoE layer, all
tokens, M in {-1, 0, 1}^{L×E} (+1 on, -1 off). No state.

Defaults (the mask's shape, checked): Mixtral-8x7B-Instruct (32 MoE layers, 8 experts, top-2),
Qwen3-30B-A3B (48, 128, top-8; the paper's), GPT-OSS-20B (24, 32, top-4; SteerMoE replicated on
it by MASCing); ε = 0.01. The mask comes from ``derive.steer_moe_mask`` (pass the model's
``top_k`` there). What the rewrite guarantees per family's routing: docs/models.md.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "steer_moe"


def steer_moe(
    mask: Any,
    *,
    delta: float = 0.01,
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """SteerMoE app. ``mask``: [n_moe_layers or n_layers, E] (or [E] for every layer) in {-1, 0, 1}."""
    m = c.vector(APP, "mask", mask, rank=(1, 2))
    delta = c.number(APP, "delta", delta, lo=0.0)
    dims: dict[str, int] = {}
    pm = c.paper_model(model)
    if pm:
        if not pm.n_experts:
            raise c.fail(APP, f"{pm.hf_id} is not a mixture-of-experts model")
        dims = {"E": pm.n_experts, "n_moe": pm.n_layers, "n_layers": pm.n_layers}
    c.check(APP, {"mask": m}, dims)
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=None,
        sites=["router.logits"],
        layers="all",
        params={
            "delta": delta,
            "n_experts": int(m.shape[-1]),
            "n_on": int((m > 0).sum()),
            "n_off": int((m < 0).sum()),
        },
        derivation="risk difference of expert activation rates on paired prompts; top "
        "positive experts forced on, top negative forced off",
        extra=metadata,
    )
    app.write("router", mask=m, delta=delta).layers("all").at("router.logits")
    return app
