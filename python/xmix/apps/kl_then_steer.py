"""App #6, KL-then-steer (Stickland et al. 2024, arXiv 2406.15518;
github.com/AsaCooperStickland/kl-then-steer).

KTS fine-tunes the model so that steering costs little on benign inputs (it minimises the KL
between the steered and unsteered model there), then steers only inputs that a classifier
flags as problematic. Steering adds c·s_l·û_l to the output of each decoder block in a range
of layers (RepE's block wrapper; layers -11 .. -29 of Llama-2-7B-chat, i.e. 21 down to 3).
The KL fine-tuning happens before deployment: serve the KTS checkpoint; this app is the
steering plus the in-model gate.

xmix mapping: ``read("probe")`` at residual.post of ``probe_layer`` on prompt tokens, named
``kts_probe``; app parameter ``threshold``; ``write("add", vector=s_l·û_l, scale=c)`` at
residual.post of ``layers`` with condition ``prompt_mean(kts_probe) >= threshold`` (or
``prompt_last``), a request-level latch.

Differences from KTS: the latch is decided when the last prompt token reaches the probe, so
steered layers after ``probe_layer`` are steered from the last prompt token on, steered layers
at or before it from the first generated token on, while RepE's wrapper steered every prompt
token too.

Defaults: layers 3-21 for the 32-layer Llama-3.1-8B-Instruct and Mixtral-8x7B-Instruct and
7-25 for the 36-layer Qwen3-8B (KTS's -11 .. -29, counted from the end); probe_layer
min(layers) - 1 (our choice: every steered layer then starts at the last prompt token);
c = 1, threshold 0.5,
``prompt_mean``.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "kl_then_steer"
REDUCES = ("prompt_mean", "prompt_last")
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b-instruct": {"layers": list(range(3, 22)), "probe_layer": 2},
    "mixtral-8x7b-instruct": {"layers": list(range(3, 22)), "probe_layer": 2},
    "qwen3-8b": {"layers": list(range(7, 26)), "probe_layer": 6},
}


def kl_then_steer(
    directions: Any,
    scales: Any,
    probe_weight: Any,
    probe_bias: float,
    *,
    probe_layer: int | None = None,
    layers: Any = None,
    coeff: float = 1.0,
    threshold: float = 0.5,
    reduce: str = "prompt_mean",
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """KTS steering gated by a prompt probe. ``directions``: unit û_l [len(layers), d];
    ``scales``: s_l [len(layers)]; ``probe_weight`` [d], ``probe_bias``: the gate σ(w·h + b)."""
    layers, probe_layer = c.with_defaults(
        APP, DEFAULTS, model, layers=layers, probe_layer=probe_layer
    )
    ls = c.layer_list(APP, "layers", layers)
    pl = c.layer(APP, "probe_layer", probe_layer)
    if reduce not in REDUCES:
        raise c.fail(APP, f"reduce must be one of {REDUCES}, got {reduce!r}")
    u = c.vector(APP, "directions", directions, rank=(2,))
    s = c.vector(APP, "scales", scales)
    w = c.vector(APP, "probe_weight", probe_weight)
    b = c.number(APP, "probe_bias", probe_bias)
    th = c.number(APP, "threshold", threshold)
    coeff = c.number(APP, "coeff", coeff)
    d = int(w.shape[0])
    c.check(
        APP,
        {"directions": u, "scales": s, "probe_weight": w, "probe_bias": b, "threshold": th},
        {"d": d, "L_sel": len(ls)},
        model,
    )
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=d,
        sites=["residual.post"],
        layers={"probe": pl, "steer": ls},
        params={"coeff": coeff, "threshold": th, "reduce": reduce},
        derivation="u_l, s_l from contrastive pairs at residual.post (kts_directions); "
        "probe = logistic regression on prompt activations at the probe layer",
        extra=metadata,
    )
    app.param("threshold", th)
    app.read("probe", weight=w, bias=b).layers([pl]).at("residual.post").named("kts_probe").cond(
        "prompt"
    )
    app.write("add", vector=s[:, None] * u, scale=coeff).layers(ls).at("residual.post").cond(
        f"{reduce}(kts_probe) >= threshold"
    )
    return app
