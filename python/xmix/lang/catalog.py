"""The built-in kernels: which primitive each is, its artifacts and its scalar parameters.

Scalar parameters are per request: an app carries defaults, a request may override them
(``"params": {"app": {"scale": 2.0}}``). Artifacts are tensors fixed at deploy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xmix._C as _C

FLT_MAX = 3.4028234663852886e38

# Artifact shape kinds, checked against the model at deploy.
VEC = "vector[d]"  # [d], or [n_layers, d] / [len(layers), d] per layer
MAT_DD = "matrix[d,d]"  # [d, d], or with a leading layer dimension
CENTROIDS = "centroids[k,d]"  # [k, d], or with a leading layer dimension
EXPERTS = "mask[experts]"  # [n_experts] in {-1, 0, 1}, or [n_layers, n_experts]

# SAE kernels take an xmix.SAE (``sae=``), shared by the app's ops, instead of tensors.
SAE_KERNELS = ("sae", "sae_steer", "sae_clamp")
# The kernels' bounds (csrc/include/xmix/control.h): top_k of an "sae" read (ids + activations
# per token); features=[...] of an "sae" read, feature=[...] of a clamp.
MAX_TOP_K: int = _C.constants()["SAE_MAX_TOP_K"]
MAX_SAE_FEATURES: int = _C.constants()["SAE_MAX_FEATURES"]


@dataclass(frozen=True)
class Param:
    default: float
    lo: float = -FLT_MAX
    hi: float = FLT_MAX
    doc: str = ""


@dataclass(frozen=True)
class Kernel:
    name: str
    primitive: str  # "read", "write", "either" (custom) or "control" (monitors)
    code: str  # OP_* constant name in control.h
    artifacts: dict[str, str] = field(default_factory=dict)
    params: dict[str, Param] = field(default_factory=dict)
    sites: tuple[str, ...] | None = None  # None: any site except router.logits
    doc: str = ""


KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "probe",
            "read",
            "OP_PROBE",
            {"weight": VEC},
            {"bias": Param(0.0, doc="b in sigmoid(w.x + b)")},
            doc="sigmoid(w . x + b) per token",
        ),
        Kernel(
            "capture",
            "read",
            "OP_CAPTURE",
            {},
            doc="the raw stream vector per token (optionally a dims=(start, stop) slice)",
        ),
        Kernel(
            "cosine",
            "read",
            "OP_COSINE",
            {"vector": VEC},
            doc="CAST: cos(m, tanh(P m)), P = v v^T / v^T v, m = mean over the prompt; "
            "one value per request, at the last prompt token",
        ),
        Kernel(
            "distance",
            "read",
            "OP_DISTANCE",
            {"centroids": CENTROIDS},
            doc="min_k ||x - mu_k|| per token",
        ),
        Kernel(
            "add",
            "write",
            "OP_ADD",
            {"vector": VEC},
            {"scale": Param(1.0, doc="s in x += s v")},
            doc="x += s v",
        ),
        Kernel(
            "ablate",
            "write",
            "OP_ABLATE",
            {"direction": VEC},
            doc="x -= (x . r) r with r normalised to unit length at deploy",
        ),
        Kernel(
            "affine",
            "write",
            "OP_AFFINE",
            {"matrix": MAT_DD, "mu_s": VEC, "mu_t": VEC},
            doc="x <- A (x - mu_s) + mu_t",
        ),
        Kernel(
            "clamp",
            "write",
            "OP_CLAMP",
            {"direction": VEC},
            {
                "min": Param(-FLT_MAX, doc="lower bound of x . u"),
                "max": Param(FLT_MAX, doc="upper bound of x . u"),
            },
            doc="clamp the component of x along unit u to [min, max]",
        ),
        Kernel(
            "router",
            "write",
            "OP_ROUTER",
            {"mask": EXPERTS},
            {"delta": Param(0.01, lo=0.0, doc="margin for forced experts")},
            sites=("router.logits",),
            doc="router logits -> log-softmax; mask +1: max + delta, -1: min - delta",
        ),
        Kernel(
            "sae",
            "read",
            "OP_SAE_READ",
            {},
            doc="SAE encoder (xmix.SAE): top_k=K -> per token the K largest active features "
            "as {ids, acts}; features=[...] -> the activations of those features",
        ),
        Kernel(
            "sae_steer",
            "write",
            "OP_ADD",
            {},
            {"scale": Param(1.0, doc="a in x += a W_dec[f]")},
            doc="x += a W_dec[f] (summed over feature=[...]): the add kernel on decoder rows",
        ),
        Kernel(
            "sae_clamp",
            "write",
            "OP_SAE_CLAMP",
            {},
            {"value": Param(0.0, doc="c: the activation the features are set to")},
            doc="x += sum_f (c - a_f(x)) W_dec[f]: features set to c, the SAE's error kept",
        ),
        Kernel(
            "stop",
            "control",
            "OP_STOP",
            {},
            doc="App.stop(when=...): the request ends with the first token where the "
            "condition holds (nothing sampled after it is emitted)",
        ),
        Kernel(
            "since",
            "control",
            "OP_SINCE",
            {},
            doc="the state of a since(...) condition: decided after its reads' site, never "
            "declared by an app (lowering places one per distinct since(...) term)",
        ),
        Kernel(
            "custom",
            "either",
            "OP_CUSTOM",
            {},
            doc="a user kernel with the xmix_custom_args ABI (csrc/include/xmix/custom.h)",
        ),
    )
}

READ_KERNELS = tuple(k for k, v in KERNELS.items() if v.primitive == "read")
WRITE_KERNELS = tuple(k for k, v in KERNELS.items() if v.primitive == "write")
CONTROL_KERNELS = tuple(k for k, v in KERNELS.items() if v.primitive == "control")
