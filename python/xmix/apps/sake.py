"""App #5, SAKE knowledge editing (Scialanga et al. 2025, arXiv 2503.01751;
github.com/axa-rev-research/knowledge-editing).

SAKE models a fact to edit as two distributions of last-layer, last-token activations:
source (prompts that recall the old fact: paraphrases, implications) and target (the same
prompts made to produce the new object). It fits Gaussians to both and maps one onto the
other with the optimal-transport map T(h) = A(h - mu_s) + mu_t,
A = S_s^{-1/2}(S_s^{1/2} S_t S_s^{1/2})^{1/2} S_s^{-1/2} (POT's ``LinearTransport``). The edit
is applied only to in-scope inputs: the activation must lie within distance t of the source
mean (``hid_threshold`` with Euclidean distance in their code; min over centroids).

xmix mapping: ``read("distance", centroids=C)`` at final.post (the output of the final
norm, HF's ``hidden_states[-1]``) on ``last_token`` (the tokens whose logits are sampled),
named ``dist``; app parameter ``t``; ``write("affine", matrix=A, mu_s, mu_t)`` at final.post
with condition ``last_token and dist <= t`` (a gate on the read just before it at the same
site). Changing final.post only changes the sampled logits, as in SAKE, which edits the
last hidden state before the LM head.

Differences from SAKE's code: (a) the scope test on sentence-embedding similarity of the
prompt (``prompt_threshold``) needs a second model and is not available; this app uses their
hidden-state variant (``hid_threshold``, Euclidean). (b) SAKE serves many edits at once by
picking the map of the nearest source mean; one xmix app holds one map, so deploy one app per
edit (the condition language cannot pick "the nearest of several reads"). ``centroids`` may
hold several in-scope centres for the same map (default: mu_s). Memory: A is d² floats
(64 MiB at d = 4096 in fp32), and the affine write costs d² MACs per edited token.

Defaults: no layer choice (final.post); reg = 1e-2 in ``gaussian_transport`` as in SAKE's
example notebook; t from ``distance_threshold``.
"""

from __future__ import annotations

from typing import Any

from xmix.apps import _common as c
from xmix.lang.api import App

APP = "sake"


def sake(
    A: Any,
    mu_s: Any,
    mu_t: Any,
    threshold: float,
    *,
    centroids: Any = None,
    model: str | None = None,
    name: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> App:
    """SAKE edit. ``A``: [d, d] symmetric; ``mu_s``, ``mu_t``: [d]; ``threshold``: t >= 0;
    ``centroids``: [k, d] in-scope centres (default ``mu_s[None]``)."""
    a = c.vector(APP, "A", A, rank=(2,))
    ms = c.vector(APP, "mu_s", mu_s)
    mt = c.vector(APP, "mu_t", mu_t)
    t = c.number(APP, "threshold", threshold, lo=0.0)
    cen = (
        ms[None, :].clone()
        if centroids is None
        else c.vector(APP, "centroids", centroids, rank=(1, 2))
    )
    if cen.dim() == 1:
        cen = cen[None, :]
    d = int(ms.shape[0])
    c.check(
        APP, {"A": a, "mu_s": ms, "mu_t": mt, "threshold": t, "centroids": cen}, {"d": d}, model
    )
    app = c.new_app(
        APP,
        name,
        model=model,
        hidden_size=d,
        sites=["final.post"],
        layers=None,
        params={"t": t, "n_centroids": int(cen.shape[0])},
        derivation="Gaussian OT map between final.post last-token activations of source "
        "and target prompts (covariances shrunk + reg*I); t from the in-scope "
        "distance distribution",
        extra=metadata,
    )
    app.param("t", t)
    app.read("distance", centroids=cen).at("final.post").named("dist").cond("last_token")
    app.write("affine", matrix=a, mu_s=ms, mu_t=mt).at("final.post").cond(
        "last_token and dist <= t"
    )
    return app
