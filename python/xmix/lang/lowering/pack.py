"""Packing, one function per kernel: what a lowered op of each kernel carries at one layer
(its artifacts a0, a1, ... in the form the kernel reads them, and the sizes of its OpDesc).
``lower`` calls ``PACK[kernel]`` once per op and layer; the OpDesc layout is
csrc/include/xmix/control.h."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import xmix._C as _C
from xmix.lang.lowering.errors import fail
from xmix.lang.sites import ModelShape

if TYPE_CHECKING:
    from xmix.lang.api import Op
    from xmix.lang.sae import SAE


@dataclass
class Shared:
    """What the ops of one app share while it is lowered: an artifact named by several ops is
    checked once and converted to fp32 once, an SAE's kernel arrays are made once."""

    checked: set[int] = field(default_factory=set)
    fp32: dict[int, torch.Tensor] = field(default_factory=dict)
    sae_arrays: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def as_fp32(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.fp32:
            self.fp32[id(t)] = t.float()
        return self.fp32[id(t)]


@dataclass
class OpAt:
    """One op at one of its layers: what its kernel's packing reads."""

    app: str
    what: str
    op: Op
    per_layer: dict[str, list[torch.Tensor]]
    li: int
    shape: ModelShape
    shared: Shared

    def art(self, name: str) -> torch.Tensor:
        return self.per_layer[name][self.li]


@dataclass
class Packed:
    """A kernel's view of one op at one layer: its artifacts (a0, a1, ...) and the sizes of
    its OpDesc (n, m, state width, capture width, SAE flags, features, top_k)."""

    arts: dict[str, torch.Tensor] = field(default_factory=dict)
    n: int = 0
    m: int = 0
    state: int = 0
    cap: int = 0
    flags: int = 0
    features: list[int] = field(default_factory=list)
    top_k: int = 0


def _unit(x: OpAt, name: str) -> torch.Tensor:
    # Normalised in float64, so tiny or huge vectors stay finite.
    v = x.art(name).double()
    norm = float(v.norm())
    if not norm > 0:
        raise fail(x.app, x.what, f"artifact {name!r} has zero norm")
    return (v / norm).float().contiguous()


def _pack_nothing(x: OpAt) -> Packed:
    return Packed()


def _pack_probe(x: OpAt) -> Packed:
    return Packed({"a0": x.art("weight")})


def _pack_add(x: OpAt) -> Packed:
    return Packed({"a0": x.art("vector")})


def _pack_direction(x: OpAt) -> Packed:
    """ablate and clamp: the unit direction."""
    return Packed({"a0": _unit(x, "direction")})


def _pack_affine(x: OpAt) -> Packed:
    return Packed({"a0": x.art("matrix"), "a1": x.art("mu_s"), "a2": x.art("mu_t")})


def _pack_cosine(x: OpAt) -> Packed:
    # P = v v^T / v^T v does not depend on |v|: store v / |v| and 1 / (v^T v) = 1.
    a0 = _unit(x, "vector")
    return Packed(
        {"a0": a0, "a1": torch.ones(1, dtype=torch.float32)}, state=x.shape.hidden_size + 1
    )


def _pack_distance(x: OpAt) -> Packed:
    c = x.art("centroids")
    return Packed({"a0": c.reshape(-1).contiguous()}, n=int(c.shape[0]))


def _pack_router(x: OpAt) -> Packed:
    return Packed({"a0": x.art("mask")}, n=x.shape.n_experts)


def _pack_capture(x: OpAt) -> Packed:
    d = x.shape.hidden_size
    lo_d, hi_d = x.op.options.get("dims", [0, d])
    if hi_d > d:
        raise fail(x.app, x.what, f"dims {x.op.options['dims']} exceed the hidden size {d}")
    n = int(hi_d - lo_d)
    return Packed(m=int(lo_d), n=n, cap=n)


def _pack_custom(x: OpAt) -> Packed:
    if "artifact" not in x.per_layer:
        return Packed()
    a0 = x.art("artifact")
    return Packed({"a0": a0}, m=int(a0.numel()))


def _sae_choice(op: Op) -> tuple[list[int], int]:
    features = list(op.options.get("features") or op.options.get("feature") or [])
    return features, int(op.options.get("top_k", 0))


def _pack_sae_steer(x: OpAt) -> Packed:
    """The add kernel on the sum of the decoder rows (fp64, then fp32)."""
    sae = x.op.sae
    assert sae is not None  # App sets it for every SAE kernel
    features, top_k = _sae_choice(x.op)
    a0 = sae.W_dec[features].double().sum(0).float().contiguous()
    return Packed({"a0": a0}, features=features, top_k=top_k)


def _pack_sae(x: OpAt) -> Packed:
    """sae (read) and sae_clamp: the SAE's kernel arrays, the features it names."""
    sae = x.op.sae
    assert sae is not None  # App sets it for every SAE kernel
    features, top_k = _sae_choice(x.op)
    if id(sae) not in x.shared.sae_arrays:
        x.shared.sae_arrays[id(sae)] = _sae_arrays(sae)
    k = Packed(dict(x.shared.sae_arrays[id(sae)]), features=features, top_k=top_k)
    k.flags = sae_flags(sae, features_read=x.op.kernel == "sae" and not top_k)
    k.m = sae.d_sae
    if features:
        k.arts["a3"] = torch.tensor(features, dtype=torch.float32)
    k.n = len(features) or top_k
    k.cap = 2 * top_k
    return k


# Kernel -> its packing. "since" is no op an app declares (lowering makes those, _since_ops).
PACK: dict[str, Callable[[OpAt], Packed]] = {
    "probe": _pack_probe,
    "capture": _pack_capture,
    "cosine": _pack_cosine,
    "distance": _pack_distance,
    "add": _pack_add,
    "ablate": _pack_direction,
    "affine": _pack_affine,
    "clamp": _pack_direction,
    "router": _pack_router,
    "sae": _pack_sae,
    "sae_steer": _pack_sae_steer,
    "sae_clamp": _pack_sae,
    "stop": _pack_nothing,
    "custom": _pack_custom,
}


# OpDesc.flags of the SAE kernels (csrc/include/xmix/control.h: SaeFlag, SaeArch, SaeNorm).
_K = _C.constants()
SAE_ARCH = {"relu": _K["SAE_RELU"], "jumprelu": _K["SAE_JUMPRELU"], "topk": _K["SAE_TOPK"]}
SAE_NORM = {
    "none": _K["SAE_NORM_NONE"],
    "constant_norm_rescale": _K["SAE_NORM_RESCALE"],
    "layer_norm": _K["SAE_NORM_LAYER"],
}


def sae_flags(sae: SAE, features_read: bool) -> int:
    return int(
        SAE_ARCH[sae.architecture]
        | SAE_NORM[sae.normalize_activations] << _K["SAE_NORM_SHIFT"]
        | (_K["SAE_B_DEC_IN"] if sae.apply_b_dec_to_input else 0)
        | (_K["SAE_FEATURES"] if features_read else 0)
    )


def _sae_arrays(sae: SAE) -> dict[str, torch.Tensor]:
    """The kernels' view of an SAE: a0 = encoder rows [F, d], a1 = W_dec [F, d], a2 = b_enc [F]
    | threshold [F] (0 without) | b_dec [d] | k (TopK), all fp32."""
    F = sae.d_sae
    thr = sae.threshold if sae.threshold is not None else torch.zeros(F)
    aux = (
        torch.cat([sae.b_enc, thr, sae.b_dec, torch.tensor([float(sae.k or 0)])])
        .float()
        .contiguous()
    )
    return {"a0": sae.encoder_rows(), "a1": sae.W_dec.contiguous(), "a2": aux}
