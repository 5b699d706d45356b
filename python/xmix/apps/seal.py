"""App #2, SEAL (Chen et al. 2025, arXiv 2504.07986; github.com/VITA-Group/SEAL).

Reasoning models separate thoughts with "\\n\\n". SEAL classifies thoughts into execution,
reflection and transition, takes the hidden states of the "\\n\\n" tokens that start each
kind, and builds S = mean(H_E) - mean(H_R ∪ H_T). While the model thinks, it adds α·S to
the hidden state of every "\\n\\n" token at one layer, which suppresses needless reflection
and switching. Sign and coefficient: S points from reflection/transition toward execution
and the paper adds it with α = 1.0 (positive); EasySteer's replication adds +1·execution,
-1·reflection, -1·transition mean vectors instead, which is not the same vector (it does not
pool R and T before averaging). This app adds ``coeff · S`` with coeff = 1.0 by default.

xmix mapping: token sets nl2 (every token whose text contains "\\n\\n"), think_open
("<think>") and think_close ("</think>"), condition ``token_in(nl2) and in_span(think_open,
think_close)`` (opener inclusive, closer exclusive; the span flag is per-request state that
crosses steps), ``add`` at residual.pre of one layer. The span also covers prompt tokens
after an opened "<think>"; ``only_generated=True`` restricts the write to generated tokens.

Defaults: layer 20 on the 28-layer DeepSeek-R1-Distill-Qwen-1.5B/7B (paper; Qwen2
architecture) and 55 on the 64-layer QwQ/R1-Distill-32B (paper; not in the defaults table). The paper gives the layer index, not the hook point; we use
residual.pre of that layer (Hugging Face's hidden_states[20]), where the vector should then
also be collected. For the paper's serving models, our choice at the same relative depth
(~0.71·L): Qwen3-8B 26, Llama-3.1-8B-Instruct 23, Mixtral-8x7B-Instruct 23. Llama and
Mixtral do not emit <think> on their own, so SEAL only fires there when the prompt/template
opens a think span.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "seal"
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {"layer": 26},
    "llama-3.1-8b-instruct": {"layer": 23},
    "mixtral-8x7b-instruct": {"layer": 23},
    "deepseek-r1-distill-qwen-7b": {"layer": 20},
    "deepseek-r1-distill-qwen-1.5b": {"layer": 20},
}


def seal(
    vector: Any,
    layer: int | None = None,
    *,
    coeff: float = 1.0,
    only_generated: bool = False,
    separator: str = "\n\n",
    think_open: str = "<think>",
    think_close: str = "</think>",
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """SEAL app. ``vector``: S [d]; ``layer``: where to add it (default from the paper's models)."""
    s = c.vector(APP, "vector", vector)
    c.check(APP, {"vector": s}, {"d": int(s.shape[0])}, model)
    (layer,) = c.with_defaults(
        APP, DEFAULTS, model, "SEAL steers one layer: 20 on 28-layer models", layer=layer
    )
    layer = c.layer(APP, "layer", layer)
    coeff = c.number(APP, "coeff", coeff)
    for what, v in (
        ("separator", separator),
        ("think_open", think_open),
        ("think_close", think_close),
    ):
        if not isinstance(v, str) or not v:
            raise c.fail(APP, f"{what} must be a non-empty string, got {v!r}")
    cond = "token_in(nl2) and in_span(think_open, think_close)"
    if only_generated:
        cond += " and generated"
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=int(s.shape[0]),
        sites=["residual.pre"],
        layers=[layer],
        params={"coeff": coeff, "condition": cond},
        derivation="S = mean(H_execution) - mean(H_reflection ∪ H_transition) over the "
        "hidden states of thought-separating '\\n\\n' tokens at residual.pre",
        extra=metadata,
    )
    app.token_set("nl2", contains=[separator])
    app.token_set("think_open", strings=[think_open])
    app.token_set("think_close", strings=[think_close])
    app.write("add", vector=s, scale=coeff).layers([layer]).at("residual.pre").cond(cond)
    return app
