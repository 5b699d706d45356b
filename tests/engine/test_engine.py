"""The vLLM integration on the CPU engine, per tiny model (Llama, Qwen3, Mixtral).

Oracles: for requests without apps, vanilla vLLM with the xmix plugin off (same engine
settings) for the compiled Llama, and transformers' greedy decoding of the unhooked model for
the eager Qwen3 and Mixtral (as in test_models_engine.py: an eager vanilla engine gave the same
tokens when these tests were written, and cost ~50 s each); ``xmix.integrations.hf``
(transformers + xmix.lang.reference) for requests with apps.
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
    hf_greedy,
    hf_model,
    make_llm,
    shutdown,
    tokenize,
)
from xmix.lang.sites import ModelShape
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral"]
# Llama runs compiled, as served. Qwen3 and Mixtral run eager: each compiled one costs two
# cold compiles (vanilla and xmix, ~2-4 min of the test budget on two cores), Qwen3's
# attention (q/k norms) runs compiled in tests/engine/test_models_moe.py's Qwen3-MoE, and MoE
# router sites under torch.compile are covered there too (Qwen3-MoE, DeepSeek-V2, gpt-oss).
ENGINE_MODE = {"tiny-llama": COMPILED, "tiny-qwen3": {}, "tiny-mixtral": {}}
MAX_TOKENS = 32
N_MON = 16  # tokens per request in the monitor test (its late triggers are before 12)


def long_prompt(tok) -> list[int]:
    """A prompt of 200 tokens: chunked (64-token budget) in every engine of these tests."""
    return tokenize(tok, " ".join(PROMPTS[:8]) * 2)[:200]


def first_seen_in(seq: list[int], lo: int, hi: int, avoid: set[int] = frozenset()) -> int | None:
    """A token id whose first occurrence in seq is at an index in [lo, hi)."""
    seen: set[int] = set()
    for i, t in enumerate(seq):
        if lo <= i < hi and t not in seen and t not in avoid:
            return t
        seen.add(t)
    return None


def build_apps(
    shape: ModelShape, tok, halt_ids: list[int] = (), switch_ids: list[int] = ()
) -> list[xmix.App]:
    """The test apps. ``halt_ids`` / ``switch_ids``: tokens that trigger the monitors "halt"
    (a stop) and "switch" (a since(...) write), besides one token first seen in the second
    prefill chunk of ``long_prompt``."""
    g = torch.Generator().manual_seed(1234)
    d = shape.hidden_size

    def unit():
        v = torch.randn(d, generator=g)
        return v / v.norm()

    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 6.0, scale=1.0).layers([1]).at("residual.post").named("push")

    probe = xmix.App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.1).layers([2]).at("residual.post").named("p2")

    guarded = xmix.App("guarded")
    guarded.token_set("trig", ids=sorted(set(tok.encode(" the a e", add_special_tokens=False))))
    guarded.read("probe", weight=unit() * 0.5, bias=0.0).layers([1]).at("residual.mid").named("g")
    guarded.write("add", vector=unit() * 8.0, scale=1.0).layers([2]).at("attention.post").cond(
        when="token_in(trig) or generated", gate="g >= 0.5"
    )

    ablate = xmix.App("ablate")
    r = unit()
    for site in ("residual.pre", "attention.post", "mlp.post"):
        ablate.write("ablate", direction=r).layers("all").at(site)

    latch = xmix.App("latch")
    latch.param("theta", 0.5)
    latch.read("probe", weight=unit() * 0.5, bias=0.0).layers([0]).at("residual.post").named("q")
    latch.write("add", vector=unit() * 8.0, scale=1.0).layers([2, 3]).at("residual.pre").cond(
        gate="prompt_mean(q) >= theta"
    )

    span = xmix.App("span")
    span.token_set("open", strings=["<think>"]).token_set("close", strings=["</think>"])
    span.token_set("nl2", contains=["\n\n"])
    span.write("add", vector=unit() * 8.0, scale=1.0).layers([1]).at("residual.pre").cond(
        "in_span(open, close) and (token_in(nl2) or generated)"
    )

    capture = xmix.App("capture")
    capture.read("capture", dims=(0, 8)).at("final.post").named("h").cond("last_token")

    # a latch feeding writes before (layers 1, 2: from the first generated token) and after
    # (layer 3: from the last prompt token) its read at residual.mid of layer 2
    late = xmix.App("late")
    late.read("probe", weight=unit() * 0.5, bias=0.0).layers([2]).at("residual.mid").named("q")
    late.write("add", vector=unit() * 8.0, scale=1.0).layers([1, 2, 3]).at("residual.pre").cond(
        gate="prompt_mean(q) >= 0.0"
    )

    # monitors: a probe's gate with theta 0 holds wherever it ran (a sigmoid is never
    # negative), so the trigger is where the token condition first holds; theta 2 never holds
    chunk2 = first_seen_in(long_prompt(tok), 70, 120)
    halt = xmix.App("halt")
    halt.param("theta", 0.0)
    halt.token_set("trig", ids=sorted({chunk2, *halt_ids}))
    halt.read("probe", weight=unit() * 0.5, bias=0.0).layers([1]).at("residual.post").named("h")
    halt.stop(when="h >= theta and token_in(trig)")

    first = xmix.App("halt_first")  # stops at the first generated token
    first.read("probe", weight=unit() * 0.5, bias=0.0).layers([2]).at("residual.mid").named("f")
    first.stop(when="generated and f >= 0")

    switch = xmix.App("switch")  # steers from the first trigger to the end of the request
    switch.param("theta", 0.0)
    switch.token_set("trig", ids=sorted({chunk2, *switch_ids}))
    switch.read("probe", weight=unit() * 0.5, bias=0.0).layers([0]).at("residual.post").named("s")
    switch.write("add", vector=unit() * 8.0, scale=1.0).layers([2]).at("residual.post").cond(
        when="since(s >= theta and token_in(trig))"
    )
    switch.read("capture", dims=(0, 4)).layers([3]).at("residual.pre").named("x").cond(
        "since(s >= theta and token_in(trig))"
    )

    apps = [steer, probe, guarded, ablate, latch, span, capture, late, halt, first, switch]
    if shape.n_experts:
        mask = torch.zeros(shape.n_experts)
        mask[0], mask[1] = 1.0, -1.0
        router = xmix.App("router")
        router.write("router", mask=mask).layers("all").at("router.logits")
        apps.append(router)
    return apps


@pytest.fixture(scope="module", params=MODELS)
def env(request):
    from transformers import AutoConfig, AutoTokenizer

    path = str(tiny_model_path(request.param))
    tok = AutoTokenizer.from_pretrained(path)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    van_ids = [tokenize(tok, p) for p in PROMPTS]
    model = hf_model(path)
    if ENGINE_MODE[request.param] is COMPILED:
        # compiled vLLM and eager transformers may part at a near tie: compiled vanilla vLLM
        vanilla = make_llm(path, with_xmix=False, **COMPILED)
        van_out = [list(o.outputs[0].token_ids) for o in greedy(vanilla, van_ids, MAX_TOKENS)]
        shutdown(vanilla)
    else:
        van_out = hf_greedy(model, van_ids, MAX_TOKENS)
    # monitor triggers a few tokens into two requests' own (unmonitored) continuations: the
    # first token seen there that neither the prompt nor the long prompt's trigger precedes
    chunk2 = first_seen_in(long_prompt(tok), 70, 120)
    late: dict[int, int] = {}
    for i in (0, 3, 9, 10, 11, 12, 13, 14, 15):
        seq = van_ids[i] + van_out[i]
        if chunk2 in seq:
            continue
        t = first_seen_in(seq, len(van_ids[i]) + 3, len(van_ids[i]) + 12)
        if t is not None and t not in late.values():
            late[i] = t
        if len(late) == 2:
            break
    assert len(late) == 2, "no continuation has a late first-seen token"
    (halt_at, halt_id), (switch_at, switch_id) = late.items()
    apps = build_apps(shape, tok, [halt_id], [switch_id])
    # the compiled Llama's engine core runs in a process of its own, as its vanilla does: the
    # offline engine's IPC for results is checked against the references here
    compiled = ENGINE_MODE[request.param] is COMPILED
    llm = make_llm(path, inproc=not compiled, **ENGINE_MODE[request.param])
    for a in apps:
        llm.xmix.deploy(a)
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
        late=(halt_at, switch_at),
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
    # the sites ran in the native kernel from the dispatcher, never in Python (issue 29)
    stats = env["llm"].xmix.status()[0]["stats"]
    assert stats["site_kernel"] == "native" and stats["python_site_calls"] == 0, stats
    assert stats["host_seconds_sites"] > 0, stats


def assert_monitors_match(co, o_toks, o_res, what):
    """One sequence against the oracle: its tokens, its stop and switches, its reads. A stop in
    the prompt ends the request in the engine's prefill chunk that holds it (its reads end
    there), the oracle's in its own (the whole prompt): the engine's positions are then a
    prefix of the oracle's, down to the trigger at least."""
    o_res = dict(o_res)
    want = {k: o_res.pop(f"!{k}") for k in ("stopped", "switched") if f"!{k}" in o_res}
    got = xmix.monitors(co)
    assert list(co.token_ids) == o_toks, f"{what}: tokens differ from the oracle"
    assert set(got) == set(want), f"{what}: monitors {got} != {want}"
    assert got.get("switched") == want.get("switched"), what
    if "stopped" in want:
        g, w = dict(got["stopped"]), dict(want["stopped"])
        assert co.finish_reason == "stop", what
        gv, wv = g.pop("value"), w.pop("value")
        assert g == w, f"{what}: stopped {got['stopped']} != {want['stopped']}"
        assert gv == pytest.approx(wv, rel=1e-4, abs=1e-5), what
        q = w["position"]
        res = xmix.results(co)
        for app, reads in res.items():
            for key, e in reads.items():
                n = len(e["positions"])
                o = o_res[app][key]
                assert e["positions"] == o["positions"][:n] and e["positions"][-1] >= q, what
                o_res[app][key] = {"positions": o["positions"][:n], "values": o["values"][:n]}
        assert_reads_match(res, o_res, what, scaled=True)
    else:
        assert_reads_match(xmix.results(co), o_res, what, scaled=True)


def test_monitors_match_oracle(env):
    """A mixed batch with monitors: stops in the prompt (one inside the second prefill chunk
    of a long prompt), on the first generated token, later in the generation and never;
    since(...) writes that start in the prompt, in the generation and never; requests
    without monitors; n = 2 sampled sequences, each with its own monitors. Each sequence
    matches the oracle (tokens, stop, switches, reads); a monitor that never fires leaves the
    request exactly as vanilla."""
    from vllm import SamplingParams

    llm, ids, tok, oracle = env["llm"], env["ids"], env["tok"], env["oracle"]
    long = long_prompt(tok)
    never = {"theta": 2.0}  # a sigmoid never reaches it
    halt_at, switch_at = env["late"]
    reqs = [
        (ids[halt_at], {"apps": ["halt"]}),  # a token of its own continuation: a later stop
        (ids[1], {"apps": ["halt"], "params": {"halt": never}}),
        (long, {"apps": ["halt", "probe"]}),  # in the long prompt's second chunk
        (ids[2], {"apps": ["halt_first"]}),
        (ids[switch_at], {"apps": ["switch"]}),  # steered from a token of its continuation on
        (ids[4], {"apps": ["switch"], "params": {"switch": never}}),
        (long, {"apps": ["switch"]}),  # steered from the long prompt's second chunk on
        (ids[5], None),
        (ids[6], {"apps": ["halt", "steer"]}),
    ]
    sampled = (ids[7], {"apps": ["halt_first", "switch"]})
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=N_MON,
            ignore_eos=True,
            extra_args={"xmix": c} if c is not None else None,
        )
        for _, c in reqs
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    kinds = set()
    for i, ((p, ctl), out) in enumerate(zip(reqs, outs)):
        if ctl is None or ctl.get("params"):
            # no monitor, or one that never fires: vanilla, token for token
            assert list(out.outputs[0].token_ids) == env["vanilla"][ids.index(p)][:N_MON], i
            assert xmix.monitors(out) == {}, i
        o_toks, o_res = oracle.generate(
            p, N_MON, apps=(ctl or {}).get("apps", []), params=(ctl or {}).get("params")
        )
        assert_monitors_match(out.outputs[0], o_toks, o_res, f"request {i} ({ctl})")
        mon = xmix.monitors(out)
        if "stopped" in mon:
            q, P = mon["stopped"]["position"], len(p)
            kinds.add(
                "chunk2" if 64 <= q < P else "prompt" if q < P else "first" if q == P else "later"
            )
            assert out.xmix_applied["stopped"] == mon["stopped"]
        for sw in mon.get("switched", ()):
            kinds.add("since-prompt" if sw["position"] < len(p) else "since-generated")
    assert {"chunk2", "first", "later", "since-prompt", "since-generated"} <= kinds, kinds
    # n = 2: each sampled sequence stops at its own first generated token, against the oracle
    # fed that sequence's tokens (alone: vLLM 0.32's CPU runner fails a seeded request whose
    # prompt is split over prefill chunks, "CPU Generator does not use offset")
    sp = SamplingParams(
        n=2,
        temperature=1.0,
        seed=5,
        max_tokens=N_MON,
        ignore_eos=True,
        extra_args={"xmix": sampled[1]},
    )
    (out,) = llm.generate([{"prompt_token_ids": sampled[0]}], sp, use_tqdm=False)
    assert [co.index for co in out.outputs] == [0, 1]
    for co in out.outputs:
        req = oracle.request(sampled[0], apps=sampled[1]["apps"])
        req.prefill()
        for t in co.token_ids:
            assert req.stopped is None, f"sequence {co.index} ran past the oracle's stop"
            req.decode(t)
        assert_monitors_match(co, list(co.token_ids), req.report(), f"sequence {co.index}")
        assert len(co.token_ids) == 1 and xmix.monitors(co)["stopped"]["app"] == "halt_first"


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
    extra.read("probe", weight=torch.ones(env["shape"].hidden_size) / 64).layers([0]).at(
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
    wrong.write("add", vector=torch.ones(env["shape"].hidden_size + 1)).layers([0]).at(
        "residual.pre"
    )
    with pytest.raises(xmix.DeployError, match="hidden size"):
        llm.xmix.deploy(wrong)
    huge = xmix.App("huge")
    for i in range(40):  # 40 capture buffers of T x d floats exceed the capture capacity
        huge.read("capture").layers([0]).at("residual.pre").named(f"c{i}")
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
