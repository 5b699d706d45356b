"""App #3, CAST, conditional activation steering (Lee et al. 2025, arXiv 2409.05907;
github.com/IBM/activation-steering).

CAST decides once per request, from the prompt, whether to steer. At the condition layer c
it averages the hidden states over the prompt, h̄, and compares cos(h̄, tanh(P h̄)),
P = v vᵀ / vᵀv, with a threshold θ; if the condition holds it adds α·u_l at every behaviour
layer for the rest of the request.

xmix mapping: ``read("cosine", vector=v)`` at residual.pre of c, on prompt tokens, named
``cast_sim`` (the kernel keeps the running mean over prefill chunks and reports the score at
the last prompt token); app parameter ``theta``; ``write("add", vector=u, scale=α)`` at
residual.pre of the behaviour layers with condition ``prompt_last(cast_sim) <cmp> theta`` (a
request-level latch). CAST's sites: its LeashLayer wraps the decoder layer and works on the
layer's input, i.e. residual.pre.

Differences from CAST's reference code, forced by serving:

- CAST's comparator names are inverted with respect to their meaning: ``"larger"`` fires when
  the score is *below* θ, ``"smaller"`` when it is *above*. This factory takes xmix
  comparators (">=", ">", "<=", "<") and also accepts CAST's words ("smaller" -> ">",
  "larger" -> "<").
- When steering starts. The decision needs the mean over the whole prompt, which exists
  only once the last prompt token reaches the condition site. Behaviour layers after c are
  steered from the last prompt token on (in the same forward); behaviour layers at or before
  c from the first generated token on, as in CAST's hooks for layers before c. CAST steers
  every prompt token in prefill once the condition is met, including at layer c itself (its
  hook checks the condition on the layer input, then steers it); here earlier prompt tokens
  were computed, possibly in other prefill chunks, before the prompt mean was known, so they
  are not steered, and at layer c the steering starts at the first generated token.

Defaults (our choice; CAST tunes them per model): Llama-3.1-8B-Instruct and
Mixtral-8x7B-Instruct condition layer 7, behaviour layers 15-23 (CAST's documented refusal
behaviour range and condition search range 1-10 in its docs), Qwen3-8B condition 8,
behaviour 17-26 (same relative depth). θ and the comparator come from ``cast_threshold``.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "cast"
COMPARATORS = (">=", ">", "<=", "<")
CAST_WORDS = {"smaller": ">", "larger": "<"}
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b-instruct": {"condition_layer": 7, "behavior_layers": list(range(15, 24))},
    "mixtral-8x7b-instruct": {"condition_layer": 7, "behavior_layers": list(range(15, 24))},
    "qwen3-8b": {"condition_layer": 8, "behavior_layers": list(range(17, 27))},
}


def cast(
    condition_vector: Any,
    behavior_vectors: Any,
    *,
    condition_layer: int | None = None,
    behavior_layers: Any = None,
    threshold: float,
    comparator: str = ">=",
    alpha: float = 1.0,
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """CAST app. ``condition_vector``: v [d]; ``behavior_vectors``: u, [d] shared or
    [len(behavior_layers), d] / [n_layers, d] per layer; ``threshold``: θ."""
    condition_layer, behavior_layers = c.with_defaults(
        APP, DEFAULTS, model, condition_layer=condition_layer, behavior_layers=behavior_layers
    )
    cl = c.layer(APP, "condition_layer", condition_layer)
    bl = c.layer_list(APP, "behavior_layers", behavior_layers)
    cmp = CAST_WORDS.get(comparator, comparator)
    if cmp not in COMPARATORS:
        raise c.fail(
            APP,
            f"comparator must be one of {COMPARATORS} (or CAST's 'smaller' = '>', "
            f"'larger' = '<'), got {comparator!r}",
        )
    v = c.vector(APP, "condition_vector", condition_vector)
    u = c.vector(APP, "behavior_vectors", behavior_vectors, rank=(1, 2))
    theta = c.number(APP, "threshold", threshold)
    alpha = c.number(APP, "alpha", alpha)
    d = int(v.shape[0])
    dims = {"d": d, "L_sel": len(bl)}
    pm = c.paper_model(model)
    if pm:
        dims["n_layers"] = pm.n_layers
    c.check(APP, {"condition_vector": v, "behavior_vectors": u, "threshold": theta}, dims, model)
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=d,
        sites=["residual.pre"],
        layers={"condition": cl, "behavior": bl},
        params={"theta": theta, "comparator": cmp, "alpha": alpha},
        derivation="v, u_l = first PC of paired examples (CAST's pca_pairwise, sign: "
        "positives project higher); theta by grid search of F1 over "
        "cos(h_mean, tanh(P h_mean)) on positive/negative prompts",
        extra=metadata,
    )
    app.param("theta", theta)
    app.read("cosine", vector=v).layers([cl]).at("residual.pre").named("cast_sim").cond("prompt")
    app.write("add", vector=u, scale=alpha).layers(bl).at("residual.pre").cond(
        f"prompt_last(cast_sim) {cmp} theta"
    )
    return app
