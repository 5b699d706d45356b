"""Hook point names of other tools mapped to xmix sites (``layers.<L>.<site>``, ``final.post``).

xmix's sites are the stream entering a decoder layer (residual.pre), the attention output
after o_proj (attention.post), the stream between attention and MLP (residual.mid), the MLP
output (mlp.post), the stream leaving the layer (residual.post), and the final norm's output
(final.post). A hook with no equivalent (per-head attention z, MLP neurons, embeddings,
layer norm outputs inside a block) is refused with the list of what exists.

Note on TransformerLens hooks: SAEs trained on a HookedTransformer loaded with its default
processing (``center_writing_weights``, ``fold_ln``) saw a mean-centred residual stream, not
the model's own; an SAE's ``model_from_pretrained_kwargs`` says how it was trained and is
kept in the imported provenance. Gemma Scope, Llama Scope and sparsify SAEs were trained on
the model's own activations.
"""

from __future__ import annotations

import re

from xmix.interop._files import InteropError

_TL = re.compile(
    r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_mid|hook_resid_post|hook_attn_out|hook_mlp_out)$"
)
_TL_SITE = {
    "hook_resid_pre": "residual.pre",
    "hook_resid_mid": "residual.mid",
    "hook_resid_post": "residual.post",
    "hook_attn_out": "attention.post",
    "hook_mlp_out": "mlp.post",
}
_HF = re.compile(r"^(?:[A-Za-z_]+\.)*layers\.(\d+)(?:\.(mlp|self_attn))?$")
_HF_SITE = {None: "residual.post", "mlp": "mlp.post", "self_attn": "attention.post"}

SITES_TEXT = (
    "xmix's sites: layers.<L>.residual.pre, .attention.post, .residual.mid, .mlp.post, "
    ".residual.post and final.post"
)


def from_transformer_lens(hook: str, source: str = "") -> str:
    """TransformerLens / SAELens / Llama Scope hook names, e.g. ``blocks.12.hook_resid_post``
    -> ``layers.12.residual.post``."""
    m = _TL.match(hook or "")
    if m:
        return f"layers.{int(m.group(1))}.{_TL_SITE[m.group(2)]}"
    if hook == "ln_final.hook_normalized":
        return "final.post"
    raise InteropError(
        f"{source}: hook point {hook!r} has no xmix equivalent ({SITES_TEXT}); "
        f"per-head attention (hook_z, hook_q/k/v), MLP neurons (mlp.hook_pre/post), "
        f"embeddings and norms inside a block are not hook sites"
    )


def from_hf_module(name: str, source: str = "") -> str:
    """transformers module paths as sparsify names hookpoints: ``layers.5`` (the decoder
    layer's output) -> ``layers.5.residual.post``; ``layers.5.mlp`` -> ``mlp.post``;
    ``layers.5.self_attn`` -> ``attention.post``; a ``model.`` prefix is allowed."""
    m = _HF.match(name or "")
    if m:
        return f"layers.{int(m.group(1))}.{_HF_SITE[m.group(2)]}"
    raise InteropError(
        f"{source}: hookpoint {name!r} has no xmix equivalent ({SITES_TEXT}); "
        f"sparsify names decoder layers as 'layers.N', 'layers.N.mlp', "
        f"'layers.N.self_attn'"
    )


def resolve(hook: str, source: str = "") -> str:
    """An explicit hook from the user: an xmix site, a TransformerLens name or an HF path."""
    from xmix.lang.sae import SAEError, parse_hook

    try:
        parse_hook(hook)
        return hook
    except SAEError:
        pass
    try:
        return from_transformer_lens(hook, source)
    except InteropError:
        return from_hf_module(hook, source)
