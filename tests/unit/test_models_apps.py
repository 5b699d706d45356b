"""Paper-app defaults for the families added by the site table: layers only where an app's
own source gives them (Mistral for the truthfulness probe, the DeepSeek-R1-Distill-Qwen models
for SEAL); elsewhere the factory asks for them."""

from __future__ import annotations

import pytest
import torch

from xmix.apps import seal, truth_probe
from xmix.apps._common import KNOWN_MODELS
from xmix.lang.api import AppError
from xmix.lang.architectures import FAMILIES


def test_known_models_name_supported_families():
    names = {f.name for f in FAMILIES}
    assert all(m.family in names for m in KNOWN_MODELS.values())


def test_defaults_from_the_apps_sources():
    app = truth_probe(torch.ones(4096), 0.0, model="mistralai/Mistral-7B-Instruct-v0.2")
    assert app.ops[0].layer_spec == [15] and app.metadata["n_layers"] == 32
    for hf_id, d in (
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 3584),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1536),
    ):
        app = seal(torch.ones(d), model=hf_id)
        assert app.ops[0].layer_spec == [20] and app.metadata["n_layers"] == 28
        with pytest.raises(AppError, match=f"hidden size 4096 but {hf_id} has {d}"):
            seal(torch.ones(4096), model=hf_id)


def test_models_without_a_source_are_asked_for_their_layer():
    for model in (
        "google/gemma-2-9b-it",
        "microsoft/Phi-3-mini-4k-instruct",
        "allenai/OLMo-2-1124-7B-Instruct",
    ):
        with pytest.raises(AppError, match="give layer="):
            seal(torch.ones(3584), model=model)
    assert seal(torch.ones(3584), 12, model="google/gemma-2-9b-it").ops[0].layer_spec == [12]


def test_steer_moe_knows_the_moe_models_its_sources_use():
    from xmix.apps import steer_moe

    for hf_id, L, E in (("Qwen/Qwen3-30B-A3B", 48, 128), ("openai/gpt-oss-20b", 24, 32)):
        app = steer_moe(torch.zeros(L, E), model=hf_id)
        assert app.ops[0].site == "router.logits" and app.ops[0].layer_spec == "all"
        with pytest.raises(AppError, match="mask"):
            steer_moe(torch.zeros(L, 8), model=hf_id)  # Mixtral's expert count
    # a model without a source (DeepSeek-V2-Lite): the mask's own shape, nothing checked against it
    assert (
        steer_moe(torch.zeros(26, 64), model="deepseek-ai/DeepSeek-V2-Lite").ops[0].layer_spec
        == "all"
    )
