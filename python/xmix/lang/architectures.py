"""One site table per architecture family: where each hook site is, in vLLM and in transformers.

A family entry has a shared semantic part (what the tensor at each site *is*, in the MI
convention of docs/models.md) and one module map per engine, because the module names
differ (vLLM's Mixtral block is ``block_sparse_moe``, transformers' is ``mlp``; vLLM fuses
the residual add into its norms). Both ``integrations/vllm/worker/model_wrap.py`` and
``integrations/hf.py`` read the maps here and nothing else; neither probes attributes.

The MI convention, for every family:
  residual.pre    the residual stream entering decoder layer l (after the embedding scale
                  where the family has one, e.g. Gemma's sqrt(d))
  attention.post  what the attention block adds to the stream (after the post-attention
                  norm in families that have one: Gemma 2/3, OLMo 2)
  residual.mid    the stream between the attention and MLP blocks
  router.logits   the MoE router's logits, before softmax / top-k (MoE layers only)
  mlp.post        what the MLP / MoE block adds to the stream (after the post-feedforward
                  norm in families that have one)
  residual.post   the stream leaving decoder layer l
  final.post      the output of the final norm (what the LM head reads)
so that ``residual.mid == residual.pre + attention.post`` and ``residual.post ==
residual.mid + mlp.post`` hold in every family (tests/unit/test_models_sites.py checks both).

A ``Tap`` names a module inside the decoder layer (dotted path, ``""`` the layer itself) and
one tensor of its call: ``io="in"`` the argument at ``arg`` (position, keyword), ``io="out"``
the output (element 0 of a tuple). ``fused`` is vLLM's split stream: the stream there is
``hidden + residual``, the residual being the argument at ``residual_arg`` (``in``) or
element 1 of the output (``out``); a read sees the sum and a write changes it by changing
``hidden``. ``router`` names a router whose logits are computed inside its module's forward
(transformers' Mixtral router computes logits, softmax and top-k in one call): the
transformers path then re-implements that forward around the site (``hf.py``).

Adding a family: one ``Family`` below (plus its tiny model in ``xmix.models.tiny``). An
architecture without an entry is refused when xmix is asked for, with the supported list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from xmix.lang.lowering import DeployError

logger = logging.getLogger("vllm.xmix")

HIDDEN = (0, "hidden_states")


@dataclass(frozen=True)
class Tap:
    module: str
    io: str  # "in" | "out"
    arg: tuple[int, str] = HIDDEN  # io="in": the stream tensor's (position, keyword)
    fused: bool = False  # vLLM: the stream is hidden + residual
    residual_arg: tuple[int, str] = (-1, "residual")
    router: str = ""  # transformers: a router forward to re-implement

    def __post_init__(self) -> None:
        if self.io not in ("in", "out"):
            raise ValueError(f"Tap.io must be 'in' or 'out', got {self.io!r}")
        if self.fused and self.io == "in" and self.residual_arg[0] < 0:
            raise ValueError("a fused input tap needs residual_arg")


@dataclass(frozen=True)
class EngineMap:
    """Where one engine's modules are: decoder layers and final norm (dotted paths from the
    *ForCausalLM), and one Tap per per-layer site (sites absent from ``sites`` do not exist
    in the family, e.g. router.logits in dense models).

    ``fusion_gaps``: the sites that sit between a tensor-parallel all-reduce (o_proj,
    down_proj, MoE, embedding outputs) and the RMSNorm that vLLM's all-reduce + RMSNorm
    fusion (compilation/passes/fusion/allreduce_rms_fusion.py) fuses it with. The pattern
    needs the all-reduce's output to flow straight into the norm, so at
    tensor_parallel_size >= 2 a placed site there keeps the fusion from applying at that
    point of that layer (docs/models.md: cost, and how to place fewer sites)."""

    sites: dict[str, Tap]
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    fusion_gaps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    architectures: tuple[str, ...]  # config.architectures[0] (transformers == vLLM)
    vllm: EngineMap
    hf: EngineMap
    notes: dict[str, str] = field(
        default_factory=dict
    )  # site -> what differs from the convention's wording
    tiny: str = ""  # xmix.models.tiny kind
    cpu_engine: str = ""  # why vLLM's CPU engine cannot run it ("" = it can)

    @property
    def moe(self) -> bool:
        return "router.logits" in self.vllm.sites


# --- building blocks ----------------------------------------------------------------------
# vLLM decoder layers (Llama family, Gemma): forward(positions, hidden_states, residual)
# returns (hidden_states, residual); layer 0 gets residual=None.
_VLLM_LAYER_IN = Tap("", "in", arg=(1, "hidden_states"), fused=True, residual_arg=(2, "residual"))
_VLLM_LAYER_OUT = Tap("", "out", fused=True)


def _vllm_norm_in(module: str) -> Tap:
    """The input of a vLLM norm with a fused add: forward(x, residual) adds them first."""
    return Tap(module, "in", arg=(0, "x"), fused=True, residual_arg=(1, "residual"))


_LLAMA_VLLM = {
    "residual.pre": _VLLM_LAYER_IN,
    "attention.post": Tap("self_attn", "out"),
    "residual.mid": _vllm_norm_in("post_attention_layernorm"),
    "mlp.post": Tap("mlp", "out"),
    "residual.post": _VLLM_LAYER_OUT,
}
# transformers decoder layers: forward(hidden_states, ...) returns the stream; the layer
# keeps the stream it passes to post_attention_layernorm as its residual (the same tensor,
# so an in-place write there reaches both).
_LLAMA_HF = {
    "residual.pre": Tap("", "in"),
    "attention.post": Tap("self_attn", "out"),
    "residual.mid": Tap("post_attention_layernorm", "in"),
    "mlp.post": Tap("mlp", "out"),
    "residual.post": Tap("", "out"),
}
# Gemma 2/3 ("sandwich" norms): input_layernorm, attention, post_attention_layernorm, add,
# pre_feedforward_layernorm, MLP, post_feedforward_layernorm, add.
_GEMMA_VLLM = {
    "residual.pre": _VLLM_LAYER_IN,
    "attention.post": Tap("post_attention_layernorm", "out"),
    "residual.mid": _vllm_norm_in("pre_feedforward_layernorm"),
    "mlp.post": Tap("post_feedforward_layernorm", "out"),
    "residual.post": _VLLM_LAYER_OUT,
}
_GEMMA_HF = {
    "residual.pre": Tap("", "in"),
    "attention.post": Tap("post_attention_layernorm", "out"),
    "residual.mid": Tap("pre_feedforward_layernorm", "in"),
    "mlp.post": Tap("post_feedforward_layernorm", "out"),
    "residual.post": Tap("", "out"),
}
# OLMo 2 (norms after each block, none before): attention, post_attention_layernorm, add,
# MLP, post_feedforward_layernorm, add. vLLM 0.32 serves it with its Transformers modeling
# backend, i.e. with transformers' own decoder layers: the same map for both engines.
_OLMO2 = {
    "residual.pre": Tap("", "in"),
    "attention.post": Tap("post_attention_layernorm", "out"),
    "residual.mid": Tap("mlp", "in", arg=(0, "x")),
    "mlp.post": Tap("post_feedforward_layernorm", "out"),
    "residual.post": Tap("", "out"),
}

_GEMMA_NOTES = {
    "residual.pre": "after the sqrt(d) embedding scale at layer 0",
    "attention.post": "output of post_attention_layernorm (not the raw o_proj output)",
    "residual.mid": "input of pre_feedforward_layernorm",
    "mlp.post": "output of post_feedforward_layernorm (not the raw down_proj output)",
}


# Llama-style layers: o_proj's all-reduce feeds post_attention_layernorm's fused add, and
# down_proj's (the embedding's, before layer 0) the next input_layernorm's or the final norm's.
# In Gemma and OLMo 2 a norm without a residual follows each all-reduce and every site sits
# after that norm (or before a norm that no all-reduce feeds): no gaps.
_LLAMA_GAPS = ("residual.pre", "attention.post", "residual.mid", "mlp.post", "residual.post")


def _llama_like(name: str, title: str, arch: str, tiny: str, **kw) -> Family:
    return Family(
        name,
        title,
        (arch,),
        EngineMap(_LLAMA_VLLM, fusion_gaps=_LLAMA_GAPS),
        EngineMap(_LLAMA_HF),
        tiny=tiny,
        **kw,
    )


FAMILIES: tuple[Family, ...] = (
    _llama_like("llama", "Llama 2/3", "LlamaForCausalLM", "tiny-llama"),
    _llama_like("qwen2", "Qwen2 / Qwen2.5", "Qwen2ForCausalLM", "tiny-qwen2"),
    _llama_like("qwen3", "Qwen3", "Qwen3ForCausalLM", "tiny-qwen3"),
    _llama_like("mistral", "Mistral", "MistralForCausalLM", "tiny-mistral"),
    _llama_like(
        "phi3",
        "Phi-3",
        "Phi3ForCausalLM",
        "tiny-phi3",
        notes={
            "attention.post": "self_attn output; vLLM serves Phi-3 with its Llama code "
            "(fused qkv_proj / gate_up_proj loaded as such)"
        },
    ),
    Family(
        "mixtral",
        "Mixtral",
        ("MixtralForCausalLM",),
        EngineMap(
            {
                **_LLAMA_VLLM,
                "mlp.post": Tap("block_sparse_moe", "out"),
                "router.logits": Tap("block_sparse_moe.gate", "out"),
            },
            fusion_gaps=_LLAMA_GAPS,
        ),
        EngineMap({**_LLAMA_HF, "router.logits": Tap("mlp.gate", "out", router="mixtral")}),
        notes={
            "router.logits": "gate logits [T, n_experts] before softmax and top-k",
            "mlp.post": "sparse MoE block output",
        },
        tiny="tiny-mixtral",
    ),
    Family(
        "qwen3_moe",
        "Qwen3-MoE",
        ("Qwen3MoeForCausalLM",),
        EngineMap(
            {**_LLAMA_VLLM, "router.logits": Tap("mlp.gate", "out")}, fusion_gaps=_LLAMA_GAPS
        ),
        EngineMap({**_LLAMA_HF, "router.logits": Tap("mlp.gate", "out", router="qwen3_moe")}),
        notes={
            "router.logits": "gate logits [T, n_experts] before softmax and top-k "
            "(norm_topk_prob renormalises the k chosen); vLLM computes them "
            "inside its fused-MoE runner, which calls mlp.gate",
            "mlp.post": "sparse MoE block output (MoE layers) or the dense MLP's "
            "(mlp_only_layers, decoder_sparse_step)",
        },
        tiny="tiny-qwen3-moe",
    ),
    Family(
        "deepseek_v2",
        "DeepSeek-V2",
        ("DeepseekV2ForCausalLM",),
        EngineMap(
            {**_LLAMA_VLLM, "router.logits": Tap("mlp.gate", "out")}, fusion_gaps=_LLAMA_GAPS
        ),
        EngineMap({**_LLAMA_HF, "router.logits": Tap("mlp.gate", "out", router="deepseek_v2")}),
        notes={
            "attention.post": "self_attn output: multi-head latent attention (MLA), after o_proj",
            "router.logits": "gate logits [T, n_routed_experts] (the linear gate, in fp32) "
            "before the softmax scores, the group-limited choice (n_group, "
            "topk_group) and top-k; shared experts are not routed",
            "mlp.post": "MoE block output: routed experts (times routed_scaling_factor) plus "
            "the shared experts; the dense MLP's in the first_k_dense_replace layers",
        },
        tiny="tiny-deepseek-v2",
    ),
    Family(
        "gpt_oss",
        "GPT-OSS",
        ("GptOssForCausalLM",),
        EngineMap(
            {
                "residual.pre": Tap(
                    "", "in", arg=(0, "hidden_states"), fused=True, residual_arg=(2, "residual")
                ),
                "attention.post": Tap("attn", "out"),
                "residual.mid": _vllm_norm_in("post_attention_layernorm"),
                "router.logits": Tap("mlp.router", "out"),
                "mlp.post": Tap("mlp", "out"),
                "residual.post": _VLLM_LAYER_OUT,
            },
            fusion_gaps=_LLAMA_GAPS,
        ),
        EngineMap({**_LLAMA_HF, "router.logits": Tap("mlp.router", "out", router="gpt_oss")}),
        notes={
            "attention.post": "attention output after o_proj (vLLM's module is attn, "
            "transformers' self_attn; attention sinks inside)",
            "router.logits": "router logits [T, n_experts] with the router's bias, before "
            "top-k; the softmax runs over the k chosen logits only",
            "mlp.post": "MoE block output (transformers' mlp returns (output, scores): the output)",
        },
        tiny="tiny-gpt-oss",
    ),
    Family(
        "gemma2",
        "Gemma 2",
        ("Gemma2ForCausalLM",),
        EngineMap(_GEMMA_VLLM),
        EngineMap(_GEMMA_HF),
        notes=_GEMMA_NOTES,
        tiny="tiny-gemma2",
    ),
    Family(
        "gemma3",
        "Gemma 3 (text)",
        ("Gemma3ForCausalLM",),
        EngineMap(_GEMMA_VLLM),
        EngineMap(_GEMMA_HF),
        notes=_GEMMA_NOTES,
        tiny="tiny-gemma3",
    ),
    Family(
        "olmo2",
        "OLMo 2",
        ("Olmo2ForCausalLM",),
        EngineMap(_OLMO2),
        EngineMap(_OLMO2),
        notes={
            "attention.post": "output of post_attention_layernorm",
            "residual.mid": "input of the MLP (OLMo 2 has no pre-MLP norm)",
            "mlp.post": "output of post_feedforward_layernorm",
        },
        tiny="tiny-olmo2",
    ),
)

_BY_ARCH: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}


def engine_map(family: Family, model) -> EngineMap:
    """The map for a model object vLLM built: its own implementation (``family.vllm``), or,
    when vLLM serves the family with its Transformers modeling backend (OLMo 2 in vLLM 0.32,
    or any family with ``model_impl="transformers"``), transformers' decoder layers
    (``family.hf``)."""
    return family.hf if type(model).__name__.startswith("Transformers") else family.vllm


class UnsupportedArchitecture(DeployError):
    """xmix was asked for on a model family it has no site table for."""


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def family_of(architecture: str) -> Family | None:
    return _BY_ARCH.get(architecture)


def architecture_of(config) -> str:
    """The architecture a transformers/vLLM config declares ("" if none)."""
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else ""


def require_family(architecture: str, where: str = "") -> Family:
    """The family of ``architecture``, or UnsupportedArchitecture naming it and listing the
    supported ones (never a silent no-op)."""
    fam = family_of(architecture)
    if fam is None:
        at = f" ({where})" if where else ""
        raise UnsupportedArchitecture(
            f"xmix has no site table for architecture {architecture or '<none declared>'!r}{at}; "
            f"supported: {', '.join(supported_architectures())}. "
            f"See docs/models.md for how to add a family."
        )
    return fam


def resolve(root, path: str):
    """The submodule at a dotted ``path`` of ``root`` ("" = root); None if absent."""
    obj = root
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


__all__ = [
    "FAMILIES",
    "Family",
    "EngineMap",
    "Tap",
    "UnsupportedArchitecture",
    "architecture_of",
    "engine_map",
    "family_of",
    "require_family",
    "resolve",
    "supported_architectures",
]


def check_architecture(model: str, **kwargs) -> None:
    """Refuse a model family without a site table before any engine process starts (the
    workers check again: this is only the early, readable error). A config that cannot be
    read here (a format only vLLM reads) is left to the workers."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(
            model,
            trust_remote_code=bool(kwargs.get("trust_remote_code")),
            revision=kwargs.get("revision"),
        )
    except Exception as e:  # noqa: BLE001 - any failure: the workers decide
        logger.debug("xmix: config of %s not read here (%s); the workers check it", model, e)
        return
    require_family(architecture_of(cfg), model)
