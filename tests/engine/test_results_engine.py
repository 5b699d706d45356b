"""Read results at scale on the CPU engine, offline: results as tensors in the request's dtype,
windows, NaN reads, the byte cap, and ``xmix capture`` (files against the transformers
oracle, a killed-then-resumed run, memory of a long run).

One engine for the module (tiny Llama); the first test runs the ``xmix capture`` command in a
process of its own, before that engine starts, and kills it mid-run."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import xmix
from engine_util import ENGINE_KW, PROMPTS, make_llm, shutdown
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

D = 256
SITES = "layers.1.residual.post,final.post"
NAN_KERNEL = r"""
#include <cmath>
#include "xmix/custom.h"
// NaN at even positions, the position at odd ones: a read whose real value is NaN
extern "C" void nan_at_even(const xmix_custom_args* a) {
  for (int t = 0; t < a->n_rows; ++t)
    if (a->select[t]) a->out[t] = (a->tok_pos[t] % 2 == 0) ? NAN : static_cast<float>(a->tok_pos[t]);
}
"""
STATE: dict = {}


def _prompts_file(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps({"prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})", "id": f"q{i}"}) + "\n"
            )
    return path


def _engine_cli_args() -> list[str]:
    return [
        "--model-dtype",
        "float32",
        "--max-model-len",
        str(ENGINE_KW["max_model_len"]),
        "--seed",
        "0",
        "--gpu-memory-utilization",
        "0.3",
        "--max-num-batched-tokens",
        str(ENGINE_KW["max_num_batched_tokens"]),
        "--max-num-seqs",
        str(ENGINE_KW["max_num_seqs"]),
        "--enable-prefix-caching",
        *(["--enforce-eager"] if ENGINE_KW["enforce_eager"] else []),  # as the module's engine
    ]


def _load_dir(d: Path) -> dict:
    from safetensors import safe_open

    out = {"index": json.loads((d / "index.json").read_text())}
    for f in sorted(d.glob("shard-*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out[f.name] = ({k: sf.get_tensor(k) for k in sf.keys()}, sf.metadata())
    return out


def test_capture_command_killed_midway(tmp_path_factory):
    """``xmix capture`` in a process of its own, killed (SIGKILL) once a few shards are on disk;
    the resumed run is checked against an uninterrupted one below."""
    tmp = tmp_path_factory.mktemp("capture")
    prompts = _prompts_file(tmp / "prompts.jsonl", 600)
    out = tmp / "killed"
    model = str(tiny_model_path("tiny-llama"))
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "capture",
        model,
        "--prompts",
        str(prompts),
        "--sites",
        SITES,
        "--out",
        str(out),
        "--shard-mb",
        "0.5",
        "--no-progress",
        *_engine_cli_args(),
    ]
    log = open(tmp / "capture.log", "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    killed_at = None
    t0 = time.time()
    try:
        while proc.poll() is None and time.time() - t0 < 500:
            idx = out / "index.json"
            if idx.exists():
                try:
                    n = len(json.loads(idx.read_text())["shards"])
                except ValueError:
                    n = 0
                if n >= 3:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_at = n
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    assert killed_at is not None, (
        "the run ended before it could be killed:\n" + (tmp / "capture.log").read_text()[-3000:]
    )
    index = json.loads((out / "index.json").read_text())
    assert not index["complete"]
    STATE.update(tmp=tmp, prompts=prompts, killed=out, killed_shards=len(index["shards"]))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler to build a user kernel")
    d = tmp_path_factory.mktemp("kernel")
    (d / "k.cpp").write_text(NAN_KERNEL)
    subprocess.run(
        [
            cxx,
            "-shared",
            "-fPIC",
            "-O1",
            "-I",
            str(xmix.custom_include_dir()),
            "-o",
            str(d / "libk.so"),
            str(d / "k.cpp"),
        ],
        check=True,
    )
    return str(d / "libk.so")


@pytest.fixture(scope="module")
def env(lib):
    g = torch.Generator().manual_seed(3)
    cap = xmix.App("cap")
    cap.read("capture").layers([1]).at("residual.post").named("h")
    cap.read("probe", weight=torch.randn(D, generator=g) / 16, bias=0.0).layers([2]).at(
        "residual.post"
    ).named("p")
    nan = xmix.App("nan")
    nan.read("custom", cpu_library=lib, cpu_symbol="nan_at_even").layers([0]).at(
        "residual.pre"
    ).named("n")
    path = str(tiny_model_path("tiny-llama"))
    llm = make_llm(path)
    for a in (cap, nan):
        llm.xmix.deploy(a)
    yield dict(llm=llm, path=path, cap=cap, tok=llm.get_tokenizer())
    shutdown(llm)


def _gen(env, prompt, control, max_tokens=6, n=1):
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0 if n == 1 else 1.0,
        seed=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        n=n,
        extra_args={"xmix": control},
    )
    return env["llm"].generate([prompt], sp, use_tqdm=False)[0]


def test_resumed_capture_equals_an_uninterrupted_one(env):
    if "killed" not in STATE:
        pytest.skip("needs test_capture_command_killed_midway")
    killed, prompts = STATE["killed"], STATE["prompts"]
    resumed = xmix.capture(
        None, prompts, SITES, out=killed, shard_mb=0.5, llm=env["llm"], progress=False
    ).run()
    assert resumed["complete"]
    whole = STATE["tmp"] / "whole"
    xmix.capture(
        None, prompts, SITES, out=whole, shard_mb=0.5, llm=env["llm"], progress=False
    ).run()
    a, b = _load_dir(killed), _load_dir(whole)
    assert a["index"] == b["index"]
    assert (
        sorted(a) == sorted(b) and len(a) - 1 == len(a["index"]["shards"]) > STATE["killed_shards"]
    )
    assert not list(killed.glob("*.tmp")) or all(
        p.name.removesuffix(".tmp") in a for p in killed.glob("*.tmp")
    )
    for name in a:
        if name == "index":
            continue
        (ta, ma), (tb, mb) = a[name], b[name]
        assert ma == mb and sorted(ta) == sorted(tb)
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (name, k)
    STATE["whole"] = whole


def test_capture_files_equal_the_transformers_oracle(env):
    """Every shard's activations against a transformers forward with output_hidden_states:
    layer 1's residual.post is hidden_states[2] (the output of decoder layer 1), final.post
    is the last (after the final norm)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    whole = STATE.get("whole")
    if whole is None:
        whole = STATE.setdefault("tmp_oracle", Path(env["path"]).parent)  # pragma: no cover
        pytest.skip("needs the uninterrupted capture")
    model = AutoModelForCausalLM.from_pretrained(env["path"], dtype=torch.float32).eval()
    index = json.loads((whole / "index.json").read_text())
    lines = STATE["prompts"].read_text().splitlines()
    checked = 0
    for sh in index["shards"][:4]:
        d = load_file(str(whole / sh["file"]))
        for i in range(sh["first_prompt"], sh["end_prompt"]):
            ids = env["tok"].encode(json.loads(lines[i])["prompt"])
            rows = d["request_index"] == i
            assert d["positions"][rows].tolist() == list(range(len(ids)))
            assert d["token_ids"][rows].tolist() == ids
            with torch.no_grad():
                hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for site, want in (("layers.1.residual.post", hs[2][0]), ("final.post", hs[-1][0])):
                got = d[f"acts.{site}"][rows]
                torch.testing.assert_close(
                    got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())
                )
            checked += 1
    assert checked >= 4


def test_memory_of_a_long_capture_stays_flat(env, tmp_path):
    """RSS of this process and the engine's processes after each shard of a run that writes
    ~12x more than the growth allowed: what a shard holds is released when it is written."""
    import psutil

    prompts = _prompts_file(tmp_path / "long.jsonl", 1200)
    me = psutil.Process()

    def rss() -> int:
        return me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))

    samples, written = [], 0
    run = xmix.capture(
        None,
        prompts,
        "layers.*.residual.post,final.post",
        out=tmp_path / "long",
        shard_mb=1.0,
        llm=env["llm"],
        progress=False,
    )
    for batch in run:
        written += sum(t.numel() * t.element_size() for t in batch["acts"].values())
        samples.append(rss())
    assert len(samples) >= 20 and written > 96 * 2**20
    settled = samples[len(samples) // 4]
    growth = max(samples[len(samples) // 4 :]) - settled
    assert growth < 32 * 2**20, (
        f"RSS grew by {growth / 2**20:.1f} MiB over {written / 2**20:.0f} MiB captured"
    )


def test_results_as_tensors_in_the_requests_dtype(env):
    """The same request in float32, bfloat16 and float16: the tensors are the float32 result
    rounded to the dtype, exactly; the float32 result matches the transformers-path oracle."""
    from transformers import AutoModelForCausalLM

    from xmix.integrations.hf import attach

    prompt = PROMPTS[0]
    f32 = xmix.results(_gen(env, prompt, {"apps": ["cap"]}), as_tensors=True)["cap"]
    lists = xmix.results(_gen(env, prompt, {"apps": ["cap"]}))["cap"]
    assert f32["h"]["positions"].tolist() == lists["h"]["positions"]
    assert torch.equal(f32["h"]["values"], torch.tensor(lists["h"]["values"]))
    for dt, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        t = xmix.results(_gen(env, prompt, {"apps": ["cap"], "dtype": dt}), as_tensors=True)["cap"]
        for key in ("h", "p"):
            assert t[key]["values"].dtype == tdt
            assert torch.equal(t[key]["values"], f32[key]["values"].to(tdt))
    model = AutoModelForCausalLM.from_pretrained(env["path"], dtype=torch.float32)
    ids = env["tok"].encode(prompt)
    with attach(model, [env["cap"]], tokenizer=env["tok"]) as att:
        _, o_res = att.generate(ids, 6, apps=["cap"])
    np.testing.assert_allclose(
        f32["h"]["values"].numpy(), np.array(o_res["cap"]["h"]["values"]), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "spec,want",
    [
        ("prompt", lambda p: list(range(p))),
        ("generated", lambda p: list(range(p, p + 5))),
        ("last_token", lambda p: list(range(p - 1, p + 5))),
        ([[-1, None]], lambda p: [p - 1]),
        ([[2, 4], [-3, -1]], lambda p: sorted({2, 3, p - 3, p - 2})),
    ],
)
def test_windows_report_exactly_the_positions_asked_for(env, spec, want):
    prompt = PROMPTS[2]
    p = len(env["tok"].encode(prompt))
    res = xmix.results(_gen(env, prompt, {"apps": ["cap"], "positions": spec}))
    for key in ("h", "p"):
        assert res["cap"][key]["positions"] == want(p)


def test_a_read_whose_value_is_nan_is_reported(env):
    """A user kernel's read is NaN at even positions: every position is reported (NaN values
    included); before validity flags the even positions vanished."""
    prompt = PROMPTS[1]
    p = len(env["tok"].encode(prompt))
    res = xmix.results(_gen(env, prompt, {"apps": ["nan"]}, max_tokens=4))["nan"]["n"]
    assert res["positions"] == list(range(p + 3))
    for pos, v in zip(res["positions"], res["values"]):
        assert math.isnan(v) if pos % 2 == 0 else v == float(pos)


def _counter(env, name: str) -> float:
    from prometheus_client import REGISTRY

    model = env["llm"].xmix.registry.shape.model_name
    return REGISTRY.get_sample_value(name, {"model_name": model}) or 0.0


def test_the_byte_cap_refuses_or_marks(env):
    """Known at admission (the prompt's positions x window x width): refused, with a message,
    counted. Reads of generated tokens: cut at the cap with the marker, counted."""
    prompt = PROMPTS[0]
    p = len(env["tok"].encode(prompt))
    per_pos = (1 + D) * 26 + 2 * 26  # capture h + probe p, JSON
    refused = _counter(env, "vllm:xmix_result_cap_refusals_total")
    with pytest.raises(
        ValueError, match=f"over its {p} prompt tokens.*the cap is {p * per_pos - 1} bytes"
    ):
        _gen(env, prompt, {"apps": ["cap"], "max_result_bytes": p * per_pos - 1})
    assert _counter(env, "vllm:xmix_result_cap_refusals_total") == refused + 1
    # the prompt fits exactly; 10 generated positions would not: cut after 2 of them
    cap = (p + 2) * per_pos + 5
    truncated = _counter(env, "vllm:xmix_results_truncated_total")
    res = xmix.results(_gen(env, prompt, {"apps": ["cap"], "max_result_bytes": cap}, max_tokens=11))
    assert res["!truncated"].startswith(f"truncated at {cap} bytes")
    assert res["cap"]["h"]["positions"] == list(range(p + 2))
    assert _counter(env, "vllm:xmix_results_truncated_total") == truncated + 1
    # the same in base64 at bfloat16 goes further: (4 + 2 x 256) and (4 + 2) bytes, x 4/3
    res = xmix.results(
        _gen(
            env,
            prompt,
            {"apps": ["cap"], "max_result_bytes": cap, "encoding": "base64", "dtype": "bfloat16"},
            max_tokens=11,
        )
    )
    assert "!truncated" not in res and len(res["cap"]["h"]["positions"]) == p + 10
    # n sequences share the cap
    out = _gen(env, prompt, {"apps": ["cap"], "max_result_bytes": 2 * cap}, max_tokens=11, n=2)
    for co in out.outputs:
        r = xmix.results(co)
        assert "!truncated" in r and r["cap"]["h"]["positions"] == list(range(p + 2))
