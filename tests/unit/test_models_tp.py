"""Hook sites and vLLM's all-reduce + RMSNorm fusion at tensor_parallel_size >= 2, on CPU.

vLLM's fusion pass (compilation/passes/fusion/allreduce_rms_fusion.py) needs a GPU with
FlashInfer and cannot even be imported without CUDA ops; its patterns are restated here as
written there (AllReduceRMSNormPattern, AllReduceFusedAddRMSNormPattern and its
first-output-only form, and the Gemma variants; epsilon 1e-5) and matched with torch's
pattern matcher, as the pass does, on graphs traced from vLLM's own decoder-layer code
(``LlamaDecoderLayer.forward``, ``Gemma2DecoderLayer.forward``) and norms (``RMSNorm``,
``GemmaRMSNorm``), with attention and MLP stand-ins that end in vLLM's
``tensor_model_parallel_all_reduce`` as o_proj / down_proj do, under a two-rank tensor-parallel
group stand-in, and after vLLM's IR functionalization (maybe_inplace -> default, as
VllmIRInplaceFunctionalizationPass does before the fusion passes).

What the table (``EngineMap.fusion_gaps``) and docs/models.md claim, checked by counting
matches: without sites every all-reduce fuses; in Llama-style layers a placed site between
an all-reduce and its norm stops that fusion and only there (placing sites on some layers
keeps it on the others); in Gemma no site stops any.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pm = pytest.importorskip("torch._inductor.pattern_matcher")

from xmix.lang.architectures import family_of  # noqa: E402

D = 16
EPS = 1e-5


class _TwoRanks:
    """vLLM's GroupCoordinator as tensor_model_parallel_all_reduce sees it with 2 ranks: the
    all-reduce is the out-of-place custom op ``vllm.all_reduce`` (fake impl when traced)."""

    world_size = 2
    rank_in_group = 0
    unique_name = "tp:0"

    def all_reduce(self, x):
        return torch.ops.vllm.all_reduce(x, group_name=self.unique_name)


@pytest.fixture(scope="module")
def vllm_tp():
    ps = pytest.importorskip("vllm.distributed.parallel_state")
    import vllm.ir
    from vllm.config import VllmConfig, set_current_vllm_config

    old = ps._TP
    ps._TP = _TwoRanks()
    try:
        # the IR ops wrapped as torch ops, as a compiled engine has them when its fusion pass
        # runs: an eager in-process engine alive in this test process (apps_oracle's session
        # engines) unwraps them "for the worker's lifetime", and the decoder layers traced here
        # would then hold no vllm_ir nodes for the patterns (CI, 2026-12-04)
        with set_current_vllm_config(VllmConfig()), vllm.ir.enable_torch_wrap(True):
            yield
    finally:
        ps._TP = old


@torch.library.custom_op("xmix_test::fused_allreduce_norm", mutates_args=())
def fused(x: torch.Tensor) -> torch.Tensor:
    """The replacement's stand-in for FlashInfer's fused kernel: only matches are counted."""
    return x.clone()


@fused.register_fake
def _(x):
    return torch.empty_like(x)


_PATTERNS = []


def _first_output(fn):
    """The pass's first_return_only: the same pattern where only the norm's output is used."""
    return lambda r, i, w_: fn(r, i, w_)[0]


def _patterns():
    """The fusion pass's patterns, registered once (the matcher dedups seen patterns)."""
    if _PATTERNS:
        return _PATTERNS[0]
    import vllm.ir
    from vllm.distributed import tensor_model_parallel_all_reduce as all_reduce

    passes = pm.PatternMatcherPass(pass_name="xmix_test_allreduce_rms")

    def rms(input, weight):
        ar = all_reduce(input)
        return vllm.ir.ops.rms_norm(ar, weight, EPS), ar

    def gemma_rms(input, weight):
        ar = all_reduce(input)
        return vllm.ir.ops.rms_norm(ar, weight.float() + 1.0, EPS), ar

    def add_rms(residual, input, weight):
        ar = all_reduce(input)
        return vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, EPS)

    def gemma_add_rms(residual, input, weight):
        ar = all_reduce(input)
        return vllm.ir.ops.fused_add_rms_norm(ar, residual, weight.float() + 1.0, EPS)

    def two(a, b):
        return fused(a), fused(b)

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # as vLLM's enable_fake_mode: patterns are traced on fake tensors
        # distinct tensors per argument: a tensor passed twice would trace as one input
        x, r, w = torch.empty(5, D), torch.empty(5, D), torch.empty(D)
        for p in (rms, gemma_rms):
            pm.register_replacement(p, lambda i, w_: two(i, i), [x, w], pm.fwd_only, passes)
        for p in (add_rms, gemma_add_rms):
            pm.register_replacement(p, lambda r_, i, w_: two(i, r_), [r, x, w], pm.fwd_only, passes)
            pm.register_replacement(
                _first_output(p), lambda r_, i, w_: fused(i), [r, x, w], pm.fwd_only, passes
            )
    _PATTERNS.append(passes)
    return passes


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.o = nn.Parameter(torch.randn(D, D))

    def forward(self, positions, hidden_states):
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(F.linear(hidden_states, self.o))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(F.linear(x, self.down))


def _model(kind: str, n_layers: int = 2) -> nn.Module:
    """vLLM's decoder-layer class with vLLM's norms and all-reduce-ending stand-ins."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    if kind == "llama":
        from vllm.model_executor.models.llama import LlamaDecoderLayer as Layer

        names, Norm = ("input_layernorm", "post_attention_layernorm"), RMSNorm
    else:
        from vllm.model_executor.models.gemma2 import Gemma2DecoderLayer as Layer

        names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        Norm = GemmaRMSNorm
    layers = []
    for _ in range(n_layers):
        layer = Layer.__new__(Layer)  # the class's forward, without its heavy __init__
        nn.Module.__init__(layer)
        for n in names:
            setattr(layer, n, Norm(D, EPS))
        layer.self_attn, layer.mlp = _Attn(), _MLP()
        layers.append(layer)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(layers)
    model.model.norm = Norm(D, EPS)
    model.kind = kind
    return model


def _forward(model, x, positions):
    """LlamaModel.forward / Gemma2Model.forward for one pipeline stage: the embedding's
    all-reduce (VocabParallelEmbedding), Gemma's sqrt(d) scale, the layers, the final norm."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    h = tensor_model_parallel_all_reduce(x)
    if model.kind == "gemma2":
        h = h * (D**0.5)
    r = None
    for layer in model.model.layers:
        h, r = layer(positions, h, r)
    h, _ = model.model.norm(h, r)
    return h


def _matches(model) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode(allow_non_fake_inputs=True):
        gm = make_fx(lambda x, p: _forward(model, x, p), tracing_mode="real")(
            torch.randn(5, D), torch.arange(5)
        )
    inplace = torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace
    for node in gm.graph.nodes:
        if node.target is inplace:
            node.target = torch.ops.vllm_ir.fused_add_rms_norm.default
    return _patterns().apply(gm.graph)


def _with_sites(kind: str, **opts):
    from xmix.integrations.vllm.worker.model_wrap import place_sites

    model = _model(kind)
    arch = {"llama": "LlamaForCausalLM", "gemma2": "Gemma2ForCausalLM"}[kind]
    place_sites(model, 2, family_of(arch), opts.get("sites"), opts.get("layers"))
    return model


def test_llama_sites_in_the_fusion_gaps(vllm_tp):
    # embedding -> layer 0 input norm, and per layer o_proj -> post-attention norm and
    # down_proj -> next input norm (the final norm after the last layer)
    assert _matches(_model("llama")) == 1 + 2 * 2
    assert _matches(_with_sites("llama")) == 0
    # sites at layer 1 only: layer 0's two fusions before its down_proj stay
    assert _matches(_with_sites("llama", layers=[1])) == 2
    # sites outside the gaps cost no fusion
    assert set(family_of("LlamaForCausalLM").vllm.fusion_gaps) >= {"residual.pre", "residual.mid"}
    assert _matches(_with_sites("llama", sites=["final.post"])) == 5
    assert _matches(_with_sites("llama", sites=["attention.post"])) == 5 - 2


def test_gemma_sites_leave_every_fusion(vllm_tp):
    # per layer: o_proj -> post_attention_layernorm, down_proj -> post_feedforward_layernorm
    # (Gemma's embedding scale sits between the embedding's all-reduce and the first norm)
    assert _matches(_model("gemma2")) == 2 * 2
    assert family_of("Gemma2ForCausalLM").vllm.fusion_gaps == ()
    assert _matches(_with_sites("gemma2")) == 2 * 2
