"""Place hook sites in a loaded vLLM model, before torch.compile traces it.

Each site is one call of ``torch.ops.xmix.site(h, r, site_id)``, put in by replacing the
``forward`` of module instances (decoder layer, self_attn, post_attention_layernorm, mlp /
block_sparse_moe, the MoE gate, the final norm). Dynamo traces through these forwards, so the
compiled graph holds one opaque in-place op per site and nothing else.

vLLM keeps the stream split as ``hidden + residual`` (fused add-RMSNorm): residual.pre /
residual.mid / residual.post pass both halves, a read sees the sum and a write changes the
sum by changing ``hidden``. Works for the Llama, Qwen3 and Mixtral families, whose decoder
layers all read ``hidden, residual = input_layernorm(hidden, residual)``; attn; post-attention
norm; mlp; and return ``(hidden, residual)``.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

import xmix.ops  # noqa: F401  (registers torch.ops.xmix.site)
from xmix.hooks import LAYER_SITES, SITES_PER_LAYER

logger = logging.getLogger("vllm.xmix")  # vLLM's handlers and format apply

_site = torch.ops.xmix.site
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")


def _sid(layer: int, name: str) -> int:
    return layer * SITES_PER_LAYER + LAYER_SITES[name]


def _wrap_layer(layer: nn.Module, idx: int) -> None:
    orig = layer.forward
    pre, post = _sid(idx, "residual.pre"), _sid(idx, "residual.post")

    def forward(self, positions, hidden_states, residual, *args, **kwargs):
        _site(hidden_states, residual, pre)
        hidden_states, residual = orig(positions, hidden_states, residual, *args, **kwargs)
        _site(hidden_states, residual, post)
        return hidden_states, residual

    layer.forward = types.MethodType(forward, layer)


def _wrap_output(module: nn.Module, sid: int) -> None:
    """Site on the module's output (a tensor, or the first element of a tuple)."""
    orig = module.forward

    def forward(self, *args, **kwargs):
        out = orig(*args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        _site(h, None, sid)
        return out

    module.forward = types.MethodType(forward, module)


def _wrap_norm_input(norm: nn.Module, sid: int) -> None:
    """residual.mid: the post-attention norm receives (attn_out, residual); their sum is the
    stream between attention and MLP."""
    orig = norm.forward

    def forward(self, x, residual=None, *args, **kwargs):
        _site(x, residual, sid)
        return orig(x, residual, *args, **kwargs)

    norm.forward = types.MethodType(forward, norm)


def find_decoder(model: nn.Module):
    """(inner model, decoder layers) of a vLLM *ForCausalLM."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise RuntimeError(f"xmix: cannot find decoder layers in {type(model).__name__} "
                           f"(expected model.model.layers)")
    return inner, inner.layers


def place_sites(model: nn.Module, n_layers: int) -> dict[str, int]:
    """Put the hook sites in; returns counts per site kind (for the log and tests)."""
    if getattr(model, "_xmix_sites_placed", False):
        return model._xmix_sites_placed  # idempotent: the plugin may be loaded twice
    inner, layers = find_decoder(model)
    counts = {name: 0 for name in list(LAYER_SITES) + ["final.post"]}
    for idx, layer in enumerate(layers):
        if type(layer).__name__ == "PPMissingLayer":
            continue  # another pipeline stage owns this layer
        _wrap_layer(layer, idx)
        counts["residual.pre"] += 1
        counts["residual.post"] += 1
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            _wrap_output(attn, _sid(idx, "attention.post"))
            counts["attention.post"] += 1
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is not None:
            _wrap_norm_input(norm, _sid(idx, "residual.mid"))
            counts["residual.mid"] += 1
        mlp = next((getattr(layer, n) for n in MLP_NAMES if hasattr(layer, n)), None)
        if mlp is not None:
            _wrap_output(mlp, _sid(idx, "mlp.post"))
            counts["mlp.post"] += 1
            gate = getattr(mlp, "gate", None)
            # Only a gate that returns router logits (Mixtral's ReplicatedLinear): a dense
            # MLP's "gate" is not a router.
            if gate is not None and hasattr(mlp, "experts"):
                _wrap_output(gate, _sid(idx, "router.logits"))
                counts["router.logits"] += 1
    norm = getattr(inner, "norm", None)
    if norm is not None and type(norm).__name__ != "PPMissingLayer":
        _wrap_output(norm, n_layers * SITES_PER_LAYER)
        counts["final.post"] += 1
    model._xmix_sites_placed = counts
    logger.info("xmix: hook sites placed: %s", counts)
    return counts
