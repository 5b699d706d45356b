"""A monitor that acts: a linear probe for harmful intent on the residual stream, whose
score both switches refusal steering on for the rest of a request and stops a request
outright (xmix's monitors, docs/apps.md "Monitors").

The probe is a logistic regression σ(w·x + b) on residual.pre of one layer, trained on the
last prompt token of harmful (1) and harmless (0) instructions; the steering vector is the
refusal direction of the same activations, r = mean(harmful) − mean(harmless) (Arditi et al.
2024, arXiv 2406.11717, whose ``add`` intervention makes a model refuse). Served:

- ``read("probe", weight=w, bias=b)`` at residual.pre of ``layer``, named ``harm``, on every
  token (prompt included);
- ``write("add", vector=r, scale=coeff)`` at residual.post of ``layer`` under
  ``since(harm > theta)``: from the first token the probe flags (a prompt token too) to the
  end of the request, whatever the probe says afterwards;
- ``app.stop(when="harm > stop_at")``: the request ends with the first token whose score
  passes ``stop_at`` (a flagged prompt: no token at all).

``theta`` and ``stop_at`` are parameters, per request like any other (``stop_at`` 2 turns the
stop off, ``theta`` 2 the steering: a sigmoid never reaches 2). Derive the artifacts with
``xmix derive harm_monitor`` (docs/apps.md).
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.apps.refusal import DEFAULTS as REFUSAL_DEFAULTS
from xmix.lang.api import App

APP = "harm_monitor"
DEFAULTS: dict[str, dict[str, Any]] = REFUSAL_DEFAULTS  # the refusal direction's layer


def harm_monitor(
    weight: Any,
    bias: float,
    direction: Any,
    layer: int | None = None,
    *,
    threshold: float = 0.5,
    stop_threshold: float = 0.95,
    coeff: float = 1.0,
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """Harm monitor. ``weight``/``bias``: the probe on residual.pre of ``layer``;
    ``direction``: the refusal direction added from the first flagged token on."""
    w = c.vector(APP, "weight", weight)
    b = c.number(APP, "bias", bias)
    r = c.vector(APP, "direction", direction)
    c.check(APP, {"weight": w, "bias": b, "direction": r}, {"d": int(w.shape[0])}, model)
    theta = c.number(APP, "threshold", threshold)
    stop_at = c.number(APP, "stop_threshold", stop_threshold)
    k = c.number(APP, "coeff", coeff)
    (layer,) = c.with_defaults(
        APP, DEFAULTS, model, "the layer the probe was trained on", layer=layer
    )
    layer = c.layer(APP, "layer", layer)
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=int(w.shape[0]),
        sites=["residual.pre", "residual.post", "final.post"],
        layers=[layer],
        params={"threshold": theta, "stop_threshold": stop_at, "coeff": k},
        derivation="probe: logistic regression (L2, C=1) on residual.pre at the last prompt "
        "token, harmful = 1; direction: mean(harmful) - mean(harmless) of the same activations",
        extra=metadata,
    )
    app.param("theta", theta).param("stop_at", stop_at)
    app.read("probe", weight=w, bias=b).layers([layer]).at("residual.pre").named("harm")
    app.write("add", vector=r, scale=k).layers([layer]).at("residual.post").named("refuse").cond(
        when="since(harm > theta)"
    )
    app.stop(when="harm > stop_at")
    return app
