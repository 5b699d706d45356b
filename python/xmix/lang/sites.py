"""The hook surface: site names, their order in the forward pass, and site ids.

A site id is ``layer * SITES_PER_LAYER + kind``; ``final.post`` is ``n_layers *
SITES_PER_LAYER``. Ids increase in forward order, which is what "a read that runs earlier"
means. The numbers are csrc/include/xmix/control.h's (``SiteKind``, ``kSitesPerLayer``), read
from ``_C.constants()``: the kernels and the host cannot number a site differently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xmix._C as _C

_K = _C.constants()
SITES_PER_LAYER: int = _K["SITES_PER_LAYER"]

# Per-layer sites in forward order (control.h's SITE_RESIDUAL_PRE -> "residual.pre", ...):
#   residual.pre    stream entering layer l
#   attention.post  self-attention output after o_proj, before it joins the stream
#   residual.mid    stream between attention and MLP
#   router.logits   MoE router logits (MoE layers only)
#   mlp.post        MLP / MoE block output before it joins the stream
#   residual.post   stream leaving layer l
LAYER_SITES: dict[str, int] = dict(
    sorted(
        (
            (k[len("SITE_") :].lower().replace("_", "."), v)
            for k, v in _K.items()
            if k.startswith("SITE_")
        ),
        key=lambda kv: kv[1],
    )
)
MODEL_SITES = ("final.post",)  # after the final norm
SITE_NAMES = tuple(LAYER_SITES) + MODEL_SITES


def site_id(site: str, layer: int | None, n_layers: int) -> int:
    if site == "final.post":
        return n_layers * SITES_PER_LAYER
    if layer is None:
        raise ValueError(f"site {site!r} is a layer site: it needs a layer")
    return layer * SITES_PER_LAYER + LAYER_SITES[site]


def site_of(sid: int, n_layers: int) -> tuple[int | None, str]:
    """(layer, site name) of a site id; layer None for ``final.post``."""
    if sid == n_layers * SITES_PER_LAYER:
        return None, "final.post"
    layer, kind = divmod(sid, SITES_PER_LAYER)
    return layer, next(n for n, k in LAYER_SITES.items() if k == kind)


def site_name(sid: int, n_layers: int) -> str:
    layer, name = site_of(sid, n_layers)
    return name if layer is None else f"layers.{layer}.{name}"


def n_sites(n_layers: int) -> int:
    return n_layers * SITES_PER_LAYER + 1


@dataclass(frozen=True)
class ModelShape:
    """What deploy-time validation needs to know about the served model."""

    n_layers: int
    hidden_size: int
    vocab_size: int
    n_experts: int = 0  # 0 for dense models
    moe_layers: tuple[int, ...] = field(default=())
    model_name: str = ""
    architecture: str = ""  # config.architectures[0]: the site table's key

    @staticmethod
    def from_hf_config(config, model_name: str = "") -> ModelShape:
        text = getattr(config, "text_config", None) or config
        n_layers = int(text.num_hidden_layers)
        n_experts = int(
            getattr(text, "num_local_experts", 0)
            or getattr(text, "num_experts", 0)
            or getattr(text, "n_routed_experts", 0)
            or 0
        )
        moe_layers: tuple[int, ...] = ()
        if getattr(text, "n_routed_experts", None):
            # DeepSeek-V2/V3: dense before first_k_dense_replace, then every moe_layer_freq-th
            # layer (vLLM's rule; transformers ignores the frequency, 1 in every checkpoint)
            first = int(getattr(text, "first_k_dense_replace", 0) or 0)
            freq = int(getattr(text, "moe_layer_freq", 1) or 1)
            moe_layers = tuple(l for l in range(n_layers) if l >= first and l % freq == 0)
        elif n_experts:
            step = int(getattr(text, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(text, "mlp_only_layers", []) or [])
            moe_layers = tuple(l for l in range(n_layers) if (l + 1) % step == 0 and l not in dense)
        return ModelShape(
            n_layers=n_layers,
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            n_experts=n_experts,
            moe_layers=moe_layers,
            model_name=model_name or str(getattr(config, "_name_or_path", "") or ""),
            architecture=str((getattr(config, "architectures", None) or [""])[0] or ""),
        )
