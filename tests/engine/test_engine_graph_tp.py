"""The compiled graph keeps torch.compile's work intact, and tensor parallelism.

- Inductor's output code (TORCH_LOGS=output_code) of an xmix engine holds one in-place
  ``torch.ops.xmix.site`` call per hook site on the buffer the graph goes on to use, and no
  clone or copy. (The stream is materialised at sites: vanilla Inductor on the CPU recomputes
  the embedding-plus-residual chain inside each norm kernel instead.)
- tensor_parallel_size=2 (two CPU processes): hooks run on both ranks, results come from
  rank 0, and tokens and reads equal the single-process engine's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import xmix
from engine_util import PROMPTS, greedy, make_llm, shutdown, tokenize
from xmix.lang.program_codec import program_of
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if __name__ == "__main__":
        import xmix
        llm = xmix.LLM(model=sys.argv[1], dtype="float32", max_model_len=512, seed=0)
        from vllm import SamplingParams
        llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=2), use_tqdm=False)
""")


def _output_code(model: str, tmp) -> str:
    script = tmp / "compile_probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TORCH_LOGS": "output_code", "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [
        l.split("[__output_code]", 1)[1]
        for l in (r.stdout + r.stderr).splitlines()
        if "[__output_code]" in l
    ]
    assert lines, "no Inductor output code was logged"
    return "\n".join(lines)


def test_sites_add_no_copies_to_the_compiled_graph(tmp_path):
    # xmix's engine alone. What a vanilla compile added here (no xmix op in vanilla's code)
    # is test_do_no_harm.py's, more strictly: an engine that did not ask for xmix compiles
    # under VLLM_PLUGINS=none's cache key with no forward replaced. A second cold compile
    # here cost ~100 s of the suite's budget.
    xm = _output_code(str(tiny_model_path("tiny-llama")), tmp_path)
    assert "clone" not in xm and ".copy_(" not in xm and "aten.copy" not in xm
    # the first compiled function (the log may hold several compiled sizes of the same graph)
    call = xm.split("def call(")[1]
    sites = list(re.finditer(r"torch\.ops\.xmix\.site\.default\((\w+), (\w+), (\d+)\)", call))
    # 4 layers x (residual.pre, attention.post, residual.mid, mlp.post, residual.post) + final.post
    assert sorted(int(m.group(3)) for m in sites) == sorted(
        [l * 6 + k for l in range(4) for k in (0, 1, 2, 4, 5)] + [24]
    )
    # In place: each site works on a buffer the graph goes on to use, never on a copy of it.
    for m in sites[:-1]:
        buf = m.group(1)
        rest = call[m.end() :]
        assert re.search(rf"\b{buf}\b", rest), (
            f"site {m.group(3)} works on {buf}, which nothing reads"
        )
        assert not re.search(rf"{buf} = ", rest.split("torch.ops.xmix.site", 1)[0]), (
            f"{buf} is reallocated right after site {m.group(3)}"
        )


def _apps(d: int):
    g = torch.Generator().manual_seed(3)
    steer = xmix.App("steer")
    steer.write("add", vector=torch.randn(d, generator=g) * 4, scale=1.0).layers([1]).at(
        "residual.post"
    )
    probe = xmix.App("probe")
    probe.read("probe", weight=torch.randn(d, generator=g) / 8).layers([2]).at("mlp.post").named(
        "p"
    )
    ablate = xmix.App("ablate")
    ablate.write("ablate", direction=torch.randn(d, generator=g)).layers("all").at("attention.post")
    return [steer, probe, ablate]


def test_tensor_parallel_matches_single_process(monkeypatch):
    from transformers import AutoTokenizer

    path = str(tiny_model_path("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tokenize(tok, p) for p in PROMPTS[:6]]
    controls = [
        None,
        {"apps": ["steer"]},
        {"apps": ["probe"]},
        {"apps": ["ablate", "probe"]},
        {"apps": ["steer", "probe"]},
        {"apps": ["ablate"]},
    ]
    results = {}
    for tp in (1, 2):
        if tp == 2:
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        # eager: what is checked is the ranks' hooks and results; compiled serving is
        # test_server's and test_engine's
        llm = make_llm(path, tensor_parallel_size=tp)
        try:
            for a in _apps(256):
                llm.xmix.deploy(a)
            status = llm.xmix.status()
            assert len(status) == tp and all(s["sites"]["residual.pre"] == 4 for s in status)
            outs = greedy(llm, ids, 16, controls)
            results[tp] = [(list(o.outputs[0].token_ids), xmix.results(o)) for o in outs]
            if tp == 2:
                _refused_on_both_ranks(llm)
        finally:
            shutdown(llm)
    for (t1, r1), (t2, r2), ctl in zip(results[1], results[2], controls):
        assert t1 == t2, ctl
        assert set(r1) == set(r2), ctl
        if "probe" in r1:
            assert r1["probe"]["p"]["positions"] == r2["probe"]["p"]["positions"]
            np.testing.assert_allclose(
                r1["probe"]["p"]["values"], r2["probe"]["p"]["values"], rtol=1e-4, atol=1e-5
            )
    assert results[1][1][0] != results[1][0][0], "the steering app changes the answer"


def _refused_on_both_ranks(llm) -> None:
    """vLLM's MultiprocExecutor reads the workers' replies in rank order and raised at the
    first failure, leaving rank 1's reply for the next call (tests/unit/test_worker_rpc.py).
    A deploy refused on both ranks (a ghost of the same name on the workers, which the
    frontend takes off and deploys again) used to shift every later control answer."""
    ghost = xmix.App("hidden")
    ghost.write("add", vector=torch.ones(256), scale=1.0).layers([0]).at("mlp.post")
    llm.collective_rpc(
        "xmix_deploy", args=(program_of(ghost, llm.xmix.registry.shape), "request", 77)
    )
    info = llm.xmix.deploy(ghost)
    assert info["version"] != 77
    status = llm.xmix.status()
    assert len(status) == 2
    for s in status:  # each rank's own describe, not another call's reply
        assert {a["name"]: a["version"] for a in s["apps"]}["hidden"] == info["version"]
    llm.xmix.undeploy("hidden")
    assert [sorted(a["name"] for a in s["apps"]) for s in llm.xmix.status()] == [
        ["ablate", "probe", "steer"]
    ] * 2
