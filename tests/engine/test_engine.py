"""The vLLM integration on the CPU engine, per tiny model (Llama, Qwen3, Mixtral).

Oracles: vanilla vLLM with the xmix plugin off (same engine settings) for requests without
apps, and ``xmix.integrations.hf`` (transformers + xmix.reference) for requests with apps.
Engine settings force chunked prefill (64-token budget) and keep prefix caching on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import xmix
from engine_util import (
    COMPILED,
    PROMPTS,
    assert_reads_match,
    greedy,
    hf_model,
    make_llm,
    shutdown,
    tokenize,
)
from xmix.hooks import ModelShape
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral"]
# Llama runs compiled, as served. Qwen3 and Mixtral run eager: each compiled one costs two
# cold compiles (vanilla and xmix, ~2-4 min of the test budget on two cores), Qwen3's
# attention (q/k norms) runs compiled in tests/engine/test_models_moe.py's Qwen3-MoE, and MoE
# router sites under torch.compile are covered there too (Qwen3-MoE, DeepSeek-V2, gpt-oss).
ENGINE_MODE = {"tiny-llama": COMPILED, "tiny-qwen3": {}, "tiny-mixtral": {}}
MAX_TOKENS = 32


def build_apps(shape: ModelShape, tok) -> list[xmix.App]:
    g = torch.Generator().manual_seed(1234)
    d = shape.hidden_size

    def unit():
        v = torch.randn(d, generator=g)
        return v / v.norm()

    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).submodule("residual.post").named(
        "push"
    )

    probe = xmix.App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.1).layers([2]).submodule("residual.post").named(
        "p2"
    )

    guarded = xmix.App("guarded")
    guarded.token_set("trig", ids=sorted(set(tok.encode(" the a e", add_special_tokens=False))))
    guarded.read("probe", weight=unit() * 0.5, bias=0.0).layers([1]).submodule(
        "residual.mid"
    ).named("g")
    guarded.write("add", vector=unit() * 8.0, scale=1.0).layers([2]).submodule(
        "attention.post"
    ).cond(when="token_in(trig) or generated", gate="g >= 0.5")

    ablate = xmix.App("ablate")
    r = unit()
    for site in ("residual.pre", "attention.post", "mlp.post"):
        ablate.write("ablate", direction=r).layers("all").submodule(site)

    latch = xmix.App("latch")
    latch.param("theta", 0.5)
    latch.read("probe", weight=unit() * 0.5, bias=0.0).layers([0]).submodule("residual.post").named(
        "q"
    )
    latch.write("add", vector=unit() * 8.0, scale=1.0).layers([2, 3]).submodule(
        "residual.pre"
    ).cond(gate="prompt_mean(q) >= theta")

    span = xmix.App("span")
    span.token_set("open", strings=["<think>"]).token_set("close", strings=["</think>"])
    span.token_set("nl2", contains=["\n\n"])
    span.write("add", vector=unit() * 8.0, scale=1.0).layers([1]).submodule("residual.pre").cond(
        "in_span(open, close) and (token_in(nl2) or generated)"
    )

    capture = xmix.App("capture")
    capture.read("capture", dims=(0, 8)).submodule("final.post").named("h").cond("last_token")

    # a latch feeding writes before (layers 1, 2: from the first generated token) and after
    # (layer 3: from the last prompt token) its read at residual.mid of layer 2
    late = xmix.App("late")
    late.read("probe", weight=unit() * 0.5, bias=0.0).layers([2]).submodule("residual.mid").named(
        "q"
    )
    late.write("add", vector=unit() * 8.0, scale=1.0).layers([1, 2, 3]).submodule(
        "residual.pre"
    ).cond(gate="prompt_mean(q) >= 0.0")

    apps = [steer, probe, guarded, ablate, latch, span, capture, late]
    if shape.n_experts:
        mask = torch.zeros(shape.n_experts)
        mask[0], mask[1] = 1.0, -1.0
        router = xmix.App("router")
        router.write("router", mask=mask).layers("all").submodule("router.logits")
        apps.append(router)
    return apps


@pytest.fixture(scope="module", params=MODELS)
def env(request):
    from transformers import AutoConfig, AutoTokenizer

    path = str(tiny_model_path(request.param))
    tok = AutoTokenizer.from_pretrained(path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    apps = build_apps(shape, tok)
    vanilla = make_llm(path, with_xmix=False, **ENGINE_MODE[request.param])
    van_ids = [tokenize(tok, p) for p in PROMPTS]
    van_out = [list(o.outputs[0].token_ids) for o in greedy(vanilla, van_ids, MAX_TOKENS)]
    shutdown(vanilla)
    llm = make_llm(path, **ENGINE_MODE[request.param])
    for a in apps:
        llm.xmix.deploy(a)
    model = hf_model(path)
    from xmix.integrations.hf import attach

    oracle = attach(model, apps, tokenizer=tok)
    yield dict(
        kind=request.param,
        path=path,
        tok=tok,
        shape=shape,
        apps=apps,
        llm=llm,
        oracle=oracle,
        ids=van_ids,
        vanilla=van_out,
    )
    oracle.detach()
    shutdown(llm)


def test_deployed_but_unused_is_vanilla(env):
    """16 prompts x 32 greedy tokens with every test app deployed: identical to vanilla."""
    outs = greedy(env["llm"], env["ids"], MAX_TOKENS)
    assert [list(o.outputs[0].token_ids) for o in outs] == env["vanilla"]
    assert all(xmix.results(o) == {} for o in outs)


CONTROLS = [
    None,
    {"apps": ["steer"]},
    {"apps": ["probe"]},
    {"apps": ["guarded"]},
    {"apps": ["ablate"]},
    {"apps": ["steer", "probe"], "params": {"steer": {"scale": 0.5}}},
    {"apps": ["latch"], "params": {"latch": {"theta": 0.0}}},  # latch true for every prompt
    {"apps": ["latch"], "params": {"latch": {"theta": 1.0}}},  # never (sigmoid < 1)
    {"apps": ["span"]},
    {"apps": ["capture", "probe"]},
    {"apps": ["late"]},
]


def test_mixed_batch_matches_oracle(env):
    """One batch, requests using different apps and none: each matches its own oracle run."""
    apps = [a.name for a in env["apps"]]
    controls = list(CONTROLS)
    if "router" in apps:
        controls.append({"apps": ["router", "probe"]})
    controls = [controls[i % len(controls)] for i in range(len(env["ids"]))]
    outs = greedy(env["llm"], env["ids"], MAX_TOKENS, controls)
    changed = 0
    for i, (out, ctl) in enumerate(zip(outs, controls)):
        toks = list(out.outputs[0].token_ids)
        if ctl is None:
            assert toks == env["vanilla"][i], f"request {i} without apps differs from vanilla"
            assert xmix.results(out) == {}
            continue
        o_toks, o_res = env["oracle"].generate(
            env["ids"][i], MAX_TOKENS, apps=ctl["apps"], params=ctl.get("params")
        )
        assert toks == o_toks, f"request {i} ({ctl}) differs from the oracle"
        assert_reads_match(xmix.results(out), o_res, f"request {i} ({ctl})")
        changed += toks != env["vanilla"][i]
    assert changed >= 3, "the writes in this batch should change several answers"


def test_parallel_sampling_keeps_sequences_apart(env):
    """n=3 sampled sequences of one prompt with a probe: every CompletionOutput carries the
    reads of its own sequence (the oracle fed that sequence's tokens), the RequestOutput those
    of outputs[0]."""
    from vllm import SamplingParams

    ids = env["ids"][1]
    sp = SamplingParams(
        n=3,
        temperature=1.0,
        seed=11,
        max_tokens=8,
        ignore_eos=True,
        extra_args={"xmix": {"apps": ["probe"]}},
    )
    (out,) = env["llm"].generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert [co.index for co in out.outputs] == [0, 1, 2]
    seqs = {tuple(co.token_ids) for co in out.outputs}
    assert len(seqs) > 1, "sampling at temperature 1 should give different sequences"
    for co in out.outputs:
        req = env["oracle"].request(ids, apps=["probe"])
        req.prefill()
        for t in list(co.token_ids)[:-1]:  # the last sampled token is never fed back
            req.decode(t)
        assert_reads_match(xmix.results(co), req.results, f"sequence {co.index}")
    assert xmix.results(out) == xmix.results(out.outputs[0])


def test_prefix_cache_is_isolated_and_reads_complete(env):
    llm, ids = env["llm"], env["ids"]
    p = ids[0]
    # steered first, then vanilla on the same prompt: the vanilla request must not reuse the
    # steered prompt KV
    steered = greedy(llm, [p], MAX_TOKENS, [{"apps": ["steer"]}])[0]
    plain = greedy(llm, [p], MAX_TOKENS)[0]
    assert list(plain.outputs[0].token_ids) == env["vanilla"][0]
    assert list(steered.outputs[0].token_ids) != env["vanilla"][0]
    # steered again: it may reuse its own configuration's cache and must give the same answer
    again = greedy(llm, [p], MAX_TOKENS, [{"apps": ["steer"]}])[0]
    assert list(again.outputs[0].token_ids) == list(steered.outputs[0].token_ids)
    # a read after the prompt was cached by the vanilla request: every prompt position read
    probed = greedy(llm, [p], MAX_TOKENS, [{"apps": ["probe"]}])[0]
    pos = xmix.results(probed)["probe"]["p2"]["positions"]
    assert pos == list(range(len(p) + MAX_TOKENS - 1))
    _, o_res = env["oracle"].generate(p, MAX_TOKENS, apps=["probe"])
    assert_reads_match(xmix.results(probed), o_res, "probe after prefix cached")


def test_latch_over_chunked_prompt(env):
    """A prompt longer than the 64-token chunk: the latch sees the whole prompt."""
    tok = env["tok"]
    long = tokenize(tok, " ".join(PROMPTS[:8]) * 2)[:200]
    assert len(long) > 64 * 2
    # a threshold right around this prompt's mean, so the decision is not trivial
    _, r = env["oracle"].generate(long, 1, apps=["latch"], params={"latch": {"theta": 0.0}})
    q = r["latch"]["q"]
    q_mean = float(np.mean([v for p, v in zip(q["positions"], q["values"]) if p < len(long)]))
    for theta, fires in ((q_mean - 0.01, True), (q_mean + 0.01, False)):
        ctl = {"apps": ["latch"], "params": {"latch": {"theta": theta}}}
        out = greedy(env["llm"], [long], 16, [ctl])[0]
        o_toks, o_res = env["oracle"].generate(long, 16, apps=["latch"], params=ctl["params"])
        assert list(out.outputs[0].token_ids) == o_toks
        assert_reads_match(xmix.results(out), o_res, f"latch theta={theta:.3f}")
        van = greedy(env["llm"], [long], 16)[0]
        assert (list(out.outputs[0].token_ids) != list(van.outputs[0].token_ids)) == fires


def test_reusing_sampling_params(env):
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"xmix": {"apps": ["probe"]}}
    )
    before = dict(sp.extra_args)
    a = env["llm"].generate([{"prompt_token_ids": env["ids"][1]}], sp, use_tqdm=False)[0]
    b = env["llm"].generate([{"prompt_token_ids": env["ids"][1]}], sp, use_tqdm=False)[0]
    assert sp.extra_args == before
    assert xmix.results(a) == xmix.results(b) != {}


def test_in_flight_mode_changes_and_deploys(env):
    """32 requests in flight while apps are switched, deployed and undeployed: all complete."""
    from vllm import SamplingParams

    llm = env["llm"]
    engine = llm.llm_engine
    ids = env["ids"]
    n = 32
    for i in range(n):
        ctl = [None, {"apps": ["steer"]}, {"apps": ["probe"]}, {"apps": ["guarded", "probe"]}][
            i % 4
        ]
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=24,
            ignore_eos=True,
            extra_args={"xmix": ctl} if ctl else None,
        )
        engine.add_request(f"flight-{i}", {"prompt_token_ids": ids[i % len(ids)]}, sp)
    extra = xmix.App("extra")
    extra.read("probe", weight=torch.ones(env["shape"].hidden_size) / 64).layers([0]).submodule(
        "residual.pre"
    ).named("e")
    finished = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        if step == 3:
            llm.xmix.set_mode("steer", "off")
        elif step == 5:
            llm.xmix.deploy(extra, mode="all")
        elif step == 7:
            llm.xmix.set_mode("steer", "request")
            llm.xmix.set_params("probe", {"bias": 0.5})
        elif step == 9:
            llm.xmix.undeploy("extra")
        elif step == 11:
            llm.xmix.set_mode("probe", "all")
        assert step < 500
    assert len(finished) == n
    assert all(len(o.outputs[0].token_ids) == 24 for o in finished.values())
    llm.xmix.set_mode("probe", "request")
    llm.xmix.set_params("probe", {"bias": 0.1})
    assert "extra" not in [a["name"] for a in llm.xmix.apps()]
    # reads come back as a contiguous run of positions from 0 for requests that asked
    for i in range(2, n, 4):
        pos = xmix.results(finished[f"flight-{i}"])["probe"]["p2"]["positions"]
        assert pos == list(range(len(pos))) and len(pos) > 0


def test_bad_input_offline(env):
    from vllm import SamplingParams

    llm = env["llm"]
    p = [{"prompt_token_ids": env["ids"][0]}]

    def gen(ctl):
        return llm.generate(
            p, SamplingParams(max_tokens=2, extra_args={"xmix": ctl}), use_tqdm=False
        )

    cases = [
        ({"apps": ["nope"]}, "unknown app 'nope'"),
        ('{"apps": ["probe"', "not valid JSON"),
        ({"apps": "probe"}, '"apps" must be a list'),
        ({"apps": ["probe"], "params": {"probe": {"bias": "x"}}}, "must be a finite number"),
        ({"apps": ["probe"], "params": {"probe": {"nope": 1}}}, "unknown parameter 'nope'"),
        ({"apps": ["probe"], "extra": 1}, "unknown key"),
        ({"apps": ["steer"], "params": {"probe": {"bias": 1}}}, "does not use"),
    ]
    if "router" in [a.name for a in env["apps"]]:
        cases.append(({"apps": ["router"], "params": {"router": {"delta": -1.0}}}, "out of range"))
    for ctl, msg in cases:
        with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("[", r"\[")):
            gen(ctl)
    # an app that does not fit the model, and one that fails only on the workers (capacity):
    # rejected, nothing half-deployed
    before = llm.xmix.apps()
    wrong = xmix.App("wrong")
    wrong.write("add", vector=torch.ones(env["shape"].hidden_size + 1)).layers([0]).submodule(
        "residual.pre"
    )
    with pytest.raises(xmix.DeployError, match="hidden size"):
        llm.xmix.deploy(wrong)
    huge = xmix.App("huge")
    for i in range(40):  # 40 capture buffers of T x d floats exceed the capture capacity
        huge.read("capture").layers([0]).submodule("residual.pre").named(f"c{i}")
    with pytest.raises(xmix.DeployError, match="capture"):
        llm.xmix.deploy(huge)
    assert llm.xmix.apps() == before
    worker_apps = [a["name"] for a in llm.xmix.status()[0]["apps"]]
    assert worker_apps == [a["name"] for a in before]
    # the engine keeps serving
    out = greedy(llm, [env["ids"][0]], MAX_TOKENS)[0]
    assert list(out.outputs[0].token_ids) == env["vanilla"][0]


def test_hook_sites_placed(env):
    st = env["llm"].xmix.status()[0]
    L = env["shape"].n_layers
    assert st["sites"]["residual.pre"] == L and st["sites"]["attention.post"] == L
    assert st["sites"]["mlp.post"] == L and st["sites"]["final.post"] == 1
    assert st["sites"]["router.logits"] == (L if env["shape"].n_experts else 0)
