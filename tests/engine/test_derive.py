"""``xmix derive`` on tiny-llama through the vLLM CPU engine.

The derivations run in-process on the engine that the paper-app tests also use (one
engine per session), except one real ``xmix derive truth_probe`` subprocess that proves the
command works end to end. Each derived app is loaded from its file, deployed and checked for
the effect its paper defines; the collected activations are checked against the transformers
model's own hidden states.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import xmix
from apps_oracle import CMP, cast_score, lines, shared_llm
from engine_util import hf_model
from xmix.apps import collect as AC
from xmix.apps import derive_cli as DC
from xmix.lang import conditions as C
from xmix.models.tiny import tiny_model_path

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "examples" / "prompts"
KIND = "tiny-llama"
F64 = torch.float64


@pytest.fixture(scope="module")
def hfm():
    from transformers import AutoTokenizer

    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the transformers side: small matmuls next to busy engine processes
    path = str(tiny_model_path(KIND))
    yield {"tok": AutoTokenizer.from_pretrained(path), "hf": hf_model(path)}
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def env(hfm, request):
    return {**hfm, "llm": shared_llm(KIND, request.config)}


def hf_states(env, prompts: list[str]) -> list[tuple]:
    """hidden_states (residual.pre of each layer, then the final norm's output) per prompt."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([env["tok"].encode(p)])
            out.append(env["hf"](ids, output_hidden_states=True).hidden_states)
    return out


def mlp_post_all(env, ids: list[int], layer: int) -> torch.Tensor:
    """mlp.post of ``layer`` at every token, from a forward hook on the transformers MLP."""
    grab = {}
    h = (
        env["hf"]
        .model.layers[layer]
        .mlp.register_forward_hook(lambda m, a, o: grab.__setitem__("x", o[0].detach().clone()))
    )
    try:
        with torch.no_grad():
            env["hf"](torch.tensor([ids]))
    finally:
        h.remove()
    return grab["x"]


def mlp_post(env, prompts: list[str], layer: int) -> torch.Tensor:
    """mlp.post of ``layer`` at the last token of each prompt."""
    return torch.stack([mlp_post_all(env, env["tok"].encode(p), layer)[-1] for p in prompts])


def generate(llm, prompts: list[list[int]], apps: list[str], max_tokens: int = 1):
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"xmix": {"apps": apps}} if apps else None,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), xmix.results(o)) for o in outs]


# ============================================================================ collection
def test_collect_activations_are_the_models_hidden_states(env):
    llm = env["llm"]
    prompts = lines("refusal_pos")[:3] + ["<think> a\n\nb\n\nc"]
    hs = hf_states(env, prompts)
    last = AC.collect_activations(llm, prompts, layers="all", position="last", progress=False)
    mean = AC.collect_activations(
        llm,
        prompts,
        sites=[("residual.pre", 1), ("final.post", None)],
        position="mean",
        progress=False,
    )
    every = AC.collect_activations(llm, prompts, layers=[2], position="all", progress=False)
    assert last.shape == (4, 4, 256) and mean.shape == (4, 2, 256)
    for i, h in enumerate(hs):
        for l in range(4):
            torch.testing.assert_close(last[i, l], h[l][0, -1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(
            mean[i, 0].double(), h[1][0].double().mean(0), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(
            mean[i, 1].double(), h[-1][0].double().mean(0), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(every[i][:, 0], h[2][0], rtol=1e-4, atol=1e-5)
    sep = AC.collect_activations(
        llm,
        prompts[-1:],
        layers=[2],
        progress=False,
        position=lambda ids: [k for k, t in enumerate(ids) if "\n\n" in env["tok"].decode([t])],
    )
    assert sep[0].shape[0] == 2
    ids = env["tok"].encode(prompts[-1])
    k = [j for j, t in enumerate(ids) if "\n\n" in env["tok"].decode([t])]
    torch.testing.assert_close(sep[0][:, 0], hs[-1][2][0, k], rtol=1e-4, atol=1e-5)
    assert not [a["name"] for a in llm.xmix.apps() if a["name"].startswith("xmix_derive")]


class SmallBufferLLM:
    """A stand-in engine with a capture buffer of ``budget`` floats per step (the real one
    holds 32 full-width captures on the tiny model; filling it through deploys is slow). It
    answers capture reads from the transformers model, so the assembled activations can be
    checked against hidden states; the code under test is collect_activations' planning."""

    def __init__(self, env, budget: int, max_tokens: int = 512):
        from xmix.lang.sites import ModelShape

        self.env, self.budget, self.max_tokens = env, budget, max_tokens
        self.shape = ModelShape.from_hf_config(env["hf"].config)
        self.deployed: dict[str, Any] = {}
        self.passes: list[list[tuple]] = []
        outer = self

        class Ctl:
            registry = type("R", (), {"shape": outer.shape})()

            def deploy(self, app):
                from xmix.lang.lowering import DeployError, lower

                lw = lower(app, outer.shape)
                used = sum(
                    o.capture_width * outer.max_tokens
                    for a in outer.deployed.values()
                    for o in a.ops
                )
                need = sum(o.capture_width * outer.max_tokens for o in lw.ops)
                if used + need > outer.budget:
                    raise DeployError(
                        f"deploying app {app.name!r} failed on a worker: app "
                        f"{app.name!r}: not enough room for capture buffer ({need} needed)"
                    )
                outer.deployed[app.name] = lw
                outer.passes.append([(o.site, o.layer, o.m, o.m + o.n) for o in lw.ops])

            def undeploy(self, name):
                del outer.deployed[name]

            def apps(self):
                return [{"name": n} for n in outer.deployed]

        self.xmix = Ctl()

    def get_tokenizer(self):
        return self.env["tok"]

    def generate(self, prompts, sp, use_tqdm=False):
        from types import SimpleNamespace

        (name,) = sp.extra_args["xmix"]["apps"]
        lw = self.deployed[name]
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            with torch.no_grad():
                hs = self.env["hf"](torch.tensor([ids]), output_hidden_states=True).hidden_states
            mlp = {}
            res = {}
            for o in lw.ops:
                if o.site == "mlp.post":
                    if o.layer not in mlp:
                        mlp[o.layer] = mlp_post_all(self.env, ids, o.layer)
                    x = mlp[o.layer]
                else:
                    assert o.site == "residual.pre"
                    x = hs[o.layer][0]
                last = isinstance(o.cond, C.Flag) and o.cond.name == "last_token"
                pos = [len(ids) - 1] if last else list(range(len(ids)))
                res[o.result_key] = {
                    "positions": pos,
                    "values": [x[q, o.m : o.m + o.n].tolist() for q in pos],
                }
            outs.append(SimpleNamespace(xmix={name: res}, outputs=[SimpleNamespace(token_ids=[0])]))
        return outs


def test_collect_splits_when_the_capture_buffer_is_short(hfm):
    """Sites that do not fit the capture buffer together are read in several passes, and a
    site that does not fit alone is read in dims slices; the result is the same tensor."""
    env = hfm
    prompts = lines("cast_pos")[:3]
    sites = [("residual.pre", 3), ("mlp.post", 1), ("residual.pre", 0)]
    hs = hf_states(env, prompts)
    want_last = torch.stack(
        [
            torch.stack([h[3][0, -1], mlp_post(env, [p], 1)[0], h[0][0, -1]])
            for p, h in zip(prompts, hs)
        ]
    )
    for budget, n_passes in ((3 * 256 * 512, 1), (2 * 256 * 512, 2), (256 * 512 // 2, 6)):
        fake = SmallBufferLLM(env, budget)
        got = AC.collect_activations(fake, prompts, sites=sites, position="last", progress=False)
        assert len(fake.passes) == n_passes and not fake.deployed
        covered = sorted((s, l, lo, hi) for group in fake.passes for s, l, lo, hi in group)
        assert sum(hi - lo for *_, lo, hi in covered) == 3 * 256
        torch.testing.assert_close(got, want_last, rtol=1e-5, atol=1e-6)
    fake = SmallBufferLLM(env, 256 * 512 // 2)
    got = AC.collect_activations(fake, prompts, sites=sites[:1], position="mean", progress=False)
    torch.testing.assert_close(
        got[:, 0].double(),
        torch.stack([h[3][0].double().mean(0) for h in hs]),
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(AC.DeriveError, match="capture buffer"):
        AC.collect_activations(SmallBufferLLM(env, 256), prompts, sites=sites[:1], progress=False)


# ============================================================================ #1 refusal
def test_derive_refusal_ablation_removes_the_direction(env, tmp_path):
    llm = env["llm"]
    out = tmp_path / "refusal.xmix"
    rc = DC.main(
        [
            "refusal",
            "--model",
            KIND,
            "--positive",
            str(PROMPTS / "refusal_pos.txt"),
            "--negative",
            str(PROMPTS / "refusal_neg.txt"),
            "--out",
            str(out),
            "--quiet",
        ],
        llm=llm,
    )
    assert rc == 0
    app = xmix.App.load(out)
    meta = app.metadata
    assert meta["xmix_app"] == "refusal" and meta["model"] == KIND and meta["hidden_size"] == 256
    assert meta["n_layers"] == 4 and meta["direction_layer"] == 2 and meta["position"] == "last"
    assert meta["counts"] == {"positive": 24, "negative": 24}
    assert meta["prompt_files"]["positive"].endswith("refusal_pos.txt")
    assert "difference of means" in meta["method"]
    r = app.ops[0].artifacts["direction"].double()
    # Arditi et al.: mean over harmful minus mean over harmless, residual.pre, last token
    hp = torch.stack([h[2][0, -1] for h in hf_states(env, lines("refusal_pos"))]).double()
    hn = torch.stack([h[2][0, -1] for h in hf_states(env, lines("refusal_neg"))]).double()
    torch.testing.assert_close(r, hp.mean(0) - hn.mean(0), rtol=1e-4, atol=1e-5)

    watch = xmix.App("watch")
    watch.read("capture").layers("all").at("residual.post").named("x")
    watch.read("capture").layers("all").at("attention.post").named("a")
    llm.xmix.deploy(app)
    llm.xmix.deploy(watch)
    try:
        ids = [env["tok"].encode(p) for p in lines("refusal_pos")[:4] + lines("refusal_neg")[:4]]
        ablated = generate(llm, ids, ["refusal", "watch"], 8)
        plain = generate(llm, ids, ["watch"], 8)
    finally:
        llm.xmix.undeploy("watch")
        llm.xmix.undeploy(app.name)
    u = (r / r.norm()).numpy()
    changed = 0
    for (ta, ra), (tp, rp) in zip(ablated, plain):
        for l in range(4):
            for key in (f"x.{l}", f"a.{l}"):
                xa = np.asarray(ra["watch"][key]["values"])
                xp = np.asarray(rp["watch"][key]["values"])
                assert np.abs(xa @ u).max() < 1e-4 * np.linalg.norm(xa, axis=1).max(), key
                assert np.abs(xp @ u).max() > 0.05, key
        changed += ta != tp
    assert changed >= 1


# ============================================================================ #3 CAST
def test_derive_cast_condition_and_behaviour(env, tmp_path):
    llm = env["llm"]
    out = tmp_path / "cast.xmix"
    rc = DC.main(
        [
            "cast",
            "--model",
            KIND,
            "--positive",
            str(PROMPTS / "cast_pos.txt"),
            "--negative",
            str(PROMPTS / "cast_neg.txt"),
            "--behavior-positive",
            str(PROMPTS / "refusal_pos.txt"),
            "--behavior-negative",
            str(PROMPTS / "refusal_neg.txt"),
            "--condition-layer",
            "0",
            "1",
            "--behavior-layers",
            "2",
            "3",
            "--alpha",
            "8",
            "--out",
            str(out),
            "--quiet",
        ],
        llm=llm,
    )
    assert rc == 0
    app = xmix.App.load(out)
    meta = app.metadata
    cl = meta["layers"]["condition"]
    assert cl in (0, 1) and meta["layers"]["behavior"] == [2, 3]
    assert [c["layer"] for c in meta["condition_search"]] == [0, 1]
    assert meta["f1"] == max(c["f1"] for c in meta["condition_search"])
    assert meta["counts"] == {
        "positive": 24,
        "negative": 24,
        "behavior_positive": 24,
        "behavior_negative": 24,
    }
    theta, cmp = meta["params"]["theta"], meta["params"]["comparator"]
    v = app.ops[0].artifacts["vector"]

    pos, neg = lines("cast_pos"), lines("cast_neg")
    # CAST: the condition vector is the first PC of the pair-centred prompt means
    means = [
        torch.stack([h[cl][0].double().mean(0) for h in hf_states(env, s)]) for s in (pos, neg)
    ]
    c = (means[0] + means[1]) / 2
    train = torch.cat([means[0] - c, means[1] - c])
    pc = torch.linalg.svd(train - train.mean(0), full_matrices=False).Vh[0]
    assert abs(float(pc @ v.double())) == pytest.approx(1.0, abs=1e-4)
    assert (
        int(((means[0] - means[1]) @ v.double() > 0).sum()) >= 12
    )  # CAST's sign: positives higher

    watch_pre, watch_post = xmix.App("wpre"), xmix.App("wpost")
    watch_pre.read("capture").layers([2]).at("residual.pre").named("x").cond("last_token")
    watch_post.read("capture").layers([2]).at("residual.pre").named("x").cond("last_token")
    for a in (watch_pre, app, watch_post):
        llm.xmix.deploy(a)
    try:
        ids = [env["tok"].encode(p) for p in pos + neg]
        got = generate(llm, ids, ["wpre", app.name, "wpost"])
    finally:
        for a in (watch_pre, app, watch_post):
            llm.xmix.undeploy(a.name)
    fires = []
    for k, (_, res) in enumerate(got):
        score = cast_score(means[k >= len(pos)][k % len(pos)], v)
        assert res["cast"]["cast_sim"]["values"][0] == pytest.approx(score, rel=1e-4, abs=1e-5)
        steered = res["wpre"]["x"]["values"][0] != res["wpost"]["x"]["values"][0]
        assert steered == CMP[cmp](score, theta)
        fires.append(steered)
    on_pos, on_neg = sum(fires[: len(pos)]), sum(fires[len(pos) :])
    f1 = 2 * on_pos / (2 * on_pos + on_neg + (len(pos) - on_pos))
    assert f1 == pytest.approx(meta["f1"])
    # On the training prompts CAST fires on more condition prompts than others; the random-
    # weight model keeps the two sets barely apart (see docs/apps.md), so not on all.
    assert on_pos > on_neg


# ============================================================================ #4 truth probe
def test_derive_truth_probe_subprocess(env, tmp_path):
    """The real command line, in its own process and engine; then the probe on this engine."""
    pos, neg = lines("truth_pos"), lines("truth_neg")
    (tmp_path / "pos.txt").write_text("\n".join(pos[:16]) + "\n", encoding="utf-8")
    (tmp_path / "neg.txt").write_text("\n".join(neg[:16]) + "\n", encoding="utf-8")
    out = tmp_path / "truth.xmix"
    cmd = [
        sys.executable,
        "-m",
        "xmix.cli",
        "derive",
        "truth_probe",
        "--model",
        KIND,
        "--positive",
        str(tmp_path / "pos.txt"),
        "--negative",
        str(tmp_path / "neg.txt"),
        "--layer",
        "2",
        "--tokens",
        "last_token",
        "--max-model-len",
        "512",
        # eager: the command line is what is tested, and a cold compile in a process of its
        # own costs ~70 s here
        "--enforce-eager",
        "--out",
        str(out),
    ]
    envv = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=envv, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    assert "truth_probe: true" in proc.stderr  # the progress bar
    app = xmix.App.load(out)
    meta = app.metadata
    assert meta["xmix_app"] == "truth_probe" and meta["model"] == KIND
    assert meta["hidden_size"] == 256 and meta["n_layers"] == 4 and meta["layers"] == [2]
    assert meta["counts"] == {"positive": 16, "negative": 16}
    assert meta["prompt_files"] == {
        "positive": str(tmp_path / "pos.txt"),
        "negative": str(tmp_path / "neg.txt"),
    }
    assert "logistic regression" in meta["method"] and meta["site"] == "mlp.post"
    w = app.ops[0].artifacts["weight"].double()
    b = app.ops[0].params["bias"]

    llm = env["llm"]
    llm.xmix.deploy(app)
    try:
        ids = [env["tok"].encode(p) for p in pos + neg]
        got = generate(llm, ids, [app.name])
    finally:
        llm.xmix.undeploy(app.name)
    scores = np.array([res[app.name]["truth"]["values"][0] for _, res in got])
    for (_, res), x in zip(got, ids):
        assert res[app.name]["truth"]["positions"] == [len(x) - 1]
    # the served probe is σ(w·a + b) on the model's own mlp.post, held-out lines included
    acts = mlp_post(env, pos + neg, 2).double()
    np.testing.assert_allclose(scores, torch.sigmoid(acts @ w + b).numpy(), rtol=1e-4, atol=1e-5)
    sp, sn = scores[:24], scores[24:]
    # Orgad et al.'s probe separates what it was trained on: every true training line scores
    # above every false one, as its recorded training accuracy says.
    assert sp[:16].min() > sn[:16].max()
    assert meta["train_accuracy"] == 1.0
    assert sp[:16].mean() > 0.5 > sn[:16].mean()


# ============================================================================ #2, #5, #6
def test_derive_seal_kts_sake(env, tmp_path):
    """The other derivations on the same engine: artifacts equal the papers' formulas applied
    to the transformers model's activations, and the served apps gate as derived."""
    llm, tok = env["llm"], env["tok"]
    # SEAL: thoughts after each "\n\n": execution, reflection, transition, execution
    trace = (
        "<think> Add the two numbers first.\n\nThe sum is seven.\n\nWait, check the second "
        "number.\n\nAlternatively, count them one by one.\n\nSo the answer is seven.</think>"
    )
    (tmp_path / "traces.jsonl").write_text(f'{{"text": {__import__("json").dumps(trace)}}}\n')
    rc = DC.main(
        [
            "seal",
            "--model",
            KIND,
            "--traces",
            str(tmp_path / "traces.jsonl"),
            "--layer",
            "2",
            "--out",
            str(tmp_path / "seal.xmix"),
            "--quiet",
        ],
        llm=llm,
    )
    assert rc == 0
    seal_app = xmix.App.load(tmp_path / "seal.xmix")
    assert seal_app.metadata["counts"] == {
        "execution": 2,
        "reflection": 1,
        "transition": 1,
        "traces": 1,
    }
    h = hf_states(env, [trace])[0][2][0]
    ids = tok.encode(trace)
    sep = [k for k, t in enumerate(ids) if "\n\n" in tok.decode([t])]
    S = h[[sep[0], sep[3]]].double().mean(0) - h[[sep[1], sep[2]]].double().mean(0)
    torch.testing.assert_close(
        seal_app.ops[0].artifacts["vector"].double(), S, rtol=1e-4, atol=1e-5
    )

    # KTS: normalised mean difference at residual.post (last token) per steered layer, and a
    # logistic gate on the prompt mean at the probe layer
    rc = DC.main(
        [
            "kl_then_steer",
            "--model",
            KIND,
            "--positive",
            str(PROMPTS / "refusal_pos.txt"),
            "--negative",
            str(PROMPTS / "refusal_neg.txt"),
            "--layer",
            "2",
            "3",
            "--out",
            str(tmp_path / "kts.xmix"),
            "--quiet",
        ],
        llm=llm,
    )
    assert rc == 0
    kts = xmix.App.load(tmp_path / "kts.xmix")
    assert kts.metadata["layers"] == {"probe": 1, "steer": [2, 3]}
    pos, neg = lines("refusal_pos"), lines("refusal_neg")
    hp, hn = hf_states(env, pos), hf_states(env, neg)
    steer = kts.ops[1].artifacts["vector"].double()  # s_l·û_l, one row per steered layer
    # residual.post of layer 2 is HF's hidden_states[3] (layer 3's is after the final norm there)
    last3 = [torch.stack([x[3][0, -1] for x in hs]).double() for hs in (hp, hn)]
    torch.testing.assert_close(steer[0], last3[0].mean(0) - last3[1].mean(0), rtol=1e-4, atol=1e-5)
    w, b = kts.ops[0].artifacts["weight"].double(), kts.ops[0].params["bias"]
    llm.xmix.deploy(kts)
    try:
        got = generate(llm, [tok.encode(p) for p in pos + neg], [kts.name])
    finally:
        llm.xmix.undeploy(kts.name)
    for hs, (_, res) in zip(hp + hn, got):
        probe = torch.sigmoid(hs[2][0].double() @ w + b)  # residual.post of layer 1
        np.testing.assert_allclose(
            res[kts.name]["kts_probe"]["values"], probe.numpy(), rtol=1e-4, atol=1e-5
        )
    gate = [float(np.mean(res[kts.name]["kts_probe"]["values"])) >= 0.5 for _, res in got]
    assert sum(gate[:24]) > sum(gate[24:])  # the gate was fit to flag the positive prompts

    # SAKE: Gaussian OT between final-norm outputs at the last token of source and target
    # prompts; t by Youden's J against unrelated prompts
    rc = DC.main(
        [
            "sake",
            "--model",
            KIND,
            "--positive",
            str(PROMPTS / "truth_pos.txt"),
            "--negative",
            str(PROMPTS / "truth_neg.txt"),
            "--unrelated",
            str(PROMPTS / "cast_neg.txt"),
            "--shrinkage",
            "0.5",
            "--out",
            str(tmp_path / "sake.xmix"),
            "--quiet",
        ],
        llm=llm,
    )
    assert rc == 0
    sk = xmix.App.load(tmp_path / "sake.xmix")
    xs = torch.stack([x[-1][0, -1] for x in hf_states(env, lines("truth_pos"))]).double()
    xt = torch.stack([x[-1][0, -1] for x in hf_states(env, lines("truth_neg"))]).double()
    xu = torch.stack([x[-1][0, -1] for x in hf_states(env, lines("cast_neg"))]).double()
    mu_s = sk.ops[1].artifacts["mu_s"].double()
    torch.testing.assert_close(mu_s, xs.mean(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        sk.ops[1].artifacts["mu_t"].double(), xt.mean(0), rtol=1e-4, atol=1e-5
    )
    A = sk.ops[1].artifacts["matrix"].double()

    def cov(x):  # biased, shrunk halfway to the scaled identity, + reg·I (as derived)
        z = x - x.mean(0)
        c = z.T @ z / x.shape[0]
        eye = torch.eye(c.shape[0], dtype=F64)
        return 0.5 * c + 0.5 * torch.trace(c) / c.shape[0] * eye + 1e-2 * eye

    # the Monge map between the Gaussians: A symmetric with A Σs A = Σt
    torch.testing.assert_close(A, A.T)
    torch.testing.assert_close(A @ cov(xs) @ A, cov(xt), rtol=2e-3, atol=2e-4)
    t = sk.app_params["t"]
    din, dout = (xs - mu_s).norm(dim=1), (xu - mu_s).norm(dim=1)
    assert float((din <= t + 1e-4).double().mean() - (dout <= t + 1e-4).double().mean()) > 0
    assert any(abs(float(x) - t) < 1e-3 for x in din)  # t is one of the in-scope distances


# ============================================================================ a monitor
def test_derive_harm_monitor_stops_and_switches_as_the_oracle(env, tmp_path):
    """``xmix derive harm_monitor``: a probe (logistic regression on residual.pre at the last
    prompt token, harmful = 1) and the refusal direction, served as a monitor that steers from
    the first flagged token on and stops what it is sure about. Its artifacts are the math of
    the transformers model's own hidden states; served, every request matches the oracle
    (tokens, stop, switches, reads), and with both thresholds out of reach it is vanilla."""
    from test_engine import assert_monitors_match
    from vllm import SamplingParams

    from xmix.apps import derive as D
    from xmix.integrations.hf import attach

    llm = env["llm"]
    out = tmp_path / "harm_monitor.xmix"
    argv = ["harm_monitor", "--model", KIND, "--positive", str(PROMPTS / "refusal_pos.txt")]
    argv += ["--negative", str(PROMPTS / "refusal_neg.txt"), "--out", str(out), "--quiet"]
    assert DC.main(argv + ["--stop-threshold", "0.9"], llm=llm) == 0
    app = xmix.App.load(out)
    meta = app.metadata
    assert meta["xmix_app"] == "harm_monitor" and meta["probe_layer"] == 2
    assert meta["counts"] == {"positive": 24, "negative": 24}
    hp = torch.stack([h[2][0, -1] for h in hf_states(env, lines("refusal_pos"))]).double()
    hn = torch.stack([h[2][0, -1] for h in hf_states(env, lines("refusal_neg"))]).double()
    w0, b0 = D.probe_from_sets(hp, hn)
    probe, add = app.ops[0], app.ops[1]
    torch.testing.assert_close(probe.artifacts["weight"], w0, rtol=1e-3, atol=1e-4)
    assert probe.params["bias"] == pytest.approx(b0, rel=1e-3, abs=1e-4)
    torch.testing.assert_close(
        add.artifacts["vector"].double(), hp.mean(0) - hn.mean(0), rtol=1e-4, atol=1e-5
    )
    assert app.ops[2].kernel == "stop" and app.app_params == {"theta": 0.5, "stop_at": 0.9}

    ids = [env["tok"].encode(p) for p in lines("refusal_pos")[:4] + lines("refusal_neg")[:4]]
    off = {"harm_monitor": {"theta": 2.0, "stop_at": 2.0}}
    llm.xmix.deploy(app)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in ids * 2],
            [
                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args=x)
                for x in [{"xmix": {"apps": ["harm_monitor"]}}] * len(ids)
                + [{"xmix": {"apps": ["harm_monitor"], "params": off}}] * len(ids)
            ],
            use_tqdm=False,
        )
        plain = generate(llm, ids, [], 8)
    finally:
        llm.xmix.undeploy(app.name)
    acted = []
    with attach(env["hf"], [app], tokenizer=env["tok"]) as oracle:
        for i, (p, o) in enumerate(zip(ids, outs[: len(ids)])):
            o_toks, o_res = oracle.generate(p, 8, apps=["harm_monitor"])
            assert_monitors_match(o.outputs[0], o_toks, o_res, f"prompt {i}")
            acted.append(bool(xmix.monitors(o)))
    for (toks, _), o in zip(plain, outs[len(ids) :]):
        assert list(o.outputs[0].token_ids) == toks and xmix.monitors(o) == {}
    assert any(acted[:4]), "the probe should act on some harmful prompt"
