"""App #1, refusal direction (Arditi et al. 2024, arXiv 2406.11717; github.com/andyrdt/refusal_direction).

Refusal in chat models is mediated by one direction r of the residual stream: the
difference of mean activations on harmful and harmless instructions at a chosen layer and
post-instruction position. Two interventions:

- ``variant="ablate"`` (bypass refusal): x <- x - (x·r̂) r̂ at every layer on the three places
  that write to the stream, residual.pre (the block input), attention.post and mlp.post, for
  all tokens, as the paper's directional ablation (its hooks: block pre-hook, attention and MLP
  output hooks). 3·L ablate ops per token.
- ``variant="add"`` (induce refusal): x <- x + c·r at residual.pre of the layer l* the
  direction was taken from, all tokens; c = +1 in the paper (c = -1 is its "actadd" bypass).

Defaults (``layer`` for ``add``): Llama-3.1-8B-Instruct 12 (the paper's selected l* for
Llama-3-8B-Instruct, position -5; our transfer to 3.1), Qwen3-8B 14 and
Mixtral-8x7B-Instruct 12 (our choice: the same relative depth, ~0.38·L; the paper has
neither model). Ablation uses every layer whatever the model.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "refusal"
ABLATE_SITES = ("residual.pre", "attention.post", "mlp.post")
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b-instruct": {"layer": 12},
    "qwen3-8b": {"layer": 14},
    "mixtral-8x7b-instruct": {"layer": 12},
}


def refusal(
    direction: Any,
    *,
    variant: str = "ablate",
    layer: int | None = None,
    coeff: float = 1.0,
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """Refusal-direction app. ``direction``: [d] (unnormalised difference of means)."""
    if variant not in ("ablate", "add"):
        raise c.fail(APP, f"variant must be 'ablate' or 'add', got {variant!r}")
    r = c.vector(APP, "direction", direction)
    c.check(APP, {"direction": r}, {"d": int(r.shape[0])}, model)
    d = int(r.shape[0])
    if variant == "ablate":
        if layer is not None:
            raise c.fail(
                APP,
                "variant 'ablate' projects r out at every layer; 'layer' only applies "
                "to variant 'add'",
            )
        if coeff != 1.0:
            raise c.fail(
                APP, "variant 'ablate' has no coefficient; 'coeff' only applies to variant 'add'"
            )
        app = c.new_app(
            APP,
            name,
            model=model,
            hidden_size=d,
            sites=list(ABLATE_SITES),
            layers="all",
            params={"variant": "ablate"},
            derivation="r = mean(harmful) - mean(harmless) at residual.pre of the selected "
            "layer and post-instruction position; ablated (normalised) at all layers",
            extra=metadata,
        )
        for site in ABLATE_SITES:
            # One tensor per op: safetensors refuses to save tensors that share memory.
            app.write("ablate", direction=r.clone()).layers("all").at(site)
        return app
    if layer is None:
        layer = c.model_defaults(DEFAULTS, model).get("layer")
        if layer is None:
            raise c.fail(
                APP,
                "variant 'add' needs layer= (the layer the direction was taken from); "
                f"defaults exist only for the paper's models {sorted(DEFAULTS)}",
            )
    layer = c.layer(APP, "layer", layer)
    coeff = c.number(APP, "coeff", coeff)
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=d,
        sites=["residual.pre"],
        layers=[layer],
        params={"variant": "add", "coeff": coeff},
        derivation="r = mean(harmful) - mean(harmless) at residual.pre of this layer; "
        "added unnormalised, x += coeff * r",
        extra=metadata,
    )
    app.write("add", vector=r, scale=coeff).layers([layer]).at("residual.pre")
    return app
