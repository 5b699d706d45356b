"""The seven MI apps of the paper (its Table 1 and section 5) as ready-made xmix apps.

Each factory takes the app's artifacts (derived with ``xmix.apps.derive``) and returns an
``xmix.lang.api.App`` to save, load and deploy like any other; ``metadata`` records the source
paper, the model, the sites and layers and how the artifacts were derived.

    from xmix.apps import refusal, derive
    r = derive.mean_difference(harmful_acts, harmless_acts)        # [d]
    refusal(r, model="meta-llama/Llama-3.1-8B-Instruct").save("refusal.xmix")

    #  app              primitive          sites
    1  refusal          write              residual.pre + attention.post + mlp.post, all layers
    2  seal             conditional write  residual.pre, one layer, "\\n\\n" inside <think>..</think>
    3  cast             conditional write  cosine read + add at residual.pre, prompt latch
    4  truth_probe      read               mlp.post, one layer, generated tokens
    5  sake             conditional write  distance read + affine at final.post, last token
    6  kl_then_steer    conditional write  probe read + add at residual.post, prompt latch
    7  steer_moe        write              router.logits, all MoE layers

and a monitor that acts (``MONITORS``): ``harm_monitor``, a probe whose score stops a request
(``App.stop``) and switches refusal steering on for its rest (``since(...)``).

Docs: docs/apps.md.
"""

from xmix.apps.artifacts import SCHEMAS, validate_artifacts
from xmix.apps.cast import cast
from xmix.apps.harm_monitor import harm_monitor
from xmix.apps.kl_then_steer import kl_then_steer
from xmix.apps.refusal import refusal
from xmix.apps.sake import sake
from xmix.apps.seal import seal
from xmix.apps.steer_moe import steer_moe
from xmix.apps.truth_probe import truth_probe

APPS = {
    "refusal": refusal,
    "seal": seal,
    "cast": cast,
    "truth_probe": truth_probe,
    "sake": sake,
    "kl_then_steer": kl_then_steer,
    "steer_moe": steer_moe,
}
MONITORS = {"harm_monitor": harm_monitor}

__all__ = [
    "APPS",
    "MONITORS",
    "SCHEMAS",
    "cast",
    "harm_monitor",
    "kl_then_steer",
    "refusal",
    "sake",
    "seal",
    "steer_moe",
    "truth_probe",
    "validate_artifacts",
]
