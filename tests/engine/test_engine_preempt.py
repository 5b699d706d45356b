"""Slots follow requests through preemption: a KV cache far too small for the batch makes
vLLM preempt and recompute requests; requests with reads, latches, spans and monitors (a
since(...) write that starts in the prompt, a stop) still match the oracle, and requests
without apps still match each other across runs."""

from __future__ import annotations

import pytest
from test_engine import assert_monitors_match, build_apps

import xmix
from engine_util import PROMPTS, greedy, hf_model, make_llm, shutdown, tokenize
from xmix.lang.sites import ModelShape
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine


def test_preempted_requests_keep_their_apps():
    from transformers import AutoConfig, AutoTokenizer

    from xmix.integrations.hf import attach

    path = str(tiny_model_path("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    ids = [tokenize(tok, p) for p in PROMPTS[:8]]
    # the monitors fire in the prompts of requests 0 (since: steered from position 5 on) and
    # 6 (a stop at position 4: no token)
    apps = build_apps(shape, tok, halt_ids=[ids[6][4]], switch_ids=[ids[0][5]])
    # 6 blocks of 32 tokens for 8 requests of ~60 tokens each: preemption is certain
    # a plain vllm.LLM asking for xmix in its config: the entry-point plugin alone gives it llm.xmix
    llm = make_llm(
        path,
        plain=True,
        num_gpu_blocks_override=6,
        block_size=32,
        max_num_seqs=8,
        max_model_len=128,
    )
    try:
        for a in apps:
            llm.xmix.deploy(a)
        controls = [
            {"apps": ["probe", "switch"]},
            {"apps": ["latch"], "params": {"latch": {"theta": 0.0}}},
            {"apps": ["span"]},
            None,
            {"apps": ["steer", "probe"]},
            {"apps": ["guarded"]},
            {"apps": ["capture", "halt"]},
            {"apps": ["ablate"]},
        ]
        outs = greedy(llm, ids, 40, controls)
        restarts = sum(s["stats"]["restarts"] for s in llm.xmix.status())
        assert restarts > 0, "the test must preempt"
        model = hf_model(path)
        with attach(model, apps, tokenizer=tok) as oracle:
            for i, (out, ctl) in enumerate(zip(outs, controls)):
                o_toks, o_res = oracle.generate(
                    ids[i], 40, apps=(ctl or {}).get("apps", []), params=(ctl or {}).get("params")
                )
                assert_monitors_match(out.outputs[0], o_toks, o_res, f"request {i} ({ctl})")
            assert xmix.monitors(outs[0])["switched"][0]["position"] <= 5
            assert xmix.monitors(outs[6])["stopped"]["position"] <= 4
    finally:
        shutdown(llm)
