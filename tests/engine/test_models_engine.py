"""The families added by the site table, through vLLM's CPU engine, one engine each.

Per family (Gemma 2, Gemma 3 text, Qwen2, Mistral, Phi-3, OLMo 2; Llama, Qwen3 and Mixtral are
in test_engine.py):
- requests without apps, with every test app deployed, give the tokens of transformers'
  greedy decoding of the unhooked model (the "unused costs nothing" check against an oracle
  other than xmix: that vanilla vLLM gives these same tokens is checked once for OLMo 2 in
  test_do_no_harm.py, and was seen for all six while adding them);
- one mixed batch (vanilla, steer, all-layer ablation, probe, a gated write, a latch, captures
  at every site) equals the transformers-path oracle, tokens exact and reads 1e-4 relative;
- the engine's own captures obey the MI convention of docs/models.md: residual.mid =
  residual.pre + attention.post and residual.post = residual.mid + mlp.post at every layer,
  which pins where the vLLM taps sit (Gemma's post-norms, vLLM's split hidden + residual).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from engine_util import PROMPTS, assert_reads_match, greedy, hf_greedy, make_llm, shutdown, tokenize
from xmix.lang.architectures import FAMILIES
from xmix.lang.sites import ModelShape
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

NEW = ["tiny-gemma2", "tiny-gemma3", "tiny-qwen2", "tiny-mistral", "tiny-phi3", "tiny-olmo2"]
MAX_TOKENS = 16
N_PROMPTS = 8
READ_RTOL = 1e-4
SITES = ("residual.pre", "attention.post", "residual.mid", "mlp.post", "residual.post")
CAP_DIMS = (0, 16)


def build_apps(shape: ModelShape, tok) -> list[xmix.App]:
    g = torch.Generator().manual_seed(4321)
    d = shape.hidden_size

    def unit():
        v = torch.randn(d, generator=g)
        return v / v.norm()

    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).at("residual.post")
    probe = xmix.App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.1).layers([2]).at("residual.post").named("p2")
    ablate = xmix.App("ablate")
    r = unit()
    for site in ("residual.pre", "attention.post", "mlp.post"):
        ablate.write("ablate", direction=r.clone()).layers("all").at(site)
    guarded = xmix.App("guarded")
    guarded.token_set("trig", ids=sorted(set(tok.encode(" the a e", add_special_tokens=False))))
    guarded.read("probe", weight=unit() * 0.5, bias=0.0).layers([1]).at("residual.mid").named("g")
    guarded.write("add", vector=unit() * 8.0, scale=1.0).layers([2]).at("attention.post").cond(
        when="token_in(trig) or generated", gate="g >= 0.5"
    )
    latch = xmix.App("latch")
    latch.param("theta", 0.0)
    latch.read("probe", weight=unit() * 0.5, bias=0.0).layers([0]).at("residual.post").named("q")
    latch.write("add", vector=unit() * 8.0, scale=1.0).layers([2, 3]).at("residual.pre").cond(
        gate="prompt_mean(q) >= theta"
    )
    cap = xmix.App("cap")
    for site in SITES:
        cap.read("capture", dims=CAP_DIMS).layers("all").at(site).named(site.replace(".", "_"))
    return [steer, probe, ablate, guarded, latch, cap]


CONTROLS = [
    None,
    {"apps": ["steer"]},
    {"apps": ["ablate", "probe"]},
    {"apps": ["probe"]},
    {"apps": ["guarded"]},
    {"apps": ["latch"]},
    {"apps": ["cap"]},
    {"apps": ["steer", "cap"], "params": {"steer": {"scale": 0.5}}},
]


@pytest.fixture(scope="module", params=NEW)
def env(request):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kind = request.param
    path = str(tiny_model_path(kind))
    tok = AutoTokenizer.from_pretrained(path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    apps = build_apps(shape, tok)
    ids = [tokenize(tok, p) for p in PROMPTS[:N_PROMPTS]]
    # Eager attention: transformers' SDPA path leaves out Gemma 2's attention logit
    # softcapping (vLLM applies it; ~1e-2 in log-probabilities on tiny-gemma2).
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    plain = hf_greedy(model, ids, MAX_TOKENS)
    from xmix.integrations.hf import attach

    oracle = attach(model, apps, tokenizer=tok)
    llm = make_llm(path)
    try:
        for a in apps:
            llm.xmix.deploy(a)
        yield dict(kind=kind, tok=tok, shape=shape, llm=llm, oracle=oracle, ids=ids, plain=plain)
    finally:
        oracle.detach()
        shutdown(llm)


def test_sites_placed_from_the_table(env):
    (st,) = env["llm"].xmix.status()
    fam = next(f for f in FAMILIES if f.tiny == env["kind"])
    L = env["shape"].n_layers
    assert st["sites"] == {**{s: L for s in SITES}, "router.logits": 0, "final.post": 1}, fam.title


def test_unused_apps_give_the_unhooked_models_tokens(env):
    outs = greedy(env["llm"], env["ids"], MAX_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == env["plain"]
    assert all(xmix.results(o) == {} for o in outs)


def test_mixed_batch_matches_the_oracle_and_the_convention(env):
    outs = greedy(env["llm"], env["ids"], MAX_TOKENS, CONTROLS)
    changed = 0
    for i, (out, ctl) in enumerate(zip(outs, CONTROLS)):
        toks = list(out.outputs[0].token_ids)
        if ctl is None:
            assert toks == env["plain"][i]
            assert xmix.results(out) == {}
            continue
        o_toks, o_res = env["oracle"].generate(
            env["ids"][i], MAX_TOKENS, apps=ctl["apps"], params=ctl.get("params")
        )
        assert toks == o_toks, f"{env['kind']} request {i} ({ctl}) differs from the oracle"
        assert_reads_match(
            xmix.results(out),
            o_res,
            f"{env['kind']} request {i} ({ctl})",
            rtol=READ_RTOL,
            scaled=True,
        )
        changed += toks != env["plain"][i]
        if ctl["apps"] == ["cap"]:  # no write between the captures: the identities hold
            _check_convention(xmix.results(out)["cap"], env["shape"].n_layers, f"request {i}")
    assert changed >= 3, "the writes in this batch should change several answers"


def _check_convention(cap: dict, L: int, what: str) -> None:
    def v(site, l):
        return np.asarray(cap[f"{site.replace('.', '_')}.{l}"]["values"], np.float64)

    for l in range(L):
        np.testing.assert_allclose(
            v("residual.mid", l),
            v("residual.pre", l) + v("attention.post", l),
            rtol=1e-4,
            atol=1e-4,
            err_msg=f"{what} layer {l}: mid != pre + attention.post",
        )
        np.testing.assert_allclose(
            v("residual.post", l),
            v("residual.mid", l) + v("mlp.post", l),
            rtol=1e-4,
            atol=1e-4,
            err_msg=f"{what} layer {l}: post != mid + mlp.post",
        )
        if l + 1 < L:
            np.testing.assert_allclose(
                v("residual.post", l), v("residual.pre", l + 1), rtol=1e-5, atol=1e-5
            )
