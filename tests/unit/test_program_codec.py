"""The lowered program (python/xmix/lang/program_codec.py): what the frontend sends the workers and
the other API servers instead of the app, so an app is lowered once per deploy.

Oracle: ``lowering.lower`` itself, the path a worker took before (it lowered the app again):
a decoded program must give the control block the same tables (op records but for device
pointers, condition code, token-set bits, spans, parameter columns and defaults) as the
lowered app. Then every check the engine keeps, each with a forged program it must refuse
naming the field, and the one-parse-one-lowering count of a deploy across two API servers and
two engines (in one process: tests/server/test_scale_out.py counts it over HTTP).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_scale_out_units import Engine, app, server

import xmix
from harness import SMALL, program_from_parts, program_parts
from xmix.lang import deploy_work
from xmix.lang.api import App
from xmix.lang.lowering import lower
from xmix.lang.program_codec import (
    ProgramError,
    _safetensors,
    app_digest,
    decode,
    encode,
    program_of,
)
from xmix.lang.sae import SAE
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import ControlBlock
from xmix.runtime.control.arena import Claims
from xmix.runtime.control.layout import OP_DTYPE
from xmix.runtime.control.link import build_tables, link_app
from xmix.runtime.control.params import param_columns

D, L, V = 32, 4, 100
SHAPE = ModelShape(n_layers=L, hidden_size=D, vocab_size=V)
MOE = ModelShape(n_layers=L, hidden_size=D, vocab_size=V, n_experts=4, moe_layers=(1, 3))
F = 40


def _sae(arch: str, seed: int = 0) -> SAE:
    g = torch.Generator().manual_seed(seed)
    return SAE(
        torch.randn(D, F, generator=g) / D**0.5,
        torch.randn(F, generator=g) * 0.2,
        torch.randn(F, D, generator=g),
        torch.randn(D, generator=g) * 0.3,
        architecture=arch,
        threshold=torch.rand(F, generator=g) * 0.5 if arch == "jumprelu" else None,
        k=7 if arch == "topk" else None,
        hook="layers.2.residual.post",
    )


def rich_app() -> App:
    """Every built-in kernel but the router, conditions of every kind, token sets, spans, a
    since(...) term, a stop, app parameters, an artifact shared across layers."""
    g = torch.Generator().manual_seed(3)
    a = App("rich", metadata={"paper": "x", "n": [1, 2]})
    a.param("theta", 0.25)
    a.token_set("open", ids=[5])
    a.token_set("close", ids=[6, 9])
    v = torch.randn(D, generator=g)
    a.read("probe", weight=torch.randn(D, generator=g), bias=0.5).layers([0]).at(
        "residual.post"
    ).named("p")
    a.read("capture").layers([1]).at("residual.mid").named("cap")
    a.read("cosine", vector=torch.randn(D, generator=g)).layers([0]).at("attention.post").named(
        "cos"
    )
    a.read("distance", centroids=torch.randn(3, D, generator=g)).layers([2]).at(
        "residual.pre"
    ).named("dist")
    a.write("add", vector=v, scale=2.0).layers([1, 2, 3]).at("residual.post").cond(
        when="token_in(open) or in_span(open, close)", gate="p >= theta"
    )
    a.write("ablate", direction=torch.randn(L, D, generator=g)).layers("all").at("mlp.post")
    a.write("affine", matrix=torch.eye(D) * 0.5, mu_s=v, mu_t=-v).layers([3]).at(
        "residual.pre"
    ).cond("prompt_mean(p) > 0.1 and not last_token")
    a.write("clamp", direction=v, min=-1.0, max=3.0).layers([3]).at("residual.mid").cond(
        "since(p > 0.9)"
    )
    sae = _sae("jumprelu")
    a.read("sae", sae=sae, features=[3, 7, 11]).named("feats")
    a.read("sae", sae=sae, top_k=5).named("top")
    a.write("sae_clamp", sae=sae, feature=[2, 4], value=1.5).cond("feats.f7 > 0.2")
    a.write("sae_steer", sae=_sae("relu", 1), feature=[1], scale=0.5)
    a.stop(when="dist < 0.01")
    return a


def moe_app() -> App:
    a = App("moe")
    a.write("router", mask=torch.tensor([1.0, 0.0, -1.0, 0.0]), delta=0.2).layers("all").at(
        "router.logits"
    )
    a.read("sae", sae=_sae("topk"), top_k=4).named("t")
    return a


def custom_app() -> App:
    a = App("user")
    a.write(
        "custom",
        cpu_library="/nonexistent/libk.so",
        cpu_symbol="k",
        params={"alpha": 2.0},
        artifact=torch.arange(6.0),
    ).layers([1]).at("residual.post")
    return a


def tables(lw, shape):
    """What the control block gets from a lowered app: the linked op list and its tables."""
    cb = ControlBlock(shape, "cpu", SMALL)
    mem = cb.mem
    inst = link_app(lw, 0, 0, "request", mem.arena, Claims(), mem.device, mem.cap.max_tokens)
    t = build_tables(
        {lw.name: inst}, mem.n_sites, mem.cap.max_ops, mem.cap.max_cond, mem.vocab_words
    )
    recs = t.ops.view(OP_DTYPE).copy()
    for f in ("a0", "a1", "a2", "a3", "fn"):  # device pointers differ; their contents below
        recs[f] = 0
    arts = [{k: v.cpu() for k, v in lo.artifacts.items()} for lo in inst.linked]  # by op position
    cols = [(c.key, c.default, c.lo, c.hi, c.public) for c in param_columns(lw)]
    return recs, t.cond.tolist(), t.tokset_bits.tolist(), t.span_def.tolist(), arts, cols


@pytest.mark.parametrize("make, shape", [(rich_app, SHAPE), (moe_app, MOE), (custom_app, SHAPE)])
def test_a_decoded_program_gives_the_control_block_what_lowering_gives(make, shape):
    lw = lower(make(), shape)
    lw.digest = app_digest(make())
    got = decode(encode(lw), shape)
    assert [vars(o).keys() for o in got.ops] == [vars(o).keys() for o in lw.ops]
    for a, b in zip(lw.ops, got.ops):
        for f in vars(a):
            if f in ("artifacts", "sae", "custom"):
                continue
            assert getattr(a, f) == getattr(b, f), (a.label, f)
        assert a.artifacts.keys() == b.artifacts.keys()
        for k in a.artifacts:
            assert torch.equal(a.artifacts[k].float(), b.artifacts[k]), (a.label, k)
        assert (a.custom is None) == (b.custom is None)
        if a.custom is not None:
            assert a.custom.to_json() == b.custom.to_json()
    for f in ("name", "token_sets", "spans", "app_params", "digest", "sites", "writes"):
        assert getattr(lw, f) == getattr(got, f), f
    assert lw.stateful == got.stateful and lw.reads.keys() == got.reads.keys()
    assert lw.aliases == got.aliases and lw.sinces.keys() == got.sinces.keys()
    assert got.app.metadata == make().metadata and got.app.name == lw.name
    want, have = tables(lw, shape), tables(got, shape)
    assert np.array_equal(want[0], have[0])
    assert want[1:4] == have[1:4] and want[5] == have[5]
    for x, y in zip(want[4], have[4]):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_a_shared_artifact_travels_once():
    a = App("shared")
    v = torch.randn(D)
    a.write("add", vector=v, scale=1.0).layers("all").at("residual.post")
    data = encode(lower(a, SHAPE))
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    assert [k for k in header if k != "__metadata__"] == ["t0"]  # one array for four layers
    got = decode(data, SHAPE)
    assert len({id(o.artifacts["a0"]) for o in got.ops}) == 1


def test_the_digest_is_the_apps_content_not_its_file():
    a = rich_app()
    b = App.from_bytes(a.to_bytes(), allow_custom=True)
    assert app_digest(a) == app_digest(b)
    c = rich_app()
    c.ops[0].params["bias"] = 0.25
    assert app_digest(c) != app_digest(a)


# ---------------------------------------------------------------------- forged programs
_split, _join = program_parts, program_from_parts


def _op(prog, kernel):
    return next(o for o in prog["ops"] if o["kernel"] == kernel)


def _forge(fn):
    prog, arrays = _split(encode(lower(rich_app(), SHAPE)))
    fn(prog, arrays)
    return _join(prog, arrays)


def _set(kernel, field, value):
    def f(p, a):
        _op(p, kernel)[field] = value

    return f


def _short_array(p, a):
    a[_op(p, "add")["artifacts"]["a0"]] = torch.ones(D - 1)  # the kernel reads d floats


def _nan(p, a):
    a[_op(p, "probe")["artifacts"]["a0"]][3] = float("nan")


def _token(v):
    def f(p, a):
        a[p["token_sets"]["open"]] = torch.tensor([v], dtype=torch.int32)

    return f


def _cond(kernel, items):
    def f(p, a):
        _op(p, kernel)["cond"] = items

    return f


def _extra_array(p, a):
    a["stray"] = torch.ones(3)


def _sae_f(p, a):
    o = next(o for o in p["ops"] if o["kernel"] == "sae" and o["features"])
    o["features"] = [3, 7, F + 5]
    a[o["artifacts"]["a3"]] = torch.tensor([3.0, 7.0, F + 5.0])


def _sae_k(p, a):
    o = next(o for o in p["ops"] if o["kernel"] == "sae" and o["features"])
    a[o["artifacts"]["a2"]][2 * F + D] = 1e6  # TopK's k, read by the kernel


def _deep(p, a):
    items = [["flag", "all"]] * 18 + [["and"]] * 17  # a right-deep chain: 18 on the stack
    _op(p, "clamp")["cond"] = items


def _model(p, a):
    p["model"]["n_layers"] = L + 1


def _gate_later(p, a):
    # the add (layers 1..3) gates on p (layer 0): move p after it
    o = _op(p, "probe")
    o["layer"], o["site_id"] = 3, site_id("residual.post", 3, L)
    p["ops"].sort(key=lambda o: (o["site_id"], o["kernel"] in ("stop", "since"), o["op_index"]))


FORGED = [
    ("format", lambda p, a: p.update(format="xmix.program/9"), "'format' must be"),
    ("model", _model, "lowered for a model with n_layers=5"),
    ("kernel", _set("add", "kernel", "rm -rf"), "'kernel' is not a kernel"),
    ("site id", _set("add", "site_id", 10_000), "'site_id' must be an int in"),
    ("site id mismatch", _set("add", "site_id", 0), "'site_id' is 0"),
    ("layer", _set("ablate", "layer", L), "'layer' must be a layer"),
    ("short artifact", _short_array, "reads [32]"),
    ("NaN", _nan, "holds NaN or Inf"),
    ("params", _set("add", "params", [["scale", 1.0], ["x", 2.0]]), "'params' must be ['scale']"),
    ("param range", _set("clamp", "params", [["min", 4.0], ["max", 3.0]]), "min is greater"),
    ("param bound", _set("add", "params", [["scale", 1e38]]), "write bound"),
    ("token id", _token(V), "in [0, 100)"),
    ("negative token", _token(-1), "in [0, 100)"),
    ("cond node", _cond("add", [["exec", "x"]]), "not a condition node"),
    ("cond underflow", _cond("add", [["flag", "all"], ["and"]]), "not a condition node"),
    ("cond leftovers", _cond("add", [["flag", "all"], ["flag", "prompt"]]), "leaves 2 nodes"),
    ("cond set", _cond("add", [["token_in", "nope"]]), "token set 'nope'"),
    ("cond read", _cond("add", [["gate", "nope", ">", 1.0]]), "not a read of this app"),
    ("cond param", _cond("add", [["gate", "p", ">", "nope"]]), "not an app parameter"),
    ("cond depth", _deep, "stack deeper than 16"),
    ("since", _set("since", "sticky", "since(p > 0.1)"), "'sticky' must be the text"),
    ("sae feature", _sae_f, "SAE features below 40"),
    ("sae k", _sae_k, "the SAE's k"),
    ("sae flags", _set("sae_clamp", "flags", 0x7FFF0), "names no SAE architecture"),
    ("capture", _set("capture", "n", D + 1), "capture dims"),
    ("state width", _set("cosine", "state_width", 1), "'state_width' is 1"),
    (
        "custom on a built-in",
        _set("add", "custom", {"primitive": "write"}),
        "'custom' must be null",
    ),
    ("stray array", _extra_array, "named by no op"),
    ("gate order", _gate_later, "gates may only read earlier reads"),
]


@pytest.mark.parametrize("forge, fragment", [f[1:] for f in FORGED], ids=[f[0] for f in FORGED])
def test_a_forged_program_is_refused_naming_what_is_wrong(forge, fragment):
    with pytest.raises(ProgramError, match="app 'rich'") as e:
        decode(_forge(forge), SHAPE)
    assert fragment in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"", "too short"),
        (b"\xff" * 16, "header claims"),
        ((3).to_bytes(8, "little") + b"{no", "header is not JSON"),
        (xmix.App("a").to_bytes(), "no 'xmix.program'"),
        (_safetensors({"t0": torch.ones(2)}, "[1]"), "expected an object"),
    ],
    ids=["empty", "length", "json", "app file", "not an object"],
)
def test_bytes_that_are_no_program_are_refused(data, fragment):
    with pytest.raises(ProgramError, match="lowered program") as e:
        decode(data, SHAPE)
    assert fragment in str(e.value), str(e.value)


def test_a_truncated_program_is_refused():
    data = encode(lower(rich_app(), SHAPE))
    for cut in (len(data) - 1, len(data) // 2, 9):
        with pytest.raises(ProgramError):
            decode(data[:cut], SHAPE)


def test_an_app_file_is_not_a_program():
    with pytest.raises(ProgramError, match="no 'xmix.program'"):
        decode(rich_app().to_bytes(), SHAPE)


# ---------------------------------------------------------------------- one lowering
def test_a_deploy_is_parsed_and_lowered_once_across_servers_and_engines():
    """Two API servers (Controllers) over two engines: a deploy through one, as the HTTP
    route gives it (the app file's bytes), is parsed and lowered once in all; each engine
    and the other server decode its program. Before: 4 parses and 4 lowerings (the first
    server, each worker, the other server)."""
    engines = [Engine(0), Engine(1)]
    s1, s2 = server(engines), server(engines)
    s2.sync()
    before = deploy_work.snapshot()
    s1.deploy(app("a").to_bytes(), allow_custom=False)
    s2.sync()
    got = {k: v - before[k] for k, v in deploy_work.snapshot().items()}
    assert got == {"app_parses": 1, "lowerings": 1, "program_decodes": 3}
    assert [a["name"] for a in s2.apps()] == ["a"]
    # the other server's record is the program's: the same columns and version
    d1, d2 = s1.registry.get("a"), s2.registry.get("a")
    assert d1.describe() == d2.describe() and d1.lowered.digest == d2.lowered.digest != ""


def test_a_forged_program_on_a_worker_is_refused_and_it_serves_on():
    """The install path of a worker (the RPC the frontend calls) refuses a forged program
    naming the field, and keeps what it had."""
    from xmix.integrations.vllm.worker import worker as W

    e = Engine(0)
    good = program_of(app("a"), e.cb.shape)
    assert W.WORKER_METHODS["xmix_deploy"](e.worker, good, "request", 1)["name"] == "a"
    prog, arrays = _split(program_of(app("b"), e.cb.shape))
    prog["ops"][0]["artifacts"]["a0"] = "t0"
    arrays["t0"] = torch.ones(3)  # an add that would read 64 floats from 3
    reply = W.xmix_call(e.worker, "xmix_deploy", [_join(prog, arrays), "request", 2])
    assert reply[0] == "error" and "ProgramError" in reply[1] and "reads [64]" in reply[1], reply
    assert [a["name"] for a in e.cb.deploy.describe()] == ["a"] and not e.cb.deploy.staged
