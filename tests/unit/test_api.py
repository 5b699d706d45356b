"""Properties of the app API, the app file format, deploy-time validation and the condition
grammar. No model is needed: apps are checked against a ModelShape.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from xmix.lang import conditions as C
from xmix.lang.api import App, AppError
from xmix.lang.catalog import CENTROIDS, EXPERTS, KERNELS, MAT_DD, SAE_KERNELS, VEC
from xmix.lang.lowering import DeployError, latch_from_generated, lower
from xmix.lang.sites import LAYER_SITES, ModelShape, site_id

D, L, E, V = 32, 4, 4, 100
S = ModelShape(n_layers=L, hidden_size=D, vocab_size=V, n_experts=E, moe_layers=(0, 1, 2, 3))
RESERVED = {"and", "or", "not", "token_in", "in_span", "since", *C.FLAGS, *C.REDUCES}
SITES = [s for s in (*LAYER_SITES, "final.post") if s != "router.logits"]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ------------------------------------------------------------------------------ strategies
ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True).filter(
    lambda s: s not in RESERVED
)
app_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,20}", fullmatch=True)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=10,
)


def _tensor(draw, shape, kind):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == EXPERTS:
        dtype = draw(st.sampled_from([torch.float32, torch.int8, torch.int32, torch.float16]))
        return torch.randint(-1, 2, shape, generator=g).to(dtype)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    return torch.randn(shape, generator=g).to(dtype)


def _artifact(draw, kind, n_sel):
    base = {VEC: (D,), MAT_DD: (D, D), EXPERTS: (E,)}.get(kind)
    if kind == CENTROIDS:
        base = (draw(st.integers(1, 3)), D)
    lead = [()]
    if n_sel:  # layer-level sites may give one row per layer
        lead += [(L,), (n_sel,)]
    return _tensor(draw, draw(st.sampled_from(lead)) + base, kind)


def _conditions(atoms):
    return st.recursive(
        st.sampled_from(atoms),
        lambda c: st.builds(C.And, c, c) | st.builds(C.Or, c, c) | st.builds(C.Not, c),
        max_leaves=6,
    )


@st.composite
def valid_apps(draw, custom=False):
    """Apps built from the catalog that lower on S: every read named, conditions only on
    earlier reads, cosine gates only on earlier sites, latches on earlier sites (later ones
    lower too: test_latch_at_any_site_and_cosine_gate_at_a_later_one)."""
    app = App(
        draw(app_names),
        metadata=draw(st.dictionaries(st.text(max_size=6), json_values, max_size=3)),
    )
    for p in draw(st.lists(ident, max_size=3, unique=True)):
        app.param(p, draw(finite))
    sets = draw(st.lists(ident, max_size=3, unique=True))
    for s in sets:
        app.token_set(s, ids=draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=5)))
    names = iter(draw(st.lists(ident, min_size=8, max_size=8, unique=True)))
    reads = []  # (key, site id, op index, kernel)
    n_ops = draw(st.integers(0, 6))
    # SAE kernels take an xmix.SAE and one layer: tests/unit/test_sae_kernels.py covers them.
    kernels = sorted(
        k
        for k in KERNELS
        if k != "custom" and k not in SAE_KERNELS and KERNELS[k].primitive != "control"
    ) + (["custom"] if custom else [])
    for i in range(n_ops):
        kernel = draw(st.sampled_from(kernels))
        spec = KERNELS[kernel]
        site = "router.logits" if kernel == "router" else draw(st.sampled_from(SITES))
        layer_spec = None
        if site != "final.post":
            layer_spec = draw(
                st.just("all")
                | st.lists(st.integers(0, L - 1), min_size=1, max_size=L, unique=True)
            )
        layers = (
            [None]
            if layer_spec is None
            else (list(range(L)) if layer_spec == "all" else layer_spec)
        )
        n_sel = 0 if layer_spec is None else len(layers)
        kw = {a: _artifact(draw, kind, n_sel) for a, kind in spec.artifacts.items()}
        if kernel in ("ablate", "clamp", "cosine"):
            # zero-norm directions are rejected at deploy; keep these usable
            kw = {a: t.float().add(1.0) if t.is_floating_point() else t for a, t in kw.items()}
        if kernel == "probe" and draw(st.booleans()):
            kw["bias"] = draw(st.floats(-10, 10))
        if kernel == "add" and draw(st.booleans()):
            kw["scale"] = draw(st.floats(-1e4, 1e4))
        if kernel == "clamp":
            lo, hi = sorted(draw(st.tuples(st.floats(-1e3, 1e3), st.floats(-1e3, 1e3))))
            kw.update({"min": lo, "max": hi} if draw(st.booleans()) else {})
        if kernel == "router" and draw(st.booleans()):
            kw["delta"] = draw(st.floats(0, 5))
        if kernel == "capture" and draw(st.booleans()):
            a = draw(st.integers(0, D - 1))
            kw["dims"] = (a, draw(st.integers(a + 1, D)))
        if kernel == "custom":
            primitive = draw(st.sampled_from(["read", "write"]))
            kw.update(cpu_library="/opt/kernels/libuser.so", cpu_symbol=draw(ident))
            if draw(st.booleans()):
                kw["params"] = {draw(ident): draw(finite)}
            if draw(st.booleans()):
                kw["artifact"] = _tensor(draw, (draw(st.integers(1, 5)),), VEC)
        else:
            primitive = spec.primitive
        op = (app.read if primitive == "read" else app.write)(kernel, **kw)
        if layer_spec is not None:
            op.layers(layer_spec)
        op.at(site)
        name = next(names) if primitive == "read" or draw(st.booleans()) else None
        if name:
            op.named(name)
        sids = [site_id(site, l, L) for l in layers]
        first = min(sids)
        atoms = [C.Flag(f) for f in C.FLAGS] + [C.TokenIn(s) for s in sets]
        atoms += [C.InSpan(a, b) for a in sets for b in sets]
        values = st.one_of(
            finite.map(float),
            *([st.sampled_from(sorted(app.app_params))] if app.app_params else []),
        )
        for key, sid, _j, k in reads:
            if sid < first or (sid == first and k != "cosine"):
                atoms.append(C.Gate(key, draw(st.sampled_from(C.CMPS)), draw(values)))
            if sid < first:
                atoms.append(
                    C.Latch(
                        draw(st.sampled_from(C.REDUCES)),
                        key,
                        draw(st.sampled_from(C.CMPS)),
                        draw(values),
                    )
                )
        if draw(st.booleans()):
            text = C.to_text(draw(_conditions(atoms)))
            where = draw(st.sampled_from(["expr", "when", "gate"]))
            op.cond(**{where: text}) if where != "expr" else op.cond(text)
        if primitive == "read":
            for l, sid in zip(layers, sids):
                reads.append((f"{name}.{l}" if len(layers) > 1 else name, sid, i, kernel))
    return app


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_app(a: App, b: App) -> None:
    assert b.spec() == a.spec()
    ta, tb = a.tensors(), b.tensors()
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert tb[k].dtype == ta[k].dtype and tb[k].shape == ta[k].shape, k
        assert _bits(tb[k]) == _bits(ta[k]), k  # bit-exact, NaN payloads included


# ------------------------------------------------------------------------------ save / load
@FAST
@given(valid_apps(custom=True))
def test_save_load_round_trip(app):
    assert_same_app(app, App.from_bytes(app.to_bytes(), allow_custom=True))
    with tempfile.TemporaryDirectory() as d:
        path = app.save(os.path.join(d, "app.xmix"))
        assert_same_app(app, App.load(path))


@FAST
@given(valid_apps(), st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_round_trip_keeps_non_finite_artifacts(app, bad):
    """Files carry NaN/Inf unchanged; refusing them is the deploy step's job."""
    ops = [o for o in app.ops if any(t.is_floating_point() for t in o.artifacts.values())]
    assume(ops)
    name, t = next((k, t) for k, t in ops[0].artifacts.items() if t.is_floating_point())
    t = t.clone()
    t.view(-1)[0] = bad
    ops[0].artifacts[name] = t
    assert_same_app(app, App.from_bytes(app.to_bytes()))
    with pytest.raises(DeployError, match=rf"app '{app.name}', op .*'{name}' contains NaN or Inf"):
        lower(app, S)


@FAST
@given(valid_apps())
def test_lowering_is_preserved_by_the_file(app):
    a = lower(app, S)
    b = lower(App.from_bytes(app.to_bytes()), S)
    assert [
        (o.site_id, o.op_index, o.kernel, o.result_key, o.params, o.cond, o.n, o.m) for o in a.ops
    ] == [
        (o.site_id, o.op_index, o.kernel, o.result_key, o.params, o.cond, o.n, o.m) for o in b.ops
    ]
    for x, y in zip(a.ops, b.ops):
        assert sorted(x.artifacts) == sorted(y.artifacts)
        for k in x.artifacts:
            assert y.artifacts[k].dtype == torch.float32 and torch.equal(
                x.artifacts[k], y.artifacts[k]
            )
    # deploy order: sorted by (site, declaration), one result key per read instance
    assert [(o.site_id, o.op_index) for o in a.ops] == sorted(
        (o.site_id, o.op_index) for o in a.ops
    )
    assert sorted(a.reads) == sorted(o.result_key for o in a.ops if o.is_read)
    assert a.token_sets == {n: sorted(set(s.ids)) for n, s in app.token_sets.items()}


@FAST
@given(valid_apps(), st.integers(0, 6), st.sampled_from(["read", "write"]))
def test_network_loads_refuse_custom_kernels(app, at, primitive):
    op = (app.read if primitive == "read" else app.write)(
        "custom", cpu_library="/tmp/evil.so", cpu_symbol="run", params={"k": 1.0}
    )
    op.layers([0]).at("residual.pre")
    app.ops.insert(min(at, len(app.ops) - 1), app.ops.pop())  # anywhere in the app
    data = app.to_bytes()
    with pytest.raises(AppError, match="custom kernel"):
        App.from_bytes(data)
    with pytest.raises(AppError, match="custom kernel"):
        App.from_bytes(data, allow_custom=False)
    assert_same_app(app, App.from_bytes(data, allow_custom=True))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_bytes_raise_app_error(data):
    with pytest.raises(AppError):
        App.from_bytes(data)


@FAST
@given(valid_apps(), st.data())
def test_damaged_files_load_or_raise_app_error(app, data):
    raw = bytearray(app.to_bytes())
    how = data.draw(st.sampled_from(["truncate", "flip", "insert"]))
    i = data.draw(st.integers(0, len(raw) - 1))
    if how == "truncate":
        raw = raw[:i]
    elif how == "flip":
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    else:
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        App.from_bytes(bytes(raw))
    except AppError:
        pass


def _spec_paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _spec_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _spec_paths(v, path + (i,))


def _replaced(node, path, value):
    if not path:
        return value
    node = json.loads(json.dumps(node))
    cur = node
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return node


def _every_field_app() -> App:
    """One app that uses every part of the spec: metadata, params, all token set forms,
    every kernel, per-layer artifacts, names, options, conditions, a custom kernel."""
    g = torch.Generator().manual_seed(0)
    app = App("every-field", metadata={"author": "x", "tags": ["a", "b"]})
    app.param("theta", 0.5)
    app.token_set("ids", ids=[1, 2]).token_set("strs", strings=["a"]).token_set(
        "subs", contains=["b"]
    )
    app.read("probe", weight=torch.randn(D, generator=g), bias=0.1).layers([0, 1]).at(
        "residual.pre"
    ).named("p")
    app.read("capture", dims=(1, 3)).layers("all").at("mlp.post").named("c").cond("last_token")
    app.write("add", vector=torch.randn(L, D, generator=g), scale=2.0).layers("all").at(
        "residual.post"
    ).cond("in_span(ids, strs)", when="prompt", gate="p.0 > theta")
    app.write("clamp", direction=torch.randn(D, generator=g), min=-1.0, max=1.0).layers([2]).at(
        "residual.mid"
    ).cond("prompt_mean(p.1) >= 0.25 or not token_in(subs)")
    app.write("router", mask=torch.tensor([1, 0, -1, 0], dtype=torch.int8), delta=0.1).layers(
        [3]
    ).at("router.logits")
    app.write(
        "custom", cpu_library="/opt/k.so", cpu_symbol="k", params={"k": 1.0}, artifact=torch.ones(3)
    ).layers([1]).at("attention.post").named("u")
    return app


REPLACEMENTS = {
    "null": None,
    "true": True,
    "zero": 0,
    "neg": -1,
    "float": 2.5,
    "big-float": 1e308,
    "empty-str": "",
    "str-x": "x",
    "str-ab": "ab",
    "str-abc": "abc",
    "empty-list": [],
    "list-int": [1],
    "list-str2": ["ab"],
    "list-str3": ["abc"],
    "list-pair": [[1, 2]],
    "empty-dict": {},
    "dict": {"a": 1},
    "huge-int": 10**400,
    "deep-parens": "(" * 3000 + "all" + ")" * 3000,
}


@pytest.mark.parametrize("value", [pytest.param(v, id=k) for k, v in REPLACEMENTS.items()])
def test_any_spec_field_replaced_loads_or_raises_app_error(value):
    app = _every_field_app()
    spec, tensors = app.spec(), app.tensors()
    assert_same_app(app, App.from_bytes(app.to_bytes(), allow_custom=True))
    for path in _spec_paths(spec):
        blob = st_save(tensors, metadata={"xmix.spec": json.dumps(_replaced(spec, path, value))})
        try:
            App.from_bytes(blob, allow_custom=True)
        except AppError:
            pass


def _spec_file(**changes) -> bytes:
    spec = {
        "format": "xmix.app/1",
        "name": "a",
        "metadata": {},
        "params": {},
        "token_sets": [],
        "ops": [],
    }
    spec.update(changes)
    return st_save({}, metadata={"xmix.spec": json.dumps(spec)})


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(_spec_file(metadata=["abc"]), id="metadata-list"),
        pytest.param(
            _spec_file(ops=[{"primitive": "read", "kernel": "capture", "params": ["abc"]}]),
            id="op-params-list",
        ),
        pytest.param(
            _spec_file(ops=[{"primitive": "read", "kernel": "capture", "options": "ab"}]),
            id="op-options-str",
        ),
        pytest.param(_spec_file(params={"theta": 10**400}), id="huge-param"),
        pytest.param((100000).to_bytes(8, "little") + b"[" * 100000, id="deep-header-json"),
        pytest.param(st_save({}, metadata={"xmix.spec": "[" * 100000}), id="deep-spec-json"),
        pytest.param(
            _spec_file(
                ops=[
                    {
                        "primitive": "read",
                        "kernel": "capture",
                        "cond": {"expr": "not " * 5000 + "all"},
                    }
                ]
            ),
            id="deep-condition",
        ),
    ],
)
def test_malformed_spec_raises_app_error(blob):
    with pytest.raises(AppError):
        App.from_bytes(blob)


def test_spec_errors_name_the_source_and_the_op():
    with pytest.raises(AppError, match=r"^<bytes>: unknown app format"):
        App.from_bytes(st_save({}, metadata={"xmix.spec": json.dumps({"format": "other"})}))
    with pytest.raises(AppError, match=r"without an xmix spec"):
        App.from_bytes(st_save({"x": torch.zeros(2)}))
    with pytest.raises(AppError, match=r"op #0 names artifact 'op0.vector'"):
        App.from_bytes(
            _spec_file(
                ops=[{"primitive": "write", "kernel": "add", "artifacts": {"vector": "op0.vector"}}]
            )
        )
    with pytest.raises(AppError, match=r"cannot read app file"):
        App.load("/nonexistent/dir/app.xmix")


# ------------------------------------------------------------------------------ validation
def _app(name="myapp") -> App:
    return App(name)


def _raises(app, *fragments, shape=S, err=DeployError):
    with pytest.raises(err) as info:
        lower(app, shape)
    msg = str(info.value)
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


@FAST
@given(app_names, ident, st.sampled_from(SITES))
def test_unknown_site_and_kernel_name_app_op_and_field(name, op, site):
    app = App(name)
    w = app.write("add", vector=torch.zeros(D)).named(op)
    with pytest.raises(AppError) as info:
        w.at(site + "x")
    assert f"app {name!r}, op {op!r}: unknown site {site + 'x'!r}" in str(info.value)
    with pytest.raises(AppError) as info:
        app.read("prob", weight=torch.zeros(D))
    assert f"app {name!r}, read('prob'): unknown kernel 'prob'" in str(info.value)
    with pytest.raises(AppError, match=f"app {name!r}, read\\('add'\\): 'add' is a write kernel"):
        app.read("add", vector=torch.zeros(D))
    # the same check when the site comes from a file
    spec = {
        "format": "xmix.app/1",
        "name": name,
        "ops": [
            {
                "primitive": "write",
                "kernel": "add",
                "site": site + "x",
                "layers": [0],
                "name": op,
                "params": {},
                "artifacts": {"vector": "op0.vector"},
            }
        ],
    }
    with pytest.raises(AppError, match=f"app {name!r}, op #0 .*unknown site"):
        App.from_bytes(
            st_save({"op0.vector": torch.zeros(D)}, metadata={"xmix.spec": json.dumps(spec)})
        )


@FAST
@given(app_names, ident, st.integers(1, 8), st.data())
def test_layer_out_of_range(name, op, n_layers, data):
    shape = ModelShape(n_layers=n_layers, hidden_size=D, vocab_size=V)
    bad = data.draw(st.integers(n_layers, 64) | st.integers(-64, -1))
    app = App(name)
    app.write("add", vector=torch.zeros(D)).layers([0, bad]).at("residual.pre").named(op)
    _raises(app, f"app {name!r}", f"op {op!r}", f"layer {bad} out of range", shape=shape)


@FAST
@given(app_names, ident, st.sampled_from(["vector", "matrix", "centroids", "mask"]), st.data())
def test_artifact_shape_that_does_not_fit(name, op, which, data):
    app = App(name)
    wrong = data.draw(st.integers(1, 40).filter(lambda n: n not in (D, E)))
    if which == "vector":
        app.write("add", vector=torch.zeros(wrong)).layers([1]).at("mlp.post").named(op)
    elif which == "matrix":
        app.write(
            "affine", matrix=torch.zeros(D, wrong), mu_s=torch.zeros(D), mu_t=torch.zeros(D)
        ).layers([1]).at("mlp.post").named(op)
    elif which == "centroids":
        app.read("distance", centroids=torch.zeros(2, wrong)).layers([1]).at("mlp.post").named(op)
    else:
        which = "mask"
        app.write("router", mask=torch.zeros(wrong)).layers([1]).at("router.logits").named(op)
    _raises(app, f"app {name!r}", f"op {op!r}", f"artifact {which!r} has shape")


@pytest.mark.parametrize("rows", [3, 5])
def test_artifact_layer_rows_that_do_not_fit(rows):
    app = _app()
    app.write("add", vector=torch.zeros(rows, D)).layers([0, 1]).at("residual.pre").named("st")
    _raises(
        app,
        "app 'myapp'",
        "op 'st'",
        f"artifact 'vector' has {rows} layer rows",
        "expected 4",
        "or 2",
    )


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_artifact_dtype_that_does_not_fit(dtype):
    with pytest.raises(AppError) as info:
        _app().write("add", vector=torch.zeros(D, dtype=dtype))
    assert "app 'myapp', write('add'): artifact 'vector' has dtype" in str(info.value)


@FAST
@given(
    app_names,
    ident,
    st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.integers(0, D - 1),
    st.sampled_from(["vector", "mu_s", "centroids"]),
)
def test_non_finite_artifact(name, op, bad, at, which):
    app = App(name)
    t = torch.zeros(D)
    t[at] = bad
    if which == "vector":
        app.write("add", vector=t).layers("all").at("residual.post").named(op)
    elif which == "mu_s":
        app.write("affine", matrix=torch.eye(D), mu_s=t, mu_t=torch.zeros(D)).layers([2]).at(
            "residual.post"
        ).named(op)
    else:
        app.read("distance", centroids=torch.stack([torch.zeros(D), t])).layers([2]).at(
            "residual.post"
        ).named(op)
    _raises(app, f"app {name!r}", f"op {op!r}", f"artifact {which!r} contains NaN or Inf")


def test_artifact_that_overflows_fp32_is_refused():
    app = _app()
    app.write("add", vector=torch.full((D,), 1e39, dtype=torch.float64)).layers([0]).at(
        "residual.pre"
    ).named("st")
    _raises(app, "app 'myapp'", "op 'st'", "'vector'")


def test_cosine_of_a_tiny_vector_lowers_to_finite_artifacts():
    app = _app()
    app.read("cosine", vector=torch.full((D,), 1e-25)).layers([0]).at("residual.pre").named("c")
    lw = lower(app, S)
    assert all(torch.isfinite(t).all() for t in lw.ops[0].artifacts.values())


@FAST
@given(app_names, ident, ident, st.data())
def test_gate_on_a_read_that_runs_later(name, gated, read, data):
    assume(gated != read)
    app = App(name)
    read_site = data.draw(st.sampled_from(SITES[:-1]))
    read_layer = data.draw(st.integers(0, L - 1))
    sid = site_id(read_site, read_layer, L)
    # the gated op is at the same site declared first, or at an earlier site
    earlier = [(s, l) for s in SITES[:-1] for l in range(L) if site_id(s, l, L) <= sid]
    site, layer = data.draw(st.sampled_from(earlier))
    app.write("add", vector=torch.zeros(D)).layers([layer]).at(site).named(gated).cond(
        gate=f"{read} > 0.5"
    )
    app.read("probe", weight=torch.zeros(D)).layers([read_layer]).at(read_site).named(read)
    _raises(app, f"app {name!r}", f"op {gated!r}", f"gate on {read!r}", "runs later")


def test_latch_at_any_site_and_cosine_gate_at_a_later_one():
    # a latch may feed an op at the read's site or before it (from the first generated token)
    app = _app()
    app.read("probe", weight=torch.zeros(D)).layers([1]).at("residual.pre").named("p")
    app.write("add", vector=torch.zeros(D)).layers([1]).at("residual.pre").named("w").cond(
        "prompt_last(p) > 0.5"
    )
    app.write("add", vector=torch.zeros(D)).layers([0]).at("mlp.post").named("w0").cond(
        "prompt_mean(p) > 0.5"
    )
    app.write("add", vector=torch.zeros(D)).layers([2]).at("residual.pre").named("w2").cond(
        "prompt_mean(p) > 0.5"
    )
    lw = lower(app, S)
    late = {o.name: latch_from_generated(lw, o, o.cond) for o in lw.ops if o.kernel == "add"}
    assert late == {"w": True, "w0": True, "w2": False}
    app = _app()
    app.read("cosine", vector=torch.ones(D)).layers([1]).at("residual.pre").named("c")
    app.write("add", vector=torch.zeros(D)).layers([1]).at("residual.pre").named("w").cond(
        gate="c > 0"
    )
    _raises(app, "app 'myapp'", "op 'w'", "gate on cosine read 'c'")


@FAST
@given(
    app_names,
    st.lists(ident, min_size=1, max_size=4, unique=True),
    st.sampled_from(SITES[:-1]),
    st.integers(0, L - 1),
)
def test_cycle(name, reads, site, layer):
    app = App(name)
    # each read gated on the next, the last on the first: a cycle of len(reads) ops
    for i, r in enumerate(reads):
        nxt = reads[(i + 1) % len(reads)]
        app.read("probe", weight=torch.zeros(D)).layers([layer]).at(site).named(r).cond(
            gate=f"{nxt} >= 0"
        )
    msg = _raises(app, f"app {name!r}", "conditions form a cycle")
    assert any(f"op {r!r}" in msg for r in reads)
    assert all(repr(r) in msg for r in reads)


@FAST
@given(
    app_names,
    ident,
    ident,
    st.sampled_from(["token_in({s})", "in_span(known, {s})", "in_span({s}, known)"]),
)
def test_unknown_token_set(name, op, missing, form):
    assume(missing != "known")
    app = App(name)
    app.token_set("known", ids=[1, 2])
    app.write("add", vector=torch.zeros(D)).layers([0]).at("residual.pre").named(op).cond(
        form.format(s=missing)
    )
    _raises(app, f"app {name!r}", f"op {op!r}", f"unknown token set {missing!r}")


def test_token_set_errors():
    app = _app()
    app.token_set("big", ids=[V])
    app.write("add", vector=torch.zeros(D)).layers([0]).at("residual.pre").named("w").cond(
        "token_in(big)"
    )
    _raises(app, "app 'myapp'", "token set 'big'", f"token id {V} is outside the vocabulary")
    app = _app()
    app.token_set("words", strings=["\n\n"])
    _raises(app, "app 'myapp'", "token set 'words'", "tokenizer")
    with pytest.raises(AppError, match="token set 'words' declared twice"):
        app.token_set("words", ids=[1])


@FAST
@given(app_names, ident)
def test_name_clashes(name, op):
    app = App(name)
    app.read("probe", weight=torch.zeros(D)).layers([0]).at("residual.pre").named(op)
    w = app.write("add", vector=torch.zeros(D)).layers([1]).at("residual.pre")
    with pytest.raises(AppError, match=f"app {name!r}: two ops are named {op!r}"):
        w.named(op)
    # two unnamed reads of one kernel report under the same result name
    app = App(name)
    app.read("distance", centroids=torch.zeros(1, D)).layers([0]).at("residual.pre")
    app.read("distance", centroids=torch.zeros(1, D)).layers([2]).at("mlp.post")
    _raises(app, f"app {name!r}", "op #1 (read 'distance')", "result name 'distance' is used twice")
    # a named read that takes the name another read reports under
    app = App(name)
    app.read("capture").layers([0]).at("residual.pre")
    app.read("probe", weight=torch.zeros(D)).layers([1]).at("residual.pre").named("capture")
    _raises(app, f"app {name!r}", "result name 'capture' is used twice")


_Z = torch.zeros(D)
OTHER_DEPLOY_ERRORS = {
    "no-site": (lambda a: a.write("add", vector=_Z).layers([0]), "no site"),
    "no-layers": (lambda a: a.write("add", vector=_Z).at("mlp.post"), "needs .layers"),
    "final-with-layers": (
        lambda a: a.write("add", vector=_Z).layers([0]).at("final.post"),
        "model-level site",
    ),
    "router-elsewhere": (
        lambda a: a.write("router", mask=torch.zeros(E)).layers([0]).at("mlp.post"),
        "only runs at router.logits",
    ),
    "router-mask": (
        lambda a: a.write("router", mask=torch.full((E,), 0.5)).layers([0]).at("router.logits"),
        "-1, 0 and 1",
    ),
    "router-delta": (
        lambda a: (
            a.write("router", mask=torch.zeros(E), delta=-1.0).layers([0]).at("router.logits")
        ),
        "'delta'=-1.0 out of range",
    ),
    "clamp-bounds": (
        lambda a: (
            a.write("clamp", direction=torch.ones(D), min=1.0, max=0.0).layers([0]).at("mlp.post")
        ),
        "min (1.0) is greater than max (0.0)",
    ),
    "zero-direction": (
        lambda a: a.write("ablate", direction=_Z).layers([0]).at("mlp.post"),
        "'direction' has zero norm",
    ),
    "capture-dims": (
        lambda a: a.read("capture", dims=(0, D + 1)).layers([0]).at("mlp.post"),
        "exceed the hidden size",
    ),
    "unknown-read": (
        lambda a: a.write("add", vector=_Z).layers([0]).at("mlp.post").cond(gate="x > 0"),
        "condition reads 'x'",
    ),
}


@pytest.mark.parametrize("case", sorted(OTHER_DEPLOY_ERRORS))
def test_other_deploy_errors_name_app_op_and_field(case):
    build, fragment = OTHER_DEPLOY_ERRORS[case]
    app = _app()
    build(app)
    app.ops[0].named("the_op")
    _raises(app, "app 'myapp'", "op 'the_op'", fragment)


def test_router_and_parameter_errors():
    dense = ModelShape(n_layers=L, hidden_size=D, vocab_size=V)
    app = _app()
    app.write("router", mask=torch.zeros(E)).layers([0]).at("router.logits").named("r")
    _raises(app, "app 'myapp'", "op 'r'", "mixture-of-experts", shape=dense)
    some = ModelShape(n_layers=L, hidden_size=D, vocab_size=V, n_experts=E, moe_layers=(1, 3))
    app = _app()
    app.write("router", mask=torch.zeros(E)).layers([0, 1]).at("router.logits").named("r")
    _raises(app, "app 'myapp'", "op 'r'", "layer 0 has no router", shape=some)
    app = _app()
    app.write("add", vector=torch.zeros(D)).layers([0]).at("mlp.post").named("w").cond(
        gate="p > theta"
    )
    app.read("probe", weight=torch.zeros(D)).layers([0]).at("residual.pre").named("p")
    _raises(app, "app 'myapp'", "op 'w'", "unknown parameter 'theta'")


def test_builder_errors_name_app_and_op():
    app = _app()
    op = app.write("add", vector=torch.zeros(D)).named("w")
    for bad in ("some", [], [1, 1], [1.5], True):
        with pytest.raises(AppError, match="app 'myapp', op 'w': layer"):
            op.layers(bad)
    with pytest.raises(AppError, match="app 'myapp', write\\('add'\\): missing artifact 'vector'"):
        app.write("add")
    with pytest.raises(AppError, match="unknown argument\\(s\\) colour"):
        app.write("add", vector=torch.zeros(D), colour=1)
    with pytest.raises(AppError, match="parameter 'scale' must be a number"):
        app.write("add", vector=torch.zeros(D), scale="big")
    with pytest.raises(AppError, match="parameter 'scale' is NaN"):
        app.write("add", vector=torch.zeros(D), scale=float("nan"))
    with pytest.raises(AppError, match="app 'myapp', op 'w': in condition 'prompt and'"):
        op.cond("prompt and")
    with pytest.raises(AppError, match="app name 'bad name'"):
        App("bad name")


def test_huge_param_is_an_app_error():
    with pytest.raises(AppError):
        _app().param("theta", 10**400)


# ------------------------------------------------------------------------------ control block
def test_control_block_refuses_two_apps_of_one_name():
    from harness import SMALL
    from xmix.runtime.control import ControlBlock

    cb = ControlBlock(S, "cpu", SMALL)
    first = _app("same")
    first.write("add", vector=torch.ones(D)).layers([0]).at("residual.pre")
    second = _app("same")
    second.read("probe", weight=torch.ones(D)).layers([1]).at("residual.post").named("p")
    other = _app("other")
    other.read("probe", weight=torch.ones(D)).layers([1]).at("residual.post").named("p")
    cb.install(lower(first, S))
    with pytest.raises(DeployError, match="app 'same' is already deployed"):
        cb.install(lower(second, S))
    assert list(cb.apps) == ["same"] and cb.apps["same"].lowered.app is first
    # the refused install claimed nothing: the read channel is still free for another app
    inst = cb.install(lower(other, S), mode="all")
    assert list(inst.channels) == ["p"]
    cb.remove("same")
    cb.install(lower(second, S))
    assert sorted(cb.apps) == ["other", "same"]


# ------------------------------------------------------------------------------ conditions
values = st.one_of(st.floats(allow_nan=False, allow_infinity=False), ident)
atoms = st.one_of(
    st.sampled_from(C.FLAGS).map(C.Flag),
    ident.map(C.TokenIn),
    st.builds(C.InSpan, ident, ident),
    st.builds(
        C.Gate,
        ident | st.builds(lambda a, l: f"{a}.{l}", ident, st.integers(0, 99)),
        st.sampled_from(C.CMPS),
        values,
    ),
    st.builds(C.Latch, st.sampled_from(C.REDUCES), ident, st.sampled_from(C.CMPS), values),
)
trees = st.recursive(
    atoms,
    lambda c: st.builds(C.And, c, c) | st.builds(C.Or, c, c) | st.builds(C.Not, c),
    max_leaves=12,
)


# since(...) around any tree without one, anywhere in a tree
sticky_trees = st.recursive(
    atoms | trees.map(C.Since),
    lambda c: st.builds(C.And, c, c) | st.builds(C.Or, c, c) | st.builds(C.Not, c),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(trees, sticky_trees))
def test_condition_tree_to_text_and_back(node):
    text = C.to_text(node)
    assert C.parse(text) == node
    assert C.to_text(C.parse(text)) == text


@st.composite
def condition_texts(draw, depth=0):
    """Condition strings as a user writes them: loose spacing, redundant parentheses, no
    parentheses where precedence makes them unnecessary."""
    sp = lambda: draw(st.sampled_from(["", " ", "  "]))  # noqa: E731
    if depth > 3 or draw(st.integers(0, 2)) == 0:
        kind = draw(st.sampled_from(["flag", "set", "span", "gate", "latch"]))
        num = draw(st.sampled_from(["0", "-1.5", "2e-3", ".5", "+3", "1E2"]) | ident)
        text = {
            "flag": lambda: draw(st.sampled_from(C.FLAGS)),
            "set": lambda: f"token_in{sp()}({sp()}{draw(ident)}{sp()})",
            "span": lambda: f"in_span({draw(ident)}{sp()},{sp()}{draw(ident)})",
            "gate": lambda: f"{draw(ident)}{sp()}{draw(st.sampled_from(C.CMPS))}{sp()}{num}",
            "latch": lambda: (
                f"{draw(st.sampled_from(C.REDUCES))}({draw(ident)}) {draw(st.sampled_from(C.CMPS))} {num}"
            ),
        }[kind]()
        return f"({sp()}{text}{sp()})" if draw(st.booleans()) else text
    op = draw(st.sampled_from(["and", "or", "not"]))
    if op == "not":
        return f"not {draw(condition_texts(depth + 1))}"
    return f"({draw(condition_texts(depth + 1))} {op} {draw(condition_texts(depth + 1))})"


@settings(max_examples=300, deadline=None)
@given(condition_texts())
def test_condition_text_parses_and_round_trips(text):
    node = C.parse(text)
    assert C.parse(C.to_text(node)) == node


def test_condition_precedence():
    a, b, c = C.Flag("prompt"), C.Flag("generated"), C.Flag("last_token")
    assert C.parse("prompt or generated and last_token") == C.Or(a, C.And(b, c))
    assert C.parse("not prompt and generated") == C.And(C.Not(a), b)
    assert C.parse("prompt and generated and last_token") == C.And(C.And(a, b), c)
    assert C.parse("p18 >= -2.5e-1") == C.Gate("p18", ">=", -0.25)
    assert C.parse("p.3 != theta") == C.Gate("p.3", "!=", "theta")
    assert C.combine("prompt", "generated", "p > 1") == C.And(C.And(a, b), C.Gate("p", ">", 1.0))
    assert C.combine(None, None, None) is None


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "empty condition"),
        ("   ", "empty condition"),
        ("prompt and", "expected name, got 'end of condition'"),
        ("and prompt", "misplaced 'and'"),
        ("not", "expected name"),
        ("token_in(", "expected name"),
        ("token_in(a", "expected ), got 'end of condition'"),
        ("in_span(a)", "expected ,"),
        ("foo", "'foo' is not a condition"),
        ("frob(x)", "unknown function 'frob'"),
        ("p >=", "expected a number or parameter name"),
        ("p >> 1", "expected a number or parameter name"),
        ("prompt_mean(p)", "expected cmp"),
        ("prompt prompt", "unexpected 'prompt'"),
        ("(prompt", "expected )"),
        ("prompt)", "unexpected ')'"),
        ("prompt & generated", "cannot read condition"),
        ("p >= 1 2", "unexpected '2'"),
    ],
)
def test_malformed_conditions(text, fragment):
    with pytest.raises(C.ConditionError) as info:
        C.parse(text)
    msg = str(info.value)
    assert fragment in msg
    if text.strip():
        assert repr(text.strip()) in msg or repr(text) in msg, "the message quotes the condition"


@pytest.mark.parametrize("value", [None, 5, ["prompt"]])
def test_condition_must_be_a_string(value):
    with pytest.raises(C.ConditionError, match="must be a string"):
        C.parse(value)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("()<>=!,._ -+e09apromtndl")), max_size=40)
    | st.text(max_size=20)
)
def test_any_text_parses_or_raises_condition_error(text):
    try:
        node = C.parse(text)
    except C.ConditionError:
        return
    # numbers that overflow to inf do not round trip: test_overflowing_number_round_trips
    assume(
        not any(
            isinstance(n, (C.Gate, C.Latch)) and isinstance(n.value, float) and math.isinf(n.value)
            for n in C.walk(node)
        )
    )
    assert C.parse(C.to_text(node)) == node


def test_overflowing_number_is_refused():
    # 1e999 would become inf, which prints as "inf" and reads back as a parameter name
    with pytest.raises(C.ConditionError, match="out of range"):
        C.parse("p >= 1e999")


@pytest.mark.parametrize("text", ["(" * 3000 + "all" + ")" * 3000, "not " * 3000 + "all"])
def test_deep_nesting_is_a_condition_error(text):
    with pytest.raises(C.ConditionError):
        C.parse(text)


@pytest.mark.parametrize("word", ["prompt", "all", "not", "token_in", "prompt_mean"])
def test_reserved_words_are_refused_as_op_names(word):
    op = _app().read("probe", weight=torch.zeros(D))
    with pytest.raises(AppError):
        op.named(word)


def test_submodule_is_a_deprecated_alias_of_at():
    """The paper's ``.submodule(site)`` still places the op (apps written for the first
    releases run), with a DeprecationWarning that names ``at``; the saved app is the one
    ``at`` gives, byte for byte."""
    g = torch.Generator().manual_seed(0)
    v = torch.randn(D, generator=g)
    old, new = App("s"), App("s")
    with pytest.warns(DeprecationWarning, match=r"use Op\.at\(site\)"):
        old.write("add", vector=v, scale=2.0).layers([1]).submodule("mlp.post")
    new.write("add", vector=v, scale=2.0).layers([1]).at("mlp.post")
    assert old.ops[0].site == "mlp.post"
    assert old.to_bytes() == new.to_bytes()
    with pytest.warns(DeprecationWarning), pytest.raises(AppError, match="unknown site"):
        old.write("add", vector=v).layers([0]).submodule("mlp.out")
