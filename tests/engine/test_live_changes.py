"""Live changes never crash the engine and never change an answer they should not
(issue 11): control changes are transactions, requests are admitted against pinned app
versions, worker-side failures are contained to their request, the prefix-cache salt
describes everything that shaped the KV, hostile app files and controls are refused with
clear errors and bounded memory.

The first half runs the control block, lowering and the app format alone; the second half
one offline CPU engine (tiny Llama, 4 running requests at a time so requests queue)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import xmix
from harness import SMALL
from xmix.lang import conditions as C
from xmix.lang.api import AppError, LimitError
from xmix.lang.lowering import DeployError, lower
from xmix.lang.program_codec import program_of
from xmix.lang.sites import ModelShape
from xmix.models.tiny import tiny_model_path
from xmix.runtime.control import ControlBlock, RequestError

SHAPE = ModelShape(n_layers=4, hidden_size=64, vocab_size=300)
D = SHAPE.hidden_size


def _vec(seed: int, d: int = D) -> torch.Tensor:
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


def _live_state(cb: ControlBlock) -> dict[str, np.ndarray]:
    snap = {k: v.copy() for k, v in cb.host.items()}
    snap["__block"] = cb.mem.block_host.numpy().copy()
    snap["__site_app_mask"] = cb.mem.site_app_mask.copy()
    return snap


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    changed = [k for k in a if not np.array_equal(a[k], b[k], equal_nan=True)]
    assert not changed, f"live control-block state changed: {changed}"


def _overflow_cond_app(
    name: str, shape: ModelShape = SHAPE, terms: int = 40, writes: int = 2
) -> xmix.App:
    """Fits every per-app limit but not a control block's condition code: a read and writes
    gated by long conditions, all at the first site, so that before the fix every later
    site's tables and masks were left half rewritten."""
    app = xmix.App(name)
    app.read("probe", weight=_vec(1, shape.hidden_size)).layers([0]).at("residual.pre").named("g")
    cond = " or ".join(["g >= 0.5"] * terms)
    for i in range(writes):
        app.write("add", vector=_vec(2 + i, shape.hidden_size)).layers([0]).at("residual.pre").cond(
            cond
        )
    return app


def _steer_probe(cb: ControlBlock) -> None:
    steer = xmix.App("steer")
    steer.write("add", vector=_vec(3), scale=4.0).layers([1]).at("residual.post").named("push")
    gated = xmix.App("gated")
    gated.token_set("t", ids=[5, 6, 7])
    gated.read("probe", weight=_vec(4)).layers([0]).at("residual.post").named("p")
    gated.write("add", vector=_vec(5)).layers([2]).at("residual.pre").cond(
        when="token_in(t)", gate="p >= 0.5"
    )
    cb.install(lower(steer, SHAPE), version=1)
    cb.install(lower(gated, SHAPE), version=2)


# ------------------------------------------------------------------ the control block alone
def test_refused_install_leaves_the_live_control_block_untouched():
    """Defect 2 (a deploy the worker refuses corrupts running requests): before the fix the
    site tables were half rewritten and the site masks zeroed when the condition code or the
    op table overflowed. Now every refusal leaves every live buffer bit for bit as it was,
    and the op-list generation moves exactly when a new op list goes live."""
    cb = ControlBlock(SHAPE, "cpu", SMALL)
    _steer_probe(cb)
    cb.admit("running", ["steer", "gated"], {"steer": {"scale": 2.0}}, 10)
    gen = cb.mem.ops_generation
    before = _live_state(cb)
    too_many_ops = xmix.App("wide")
    for i in range(20):
        too_many_ops.write("ablate", direction=_vec(10 + i)).layers("all").at("residual.pre")
    for bad in (_overflow_cond_app("cond"), too_many_ops):
        with pytest.raises(DeployError, match="max_cond|max_ops"):
            cb.install(lower(bad, SHAPE), version=9)
        _assert_same(before, _live_state(cb))
        assert cb.mem.ops_generation == gen and sorted(cb.apps) == ["gated", "steer"]
    # refused mode / params / unknown app: nothing applied
    with pytest.raises(DeployError):
        cb.patch("steer", mode="bogus", params={"scale": 3.0})
    with pytest.raises(RequestError):
        cb.patch("steer", mode="off", params={"nope": 3.0})
    _assert_same(before, _live_state(cb))
    # the allocations of the refused deploys went back: the same app fits once room is made
    cb.patch("steer", params={"scale": 3.0})
    cb.patch("steer", mode="all")
    assert cb.mem.ops_generation == gen  # modes and parameters are not a new op list
    small = xmix.App("small")
    small.write("add", vector=_vec(40)).layers([3]).at("mlp.post")
    cb.install(lower(small, SHAPE), version=10)
    assert cb.mem.ops_generation == gen + 1
    cb.remove("small")
    assert cb.mem.ops_generation == gen + 2


def test_staged_refusal_queues_no_device_work_and_a_commit_lands_between_steps():
    """On a staged control block (a GPU's, here the fake stream of tests/fake_device.py): a
    refused deploy queues nothing and leaves every device buffer as it was; a committed one
    reaches the device before the next step (the change waits for its copies) and never
    rewrites what a step already queued."""
    from fake_device import FakeDevice

    dev = FakeDevice()
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=dev)
    _steer_probe(cb)
    cb.admit("running", ["steer", "gated"], {"steer": {"scale": 2.0}}, 10)
    dev.run()
    device_before = {k: t.numpy().tobytes() for k, t in cb.dev.items()}
    block_before = cb.block.numpy().tobytes()
    queued, waits = len(dev.queue), dev.host_waits
    with pytest.raises(DeployError, match="max_cond"):
        cb.install(lower(_overflow_cond_app("cond"), SHAPE), version=9)
    assert len(dev.queue) == queued and dev.host_waits == waits
    assert [k for k, t in cb.dev.items() if t.numpy().tobytes() != device_before[k]] == []
    assert cb.block.numpy().tobytes() == block_before
    small = xmix.App("small")
    small.write("add", vector=_vec(40)).layers([3]).at("mlp.post")
    cb.install(lower(small, SHAPE), version=10)
    assert not dev.queue  # the change's copies ran before install returned
    assert torch.equal(cb.dev["ops"], torch.from_numpy(cb.host["ops"]))
    assert torch.equal(cb.dev["site_count"], torch.from_numpy(cb.host["site_count"]))


def test_prepared_deploy_is_not_live_until_committed():
    cb = ControlBlock(SHAPE, "cpu", SMALL)
    _steer_probe(cb)
    before = _live_state(cb)
    extra = xmix.App("extra")
    extra.read("probe", weight=_vec(50)).layers([1]).at("residual.mid").named("e")
    cb.deploy.prepare_install(lower(extra, SHAPE), "all", 3)
    _assert_same(before, _live_state(cb))
    assert "extra" not in cb.apps
    assert cb.deploy.abort_install("extra")
    _assert_same(before, _live_state(cb))
    cb.deploy.prepare_install(lower(extra, SHAPE), "all", 3)
    inst = cb.deploy.commit_install("extra")
    assert inst.version == 3 and cb.deploy.describe()[-1]["mode"] == "all"
    # a prepared deploy made stale by another change is refused at commit
    other = xmix.App("other")
    other.write("add", vector=_vec(51)).layers([0]).at("residual.pre")
    cb.deploy.prepare_install(lower(other, SHAPE), "request", 4)
    cb.remove("extra")
    with pytest.raises(DeployError, match="changed since it was prepared"):
        cb.deploy.commit_install("other")
    assert "other" not in cb.apps


def test_pinned_admission_leaves_out_gone_or_redeployed_apps():
    """Defect 1 at the control block: a request checked against app r1 version 1 reaches
    a worker where r1 was redeployed (version 2, no 'scale'): it is admitted without r1,
    nothing raises; with r1 still at version 1 its pinned column values are used."""
    cb = ControlBlock(SHAPE, "cpu", SMALL)
    r1 = xmix.App("r1")
    r1.write("add", vector=_vec(60), scale=1.0).layers([1]).at("residual.post")
    cb.install(lower(r1, SHAPE), version=1)
    slot, dropped = cb.slots.admit_pinned("a", ["r1"], {"r1": [1, [[0, 2.0]]]}, 5)
    assert dropped == []
    assert cb.host["slot_params"][slot * SMALL.max_params + cb.apps["r1"].param_base] == 2.0
    cb.remove("r1")
    r1b = xmix.App("r1")
    r1b.write("ablate", direction=_vec(61)).layers([1]).at("residual.post")
    cb.install(lower(r1b, SHAPE), version=2)
    slot, dropped = cb.slots.admit_pinned("b", ["r1"], {"r1": [1, [[0, 2.0]]]}, 5)
    assert dropped == ["r1"] and int(cb.host["slot_apps"][slot]) == 0
    # a pin for a mode-"all" app that is gone: left out too
    slot, dropped = cb.slots.admit_pinned("c", [], {"gone": [7, [[0, 1.0]]]}, 5)
    assert dropped == ["gone"]


def test_undeploy_forgets_the_overrides_of_running_requests():
    """A running request's parameter overrides are columns of one deployment: after an
    undeploy and a redeploy under the same name in mode "all", its row holds the new app's
    defaults, not its old override values."""
    cb = ControlBlock(SHAPE, "cpu", SMALL)
    a = xmix.App("a")
    a.write("add", vector=_vec(70), scale=1.0).layers([1]).at("residual.post")
    cb.install(lower(a, SHAPE), version=1)
    slot = cb.admit("r", ["a"], {"a": {"scale": 5.0}}, 3)
    cb.remove("a")
    b = xmix.App("a")
    b.write("add", vector=_vec(71), scale=0.25).layers([1]).at("residual.post")
    inst = cb.install(lower(b, SHAPE), "all", version=2)
    assert cb.host["slot_params"][slot * SMALL.max_params + inst.param_base] == 0.25


# ------------------------------------------------------------------ hostile app files
def test_strict_json_metadata_and_parameters():
    """Defect 4 (a deployed app that breaks every listing): NaN/Inf in metadata, parameter
    defaults outside fp32, and ints beyond any float are refused when the app is built."""
    for meta in ({"x": float("nan")}, {"x": [1.0, float("inf")]}, {"k": {1: 2}}):
        with pytest.raises(AppError, match="metadata"):
            xmix.App("m", metadata=meta)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(AppError, match="nested"):
        xmix.App("m", metadata={"d": deep})
    for v in (float("inf"), -1e39, 10**400):
        with pytest.raises(AppError, match="fp32 range|too large"):
            xmix.App("p").param("theta", v)
    spec = xmix.App("ok").spec()
    spec["metadata"] = {"x": float("nan")}
    from safetensors.torch import save

    data = save({}, metadata={"xmix.spec": json.dumps(spec)})  # Python writes NaN
    with pytest.raises(AppError, match="metadata"):
        xmix.App.from_bytes(data)


def test_hostile_conditions_and_gate_chains_are_refused_without_recursion():
    app = xmix.App("c")
    app.read("probe", weight=_vec(80)).layers([0]).at("residual.pre").named("g")
    op = app.write("add", vector=_vec(81)).layers([1]).at("residual.pre")
    with pytest.raises(AppError, match="more than 256 terms"):
        op.cond(" or ".join(["g>0"] * 2000))
    with pytest.raises(AppError, match="nested more than"):
        op.cond("(" * 40 + "g >= 0" + ")" * 40)
    with pytest.raises(AppError, match="characters"):
        op.cond("(" * 100_000 + "g >= 0" + ")" * 100_000)
    op.cond(" and ".join(["g >= 0"] * 256))
    node = op.condition()
    assert C.n_instructions(node) == 511 and C.stack_depth(node) == 2
    # a gate chain 1 100 reads deep lowers (iteratively) and is refused by the control
    # block for its reads, with a message, not a RecursionError
    chain = xmix.App("chain")
    chain.read("probe", weight=_vec(82)).layers([0]).at("residual.pre").named("r0")
    for i in range(1, 1100):
        chain.read("probe", weight=_vec(82)).layers([0]).at("residual.pre").named(f"r{i}").cond(
            gate=f"r{i - 1} >= 0"
        )
    lw = lower(chain, SHAPE)
    assert len(lw.ops) == 1100
    with pytest.raises(DeployError, match="not enough room|max_ops"):
        ControlBlock(SHAPE, "cpu", SMALL).install(lw)


def test_shared_artifacts_are_stored_once_and_bytes_are_bounded(monkeypatch):
    """A 1 000-op app whose ops all name one tensor of the file: one copy in the app, in
    its saved bytes, in lowering and in the control block (before the fix: one copy per op
    in each of three processes). Op count and fp32 artifact bytes are checked before any
    copy (XMIX_MAX_APP_OPS, XMIX_MAX_ARTIFACT_BYTES)."""
    from safetensors.torch import save

    m = torch.eye(D) * 0.5
    spec = {
        "format": "xmix.app/1",
        "name": "many",
        "metadata": {},
        "params": {},
        "token_sets": [],
        "ops": [
            {
                "primitive": "write",
                "kernel": "affine",
                "site": "residual.post",
                "layers": [i % 4],
                "params": {},
                "artifacts": {"matrix": "m", "mu_s": "z", "mu_t": "z"},
            }
            for i in range(1000)
        ],
    }
    data = save({"m": m, "z": torch.zeros(D)}, metadata={"xmix.spec": json.dumps(spec)})
    app = xmix.App.from_bytes(data)
    assert len(app.tensors()) == 2 and app.artifact_bytes() == 4 * (D * D + D)
    assert len(app.to_bytes()) < len(data) + 200_000  # the re-saved file stays one copy
    lw = lower(app, SHAPE)
    assert len({o.artifacts["a0"].data_ptr() for o in lw.ops}) == 1
    cb = ControlBlock(SHAPE, "cpu", SMALL.__class__(**{**SMALL.__dict__, "max_ops": 2048}))
    inst = cb.install(lw)
    assert len(inst.artifacts) == 2
    monkeypatch.setenv("XMIX_MAX_ARTIFACT_BYTES", str(4 * D * D))
    with pytest.raises(LimitError, match="XMIX_MAX_ARTIFACT_BYTES"):
        xmix.App.from_bytes(data)
    monkeypatch.setenv("XMIX_MAX_APP_OPS", "999")
    with pytest.raises(LimitError, match="1000 ops"):
        xmix.App.from_bytes(data)


def test_writes_are_bounded_to_1e30_per_element():
    """A write may not drive the stream past 1e30 (Inf/NaN in the KV cache would reach later
    requests given the same blocks): the bound is |param| x the largest element it scales,
    checked for app defaults at deploy and for every request's parameters."""
    from xmix.lang.lowering import WRITE_BOUND
    from xmix.lang.sae import SAE
    from xmix.runtime.control import param_columns, resolve_params

    v = torch.zeros(D)
    v[3] = 4.0
    add = xmix.App("add")
    add.write("add", vector=v, scale=1.0).layers([1]).at("residual.post")
    cols = param_columns(lower(add, SHAPE))
    assert resolve_params(cols, {"scale": WRITE_BOUND / 4}, "a") == {0: WRITE_BOUND / 4}
    for bad in (WRITE_BOUND / 4 * 1.01, -3e38):
        with pytest.raises(RequestError, match="out of range"):
            resolve_params(cols, {"scale": bad}, "a")
    loud = xmix.App("loud")
    loud.write("add", vector=v, scale=1e30).layers([1]).at("residual.post")
    with pytest.raises(DeployError, match="beyond 1e"):
        lower(loud, SHAPE)
    clamp = xmix.App("clamp")
    clamp.write("clamp", direction=_vec(5), min=-1.0).layers([1]).at("residual.post")
    cols = param_columns(lower(clamp, SHAPE))
    resolve_params(cols, {"max": 3e38}, "c")  # an upper bound far away moves nothing
    with pytest.raises(RequestError, match="out of range"):
        resolve_params(cols, {"min": 3e38}, "c")  # ... a lower one pulls the stream to it
    g = torch.Generator().manual_seed(0)
    W_dec = torch.zeros(8, D)
    W_dec[2, 0], W_dec[5, 0] = 2.0, -3.0
    sae = SAE(torch.randn(D, 8, generator=g), torch.zeros(8), W_dec, torch.zeros(D))
    app = xmix.App("sae")
    app.write("sae_clamp", sae=sae, feature=[2, 5], value=1.0).layers([1]).at("residual.post")
    app.write("sae_steer", sae=sae, feature=[2, 5], scale=1.0).layers([2]).at("residual.post")
    cols = param_columns(lower(app, SHAPE))
    bounds = {c.name: c.hi for c in cols}
    assert bounds == {"value": WRITE_BOUND / 5.0, "scale": WRITE_BOUND / 1.0}


def test_request_controls_with_huge_numbers_are_refused():
    from xmix.runtime.control import param_columns, resolve_params

    app = xmix.App("s")
    app.write("add", vector=_vec(90), scale=1.0).layers([1]).at("residual.post")
    cols = param_columns(lower(app, SHAPE))
    for bad in (10**400, float("nan"), "x", [[[[]]]]):
        with pytest.raises(RequestError, match="finite number"):
            resolve_params(cols, {"scale": bad}, "app 's'")


# ------------------------------------------------------------------ one offline engine
MAX_SEQS = 4


@pytest.fixture(scope="module")
def env():
    from transformers import AutoTokenizer

    from engine_util import make_llm, shutdown

    path = str(tiny_model_path("tiny-llama"))
    llm = make_llm(path, max_num_seqs=MAX_SEQS, worker_extension_cls="xmix_faults.AdmissionFaults")
    tok = AutoTokenizer.from_pretrained(path)
    d = llm.llm_engine.model_config.hf_config.hidden_size
    shape = ModelShape.from_hf_config(llm.llm_engine.model_config.hf_config)
    g = torch.Generator().manual_seed(11)

    def unit():
        v = torch.randn(d, generator=g)
        return v / v.norm()

    steer = xmix.App("steer")
    steer.write("add", vector=unit() * 4.0, scale=1.0).layers([1]).at("residual.post")
    probe = xmix.App("probe")
    probe.read("probe", weight=unit() * 0.5, bias=0.0).layers([2]).at("residual.post").named("p2")
    llm.xmix.deploy(steer)
    llm.xmix.deploy(probe)
    yield dict(llm=llm, tok=tok, shape=shape, unit=unit, d=d)
    shutdown(llm)


def _ids(env, text: str) -> list[int]:
    return env["tok"].encode(text)


def _run(env, reqs: list[tuple[str, list[int], dict | None, int]], between=None) -> dict:
    """Step the engine over requests (id, prompt ids, control, max_tokens); ``between(step)``
    runs between steps. Returns {id: RequestOutput} of the finished requests."""
    from vllm import SamplingParams

    engine = env["llm"].llm_engine
    for rid, ids, ctl, n in reqs:
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=n,
            ignore_eos=True,
            extra_args={"xmix": ctl} if ctl is not None else None,
        )
        engine.add_request(rid, {"prompt_token_ids": ids}, sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        if between is not None:
            between(step)
        assert step < 2000
    return done


def _answer(out) -> tuple:
    reads = xmix.results(out).get("probe", {}).get("p2", {"positions": [], "values": []})
    return (tuple(out.outputs[0].token_ids), tuple(reads["positions"]), tuple(reads["values"]))


def _stats(llm) -> dict:
    return llm.xmix.status()[0]["stats"]


@pytest.mark.engine
def test_redeploy_under_a_queued_request_does_not_kill_the_engine(env):
    """Defect 1: a request naming r1 with {"scale": 2} waits in the queue; r1 is undeployed
    and redeployed with no 'scale'. Before the fix the worker's admission raised twice,
    the exception left execute_model and the engine core died. Now the request runs
    without r1 (its answer is that of the same prompt without apps) and it is counted."""
    from engine_util import PROMPTS

    llm = env["llm"]
    r1 = xmix.App("r1")
    r1.write("add", vector=env["unit"]() * 8.0, scale=1.0).layers([1]).at("residual.post")
    llm.xmix.deploy(r1)
    victim = _ids(env, PROMPTS[3])
    plain = _run(env, [("ref", victim, None, 16)])["ref"]
    stale_before = _stats(llm).get("stale_apps", 0)
    queue = [(f"long-{i}", _ids(env, PROMPTS[i % 8]), None, 40) for i in range(10)]
    queue.append(("victim", victim, {"apps": ["r1"], "params": {"r1": {"scale": 2.0}}}, 16))

    def redeploy(step):
        if step == 2:
            llm.xmix.undeploy("r1")
            r1b = xmix.App("r1")
            r1b.write("ablate", direction=env["unit"]()).layers([1]).at("residual.post")
            llm.xmix.deploy(r1b)

    done = _run(env, queue, redeploy)
    assert len(done) == 11
    assert done["victim"].outputs[0].token_ids == plain.outputs[0].token_ids
    assert _stats(llm)["stale_apps"] == stale_before + 1
    llm.xmix.undeploy("r1")


@pytest.mark.engine
def test_refused_deploys_under_load_change_no_token_and_no_read(env):
    """Defect 2: 16 greedy requests using probe and steer (4 running at a time, the rest
    queued) against 30 deploys refused for overflowing the condition code, sent straight to
    the workers (the frontend would refuse them first) with steps between each refusal and
    the next change: 0 tokens and 0 read values differ from the run without them. A
    frontend-refused deploy every other step changes nothing either."""
    from engine_util import PROMPTS

    llm = env["llm"]
    ctls = [{"apps": ["steer", "probe"]}, {"apps": ["probe"]}, None, {"apps": ["steer"]}]

    def reqs(run):
        # cache_salt keeps the runs apart: each computes its own prompts
        return [(f"{run}-{i}", _ids(env, PROMPTS[i]), ctls[i % 4], 24) for i in range(16)]

    control = _run(env, reqs("control"))
    bad = _overflow_cond_app("overflow", env["shape"], terms=200, writes=11)  # 11 x 399 > 4096
    data = program_of(bad, env["shape"])  # what a frontend would send: lowered once
    refused = []

    def refuse(step):
        if step <= 30:
            with pytest.raises(Exception, match="max_cond|condition"):
                llm.collective_rpc("xmix_deploy", args=(data, "request"))
            refused.append(step)
            if step % 2:
                with pytest.raises(DeployError, match="condition instructions"):
                    llm.xmix.deploy(bad)

    loaded = _run(env, reqs("loaded"), refuse)
    assert len(refused) == 30
    diff_tokens = sum(
        _answer(control[f"control-{i}"])[0] != _answer(loaded[f"loaded-{i}"])[0] for i in range(16)
    )
    diff_reads = sum(
        _answer(control[f"control-{i}"])[1:] != _answer(loaded[f"loaded-{i}"])[1:]
        for i in range(16)
    )
    assert (diff_tokens, diff_reads) == (0, 0)
    assert sum(len(_answer(o)[2]) for o in loaded.values()) > 0
    assert [a["name"] for a in llm.xmix.apps()] == ["steer", "probe"]


@pytest.mark.engine
def test_parameter_change_gives_new_requests_a_new_cache_salt(env):
    """Defect 3: after PATCH of steer's default scale 8 -> -8, the same 400-token request
    reuses no block cached under scale 8 (before the fix: 384 cached tokens and another
    text) and answers exactly as a request that sets -8 itself on a fresh cache."""
    from vllm import SamplingParams

    llm = env["llm"]
    g = torch.Generator().manual_seed(5)
    ids = [1] + torch.randint(20, 250, (399,), generator=g).tolist()
    llm.xmix.set_params("steer", {"scale": 8.0})

    def one(ctl, salt=None):
        prompt = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
        sp = SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, extra_args={"xmix": ctl}
        )
        return llm.generate([prompt], sp, use_tqdm=False)[0]

    try:
        a = one({"apps": ["steer"]})
        again = one({"apps": ["steer"]})
        assert again.num_cached_tokens >= 384  # same configuration: the cache works
        llm.xmix.set_params("steer", {"scale": -8.0})
        b = one({"apps": ["steer"]})
        fresh = one({"apps": ["steer"], "params": {"steer": {"scale": -8.0}}}, salt="fresh")
        assert b.num_cached_tokens == 0
        assert b.outputs[0].token_ids == fresh.outputs[0].token_ids
        assert a.outputs[0].token_ids != b.outputs[0].token_ids
    finally:
        llm.xmix.set_params("steer", {"scale": 1.0})


@pytest.mark.engine
def test_a_fault_in_worker_admission_fails_one_request_and_the_engine_serves_on(env):
    """Fault injection: the worker's admission raises for one request. That request ends
    with finish_reason "error" and a message; the others in the same steps finish with the
    answers of a run without the fault; the engine keeps serving."""
    from engine_util import PROMPTS

    llm = env["llm"]
    reqs = [
        (f"{{}}-{i}", _ids(env, PROMPTS[i]), {"apps": ["steer", "probe"]} if i % 2 else None, 12)
        for i in range(6)
    ]

    def named(prefix):
        return [(rid.format(prefix), ids, ctl, n) for rid, ids, ctl, n in reqs]

    errors_before = _stats(llm)["admit_errors"]
    reference = _run(env, named("ref"))
    llm.collective_rpc("xmix_test_fail_admission", args=("boom-3",))
    try:
        done = _run(env, named("boom"))
    finally:
        llm.collective_rpc("xmix_test_fail_admission", args=(None,))
    bad = done["boom-3"]
    assert bad.outputs[0].finish_reason == "error"
    assert "injected admission fault" in bad.xmix_error
    for i in (0, 1, 2, 4, 5):
        assert _answer(done[f"boom-{i}"]) == _answer(reference[f"ref-{i}"])
    assert _stats(llm)["admit_errors"] == errors_before + 1
    after = _run(env, [("boom-3", reqs[3][1], reqs[3][2], 12)])["boom-3"]
    assert _answer(after) == _answer(reference["ref-3"])


@pytest.mark.engine
def test_patch_is_one_change_offline(env):
    """Defect 4 offline: a PATCH with a valid parameter and a bad mode changes nothing, in
    the frontend and on the workers."""
    llm = env["llm"]
    before = {a["name"]: a["params"] for a in llm.xmix.apps()}
    with pytest.raises(DeployError, match="mode must be one of"):
        llm.xmix.patch("steer", mode="bogus", params={"scale": 3.0})
    with pytest.raises(RequestError, match="unknown parameter"):
        llm.xmix.patch("steer", mode="off", params={"nope": 3.0})
    assert {a["name"]: a["params"] for a in llm.xmix.apps()} == before
    worker = {a["name"]: (a["params"], a["mode"]) for a in llm.xmix.status()[0]["apps"]}
    assert worker["steer"] == (before["steer"], "request")
