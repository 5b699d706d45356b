"""The three SAE primitives on the vLLM CPU engine against the transformers oracle
(xmix.integrations.hf with xmix.lang.reference): greedy tokens exact, reads within 1e-4 relative.

One engine (tiny Llama, chunked prefill, prefix caching on) for the module. The SAEs are tiny
(d = model width, F = 384) and calibrated on the model's own activations so that a tenth of
their features fire, which makes reads, gates and clamps do something.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import xmix
from engine_util import PROMPTS, greedy, hf_model, make_llm, shutdown, tokenize
from xmix.lang.sae import SAE
from xmix.lang.sites import ModelShape
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

MAX_TOKENS = 24
READ_RTOL = 1e-4
F = 384


def _stream(model, tok, layer: int, site: str) -> torch.Tensor:
    """The stream at layers.<layer>.<site> for the test prompts, rows stacked (HF hooks)."""
    rows = []
    blk = model.model.layers[layer]
    mod, pre = {
        "residual.post": (blk, False),
        "residual.mid": (blk.post_attention_layernorm, True),
        "mlp.post": (blk.mlp, False),
    }[site]
    if pre:
        hook = mod.register_forward_pre_hook(lambda m, a: rows.append(a[0][0].detach().clone()))
    else:
        hook = mod.register_forward_hook(
            lambda m, a, o: rows.append((o[0] if isinstance(o, tuple) else o)[0].detach().clone())
        )
    with torch.no_grad():
        for p in PROMPTS[:6]:
            model(input_ids=torch.tensor([tokenize(tok, p)]))
    hook.remove()
    return torch.cat(rows).float()


def calibrated_sae(x: torch.Tensor, seed: int, arch: str, hook: str, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    d = x.shape[1]
    W_enc = torch.randn(d, F, generator=g)
    W_enc /= W_enc.norm(dim=0, keepdim=True)
    b_dec = x.mean(0) if kw.get("apply_b_dec_to_input") else torch.zeros(d)
    pre = (x - b_dec) @ W_enc
    b_enc = -pre.quantile(0.9, dim=0)  # each feature fires on ~10% of tokens
    W_dec = torch.randn(F, d, generator=g)
    W_dec = W_dec / W_dec.norm(dim=1, keepdim=True) * x.norm(dim=1).mean() * 0.5
    thr = (pre + b_enc).clamp(min=0).quantile(0.5, dim=0) if arch == "jumprelu" else None
    return SAE(
        W_enc,
        b_enc,
        W_dec,
        b_dec,
        architecture=arch,
        threshold=thr,
        k=16 if arch == "topk" else None,
        hook=hook,
        **kw,
    )


def build_apps(model, tok) -> tuple[list[xmix.App], dict]:
    x1 = _stream(model, tok, 1, "residual.post")
    x2 = _stream(model, tok, 2, "residual.mid")
    relu = calibrated_sae(x1, 1, "relu", "layers.1.residual.post", apply_b_dec_to_input=True)
    jump = calibrated_sae(x2, 2, "jumprelu", "layers.2.residual.mid")
    topk = calibrated_sae(
        x1, 3, "topk", "layers.1.residual.post", normalize_activations="layer_norm"
    )
    a1 = relu.encode(x1)
    busy = int((a1 > 0).float().mean(0).argmax())  # the feature that fires most often
    f_gate = int((jump.encode(x2) > 0).float().mean(0).argmax())
    theta = float(jump.encode(x2)[:, f_gate].median())

    reads = xmix.App("sae_reads")
    reads.read("sae", sae=relu, top_k=8).named("s1")  # at the SAE's hook
    reads.read("sae", sae=topk, top_k=4).named("t1")
    reads.read("sae", sae=jump, features=[f_gate, 7, 100]).named("j2")

    gated = xmix.App("sae_gated")
    gated.read("sae", sae=jump, features=[f_gate]).named("j")
    gated.write("add", vector=relu.W_dec[busy] * 4.0).layers([3]).at("residual.pre").cond(
        gate=f"j.f{f_gate} > {theta}"
    )

    steer = xmix.App("sae_steer")
    steer.write("sae_steer", sae=relu, feature=busy, scale=6.0).named("push")

    clamp = xmix.App("sae_clamp")
    clamp.write("sae_clamp", sae=relu, feature=[busy], value=0.0).named("off")
    clamp.write("sae_clamp", sae=topk, feature=[3, 11], value=8.0).named("on")
    return [reads, gated, steer, clamp], dict(busy=busy, f_gate=f_gate)


@pytest.fixture(scope="module")
def env():
    from transformers import AutoConfig, AutoTokenizer

    from xmix.integrations.hf import attach

    path = str(tiny_model_path("tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    model = hf_model(path)
    apps, info = build_apps(model, tok)
    llm = make_llm(path)
    for a in apps:
        llm.xmix.deploy(a)
    oracle = attach(model, apps, tokenizer=tok)
    yield dict(
        tok=tok,
        shape=shape,
        llm=llm,
        oracle=oracle,
        apps=apps,
        info=info,
        ids=[tokenize(tok, p) for p in PROMPTS],
    )
    oracle.detach()
    shutdown(llm)


def assert_sae_reads_match(engine: dict, oracle: dict, what: str) -> None:
    assert set(engine) == set(oracle), f"{what}: apps with results differ"
    for app, reads in oracle.items():
        assert set(engine[app]) == set(reads), f"{what}: reads of {app} differ"
        for key, o in reads.items():
            e = engine[app][key]
            assert e["positions"] == o["positions"], f"{what}: {app}.{key} positions differ"
            for pos, ev, ov in zip(e["positions"], e["values"], o["values"]):
                where = f"{what}: {app}.{key} at {pos}"
                assert set(ev) == {"ids", "acts"}, where
                if ev["ids"] != ov["ids"]:
                    # only a near tie between neighbours may order them differently
                    n = min(len(ev["acts"]), len(ov["acts"]))
                    gap = np.abs(np.diff(np.asarray(ov["acts"][: n + 1])))
                    assert len(ev["ids"]) == len(ov["ids"]) and gap.min() < 1e-4 * max(
                        ov["acts"]
                    ), f"{where}: ids {ev['ids']} != {ov['ids']}"
                    continue
                np.testing.assert_allclose(
                    ev["acts"], ov["acts"], rtol=READ_RTOL, atol=1e-5, err_msg=where
                )


CONTROLS = [
    None,
    {"apps": ["sae_reads"]},
    {"apps": ["sae_gated"]},
    {"apps": ["sae_steer"]},
    {"apps": ["sae_clamp"]},
    {"apps": ["sae_steer", "sae_reads"], "params": {"sae_steer": {"scale": -4.0}}},
    {"apps": ["sae_clamp", "sae_reads"], "params": {"sae_clamp": {"on.value": 2.0}}},
    {"apps": ["sae_gated", "sae_clamp"]},
]


def test_sae_primitives_match_the_oracle(env):
    """One mixed batch: every request matches its own oracle run, tokens and reads."""
    ids = env["ids"]
    controls = [CONTROLS[i % len(CONTROLS)] for i in range(len(ids))]
    outs = greedy(env["llm"], ids, MAX_TOKENS, controls)
    changed = set()
    for i, (out, ctl) in enumerate(zip(outs, controls)):
        toks = list(out.outputs[0].token_ids)
        apps = ctl["apps"] if ctl else []
        o_toks, o_res = env["oracle"].generate(
            ids[i], MAX_TOKENS, apps=apps, params=(ctl or {}).get("params")
        )
        assert toks == o_toks, f"request {i} ({ctl}) differs from the oracle"
        res = xmix.results(out)
        assert_sae_reads_match(res, o_res, f"request {i} ({ctl})")
        assert json.loads(json.dumps(res)) == res, "results travel as plain JSON (HTTP)"
        if ctl:
            plain, _ = env["oracle"].generate(ids[i], MAX_TOKENS)
            if toks != plain:
                changed.update(a for a in apps if a != "sae_reads")
    assert {"sae_steer", "sae_clamp", "sae_gated"} <= changed, (
        f"each write app should change some answer; changed: {sorted(changed)}"
    )


def test_top_k_results_shape(env):
    """{positions, values}: one {"ids", "acts"} per position, every prompt and fed-back token;
    ids descending by activation, all active."""
    p = env["ids"][2]
    out = greedy(env["llm"], [p], 6, [{"apps": ["sae_reads"]}])[0]
    r = xmix.results(out)["sae_reads"]
    assert r["s1"]["positions"] == list(range(len(p) + 5))
    for v in r["s1"]["values"]:
        assert 1 <= len(v["ids"]) <= 8 and len(v["ids"]) == len(v["acts"])
        assert all(a > 0 for a in v["acts"]) and v["acts"] == sorted(v["acts"], reverse=True)
    assert all(len(v["ids"]) <= 4 for v in r["t1"]["values"])
    f = env["info"]["f_gate"]
    assert all(v["ids"] == [f, 7, 100] and len(v["acts"]) == 3 for v in r["j2"]["values"])
