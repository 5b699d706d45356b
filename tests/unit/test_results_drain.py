"""Read results out of the control block, without an engine: a read whose real value is NaN
is reported (the kernels say where a read ran; NaN is a value, never "no result"), on the
CPU twin, the CUDA twin (gpu) and the staged read-back; windows, dtypes and byte caps apply
in the drain, before anything leaves the worker.

Oracles: xmix.lang.reference (probe, stream), torch's dtype conversions, hand-counted positions
and bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import xmix
from fake_device import FakeDevice
from harness import SMALL, Harness, Req
from xmix import _C
from xmix.lang import reference as R
from xmix.lang.lowering import lower
from xmix.lang.results_codec import TRUNCATED_KEY, ReadShape, parse_options, position_bytes
from xmix.lang.sites import ModelShape, site_id
from xmix.runtime.control import ControlBlock

D = 16
SHAPE = ModelShape(n_layers=2, hidden_size=D, vocab_size=64)
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def probe_app():
    w = torch.linspace(-1, 1, D)
    app = xmix.App("k")
    app.read("probe", weight=w, bias=0.1).layers([0]).at("residual.pre").named("p")
    return app, w


def stream(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_whose_value_is_nan_is_reported(backend):
    """Token 1 of "a" carries a NaN in its stream (a stream driven to NaN): its probe value is
    NaN and it is reported at its position, like every other token the read ran on. Before
    validity flags the drain took NaN for "no result" and the position silently vanished."""
    app, w = probe_app()
    hs = Harness(SHAPE, [app], backend)
    h, r = stream(5)
    h[1, 3] = math.nan
    hs.step({"a": Req(3, 0, 3, ("k",)), "b": Req(2, 0, 2, ())})
    want = R.probe(R.stream(h, r), w, 0.1)
    hs.run("residual.pre", 0, h.to(backend), r.to(backend))
    res = hs.drain()
    assert set(res) == {"a"}
    got = res["a"]["k"]["p"]
    assert got["positions"] == [0, 1, 2]
    assert math.isnan(got["values"][1])
    assert got["values"][0] == pytest.approx(float(want[0]), rel=1e-5)
    assert got["values"][2] == pytest.approx(float(want[2]), rel=1e-5)


def test_a_nan_read_is_reported_through_the_staged_read_back():
    """The GPU path's read-back (pinned sets, side-stream copy) carries the validity flags."""
    app, w = probe_app()
    dev = FakeDevice()
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=dev)
    cb.install(lower(app, SHAPE))
    dev.run()
    cb.admit("a", ["k"], {}, 4)
    h, r = stream(4, seed=3)
    h[2, 0] = math.nan
    cb.begin_step(
        np.array([cb.slots.slot_of["a"]], np.int32), np.array([4]), np.array([0]), np.array([4]), 4
    )
    site = site_id("residual.pre", 0, SHAPE.n_layers)
    F32 = _C.constants()["DT_F32"]
    dev.launch(lambda: _C.run_site_cpu(cb.ptr, site, h.data_ptr(), r.data_ptr(), 4, D, D, D, F32))
    p = cb.reads.drain_async()
    cb.end_step()
    got = p.result()["a"]["k"]["p"]
    assert got["positions"] == [0, 1, 2, 3]
    want = R.probe(R.stream(h, r), w, 0.1)
    assert math.isnan(got["values"][2]) and got["values"][3] == pytest.approx(
        float(want[3]), rel=1e-5
    )


def capture_app(width=D):
    app = xmix.App("c")
    app.read("capture", dims=(0, width)).layers([1]).at("residual.post").named("h")
    return app


@pytest.mark.parametrize(
    "spec,want_a,want_b",
    [
        ("prompt", [0, 1, 2, 3], []),
        ([[-1, None]], [3], []),  # the last prompt token
        ("last_token", [3], [6]),
        ("generated", [], [6]),
        ([[1, 3], [6, 7]], [1, 2], [6]),
    ],
)
def test_windows_report_exactly_the_positions_asked_for(spec, want_a, want_b):
    """Two requests with a capture read on every token: "a" prefills 4 prompt tokens, "b" (a
    3-token prompt) decodes position 6; each reports only its window's positions."""
    hs = Harness(SHAPE, [capture_app()])
    opts = parse_options({"positions": spec})
    for name, plen in (("a", 4), ("b", 3)):
        hs.slots[name] = hs.cb.admit(name, ["c"], {}, plen, opts)
    h, r = stream(5, seed=1)
    hs.step({"a": Req(4, 0, 4, ("c",)), "b": Req(1, 6, 3, ("c",))})
    hs.run("residual.post", 1, h, r)
    res = hs.drain()
    x = R.stream(h, r)
    rows = {"a": {p: p for p in range(4)}, "b": {6: 4}}
    for name, want in (("a", want_a), ("b", want_b)):
        if not want:
            assert name not in res
            continue
        got = res[name]["c"]["h"]
        assert got["positions"] == want
        torch.testing.assert_close(torch.tensor(got["values"]), x[[rows[name][p] for p in want]])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_drain_rounds_to_the_requests_dtype(dtype):
    hs = Harness(SHAPE, [capture_app()])
    hs.slots["a"] = hs.cb.admit("a", ["c"], {}, 3, parse_options({"dtype": dtype}))
    h, r = stream(3, seed=2)
    hs.step({"a": Req(3, 0, 3, ("c",))})
    hs.run("residual.post", 1, h, r)
    got = hs.drain()["a"]["c"]["h"]
    t = xmix.lang.results_codec.ReadResult.tensors(got)
    want = R.stream(h, r).to({"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    assert t["values"].dtype == want.dtype and torch.equal(t["values"], want)


def test_results_past_the_byte_cap_are_cut_with_a_marker():
    """A budget of 2.5 positions of a probe (JSON: 52 bytes a position): the first step reports
    2 of its 3 positions and the marker; later steps report nothing more."""
    app, _ = probe_app()
    hs = Harness(SHAPE, [app])
    per = position_bytes(ReadShape("scalar", 1), parse_options({}))
    assert per == 52
    opts = parse_options({"max_result_bytes": 130})
    hs.slots["a"] = hs.cb.admit("a", ["k"], {}, 3, opts)
    hs.slots["b"] = hs.cb.admit("b", ["k"], {}, 3)
    h, r = stream(6, seed=4)
    hs.step({"a": Req(3, 0, 3, ("k",)), "b": Req(3, 0, 3, ("k",))})
    hs.run("residual.pre", 0, h, r)
    res = hs.drain()
    assert res["a"]["k"]["p"]["positions"] == [0, 1]
    assert res["a"][TRUNCATED_KEY].startswith("truncated at 130 bytes")
    assert res["b"]["k"]["p"]["positions"] == [0, 1, 2]  # the other request is not affected
    hs.step({"a": Req(1, 3, 3, ("k",)), "b": Req(1, 3, 3, ("k",))})
    hs.run("residual.pre", 0, h[:2].clone(), r[:2].clone())
    res = hs.drain()
    assert "a" not in res and res["b"]["k"]["p"]["positions"] == [3]


def test_staged_read_back_copies_only_the_rows_a_window_lets_through():
    """GPU path (fake stream): with windows, a capture read's rows are gathered on the device
    and only those cross to the host. Request "a" wants its last prompt token, "b" its whole
    prompt, "c" does not use the app: 1 + 3 of 9 rows are copied, and what is reported equals
    the stream there."""
    dev = FakeDevice()
    cb = ControlBlock(SHAPE, "cpu", SMALL, queue=dev)
    cb.install(lower(capture_app(), SHAPE))
    dev.run()
    cb.admit("a", ["c"], {}, 4, parse_options({"positions": [[-1, None]]}))
    cb.admit("b", ["c"], {}, 3)
    cb.admit("c", [], {}, 2)
    h, r = stream(9, seed=5)
    slots = np.array([cb.slots.slot_of[x] for x in "abc"], np.int32)
    cb.begin_step(slots, np.array([4, 3, 2]), np.array([0, 0, 0]), np.array([4, 3, 2]), 9)
    site = site_id("residual.post", 1, SHAPE.n_layers)
    F32 = _C.constants()["DT_F32"]
    dev.launch(lambda: _C.run_site_cpu(cb.ptr, site, h.data_ptr(), r.data_ptr(), 9, D, D, D, F32))
    dev.run()
    dev.take_bytes()
    p = cb.reads.drain_async()
    cb.end_step()
    res = p.result()
    _, d2h = dev.take_bytes()
    R_ = SMALL.max_channels
    assert d2h == 9 * R_ * 4 + 9 * R_ + 4 * D * 4  # results, flags, 4 captured rows
    x = R.stream(h, r)
    assert res["a"]["c"]["h"]["positions"] == [3]
    torch.testing.assert_close(torch.tensor(res["a"]["c"]["h"]["values"]), x[[3]])
    assert res["b"]["c"]["h"]["positions"] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor(res["b"]["c"]["h"]["values"]), x[4:7])
    assert "c" not in res


@pytest.mark.parametrize("kernel", ["reference", "native"])
def test_a_site_that_did_not_run_leaves_no_earlier_results(monkeypatch, kernel):
    """Step 1: "a" reads on rows 0-1. Step 2: "b" (no apps) holds rows 0-1 and "a" row 2, and
    the whole site program fails before any op ran (the Python reference kernel: _C raises;
    the native one: rows that are not contiguous). The flags of step 1 must not be reported
    for "b" (nor anything for "a", which fails)."""
    from xmix.runtime import ops

    app, _ = probe_app()
    hs = Harness(SHAPE, [app])
    h, r = stream(3)
    hs.step({"a": Req(2, 0, 2, ("k",))})
    hs.run("residual.pre", 0, h[:2], r[:2])
    assert hs.drain()["a"]["k"]["p"]["positions"] == [0, 1]
    hs.cb.end_step()

    class Broken:
        def __getattr__(self, name):
            if name == "run_site_cpu":

                def fail(*a):
                    raise MemoryError("no room for scratch rows")

                return fail
            return getattr(ops._C, name)

    hs.step({"b": Req(2, 0, 2, ()), "a": Req(1, 2, 2, ("k",))})
    if kernel == "reference":
        monkeypatch.setattr(ops, "_C", Broken())
        hs.run_reference("residual.pre", 0, h, r)
        monkeypatch.undo()
    else:
        strided = torch.zeros(h.shape[1], h.shape[0]).t()
        hs.run("residual.pre", 0, strided, torch.zeros_like(strided))
    assert hs.drain() == {}
    assert list(hs.cb.take_failed()) == ["a"]


# --------------------------------------------------------------------- the drain's selection
WINDOWS = {  # a window and the same window as a hand-written test on a position
    None: lambda p, plen: True,
    "prompt": lambda p, plen: p < plen,
    "generated": lambda p, plen: p >= plen,
    ((2, 5),): lambda p, plen: 2 <= p < 5,
    ((1, 3), (6, 7)): lambda p, plen: 1 <= p < 3 or p == 6,
}


def test_read_hits_and_its_numpy_twin_find_what_a_per_token_walk_finds():
    """_C.read_hits (an unstaged step's buffers, one pass) and drain.numpy_hits (the staged
    read-back's arrays) against a walk over the step's tokens: which tokens hold a result in
    the channel, their values and positions, each request's first row and where its run of
    hits starts (None when each request has one hit)."""
    from xmix.runtime.control.drain import numpy_hits

    rng = np.random.default_rng(11)
    R_ = 5
    for trial in range(60):
        n_req = int(rng.integers(1, 9))
        per = [int(rng.integers(1, 4)) if trial % 3 else 1 for _ in range(n_req)]  # decode: 1
        rows = np.repeat(np.arange(n_req), per).astype(np.int32)
        n_tok = len(rows)
        pos = rng.integers(0, 1000, n_tok).astype(np.int32)
        res = rng.standard_normal((n_tok, R_)).astype(np.float32)
        valid = (rng.random((n_tok, R_)) < (0.7 if trial % 2 else 1.0)).astype(np.uint8)
        for ch in range(R_):
            toks = [t for t in range(n_tok) if valid[t, ch]]
            firsts, starts = [], []
            for k, t in enumerate(toks):
                if k == 0 or rows[t] != rows[toks[k - 1]]:
                    firsts.append(int(rows[t]))
                    starts.append(k)
            want_bounds = None if len(firsts) == len(toks) else [*starts, len(toks)]
            got_c = _C.read_hits(
                res.ctypes.data,
                valid.ctypes.data,
                pos.ctypes.data,
                rows.ctypes.data,
                n_tok,
                R_,
                ch,
            )
            got_np = numpy_hits(valid, rows, pos, ch)
            for idx, vals, p, pl, f, b in (got_c, got_np):
                assert idx.tolist() == toks
                assert p.tolist() == pl == [int(pos[t]) for t in toks]
                assert f == firsts and b == want_bounds
                if vals is not None:  # read_hits: the channel's values, as stored
                    assert vals.tolist() == [float(res[t, ch]) for t in toks]
    with pytest.raises(IndexError, match="channel 5 of 5"):
        _C.read_hits(0, 0, 0, 0, 0, 5, 5)


def test_collect_reports_what_a_per_token_walk_reports():
    """drain.collect over random steps (requests missing, preempted requests recomputing
    positions they reported, windows, byte caps) against a walk over the step's tokens one
    at a time, in plain Python: each request reports a position once, inside its window,
    while its bytes fit, and the step it runs out carries the marker. Every other trial
    packed (the engine worker's form)."""
    from xmix.lang.results_codec import read_shape, unpack_results
    from xmix.runtime.control.drain import PlannedRead, collect
    from xmix.runtime.control.slots import SlotState

    app, _ = probe_app()
    op = lower(app, SHAPE).reads["p"]
    shape = read_shape(op)
    per = position_bytes(shape, parse_options({}))
    plan = [PlannedRead("k", "p", 2, None, op, shape)]
    rng = np.random.default_rng(7)
    for trial in range(40):
        n_req = int(rng.integers(1, 7))
        specs = [list(WINDOWS)[int(rng.integers(len(WINDOWS)))] for _ in range(n_req)]
        caps = [None if rng.random() < 0.5 else int(rng.integers(0, 12)) * per + 7 for _ in specs]
        plens = [int(rng.integers(1, 6)) for _ in specs]
        states = []
        for i in range(n_req):
            spec = specs[i]
            raw = (
                {}
                if spec is None
                else {"positions": spec if isinstance(spec, str) else [list(x) for x in spec]}
            )
            if caps[i] is not None:
                raw["max_result_bytes"] = caps[i]
            states.append(SlotState(f"r{i}", {"k"}, {}, plens[i], options=parse_options(raw)))
        # the walk's own record per request: last position reported, bytes, truncated
        ref = [{"done": -1, "spent": 0, "cut": False} for _ in states]
        nxt = [0] * n_req
        got_all: dict = {}
        want_all: dict = {}
        for _step in range(6):
            rows, pos = [], []
            for i in range(n_req):
                if rng.random() < 0.25:
                    continue  # not in this step
                if rng.random() < 0.2:
                    nxt[i] = max(0, nxt[i] - int(rng.integers(1, 4)))  # preempted: recomputes
                k = int(rng.integers(1, 5))
                rows += [i] * k
                pos += list(range(nxt[i], nxt[i] + k))
                nxt[i] += k
            if not rows:
                continue
            n = len(rows)
            res = rng.standard_normal((n, 4)).astype(np.float32)
            valid = (rng.random((n, 4)) < 0.85).astype(np.uint8)
            gone = {i for i in set(rows) if rng.random() < 0.1}  # no state: left out
            out = collect(
                res,
                valid,
                np.asarray(pos, dtype=np.int32),
                np.asarray(rows, dtype=np.int64),
                [None if row in gone else st for row, st in enumerate(states)],
                plan,
                lambda cap, idx: None,
                packed=trial % 2 == 1,  # the engine worker's form: bytes, unpacked here
            )
            if trial % 2:
                out = {rid: unpack_results(apps) for rid, apps in out.items()}
            for rid, apps in out.items():
                g = got_all.setdefault(rid, {"p": [], "v": [], "marks": 0})
                if "k" in apps:
                    g["p"] += apps["k"]["p"].positions.tolist()
                    g["v"] += apps["k"]["p"].values.tolist()
                g["marks"] += TRUNCATED_KEY in apps
            # the walk
            for i in sorted(set(rows), key=rows.index):
                if i in gone:
                    continue
                toks = [t for t in range(n) if rows[t] == i and valid[t, 2]]
                toks = [t for t in toks if pos[t] > ref[i]["done"]]
                if not toks:
                    continue
                ref[i]["done"] = pos[toks[-1]]
                if ref[i]["cut"]:
                    continue
                w = WINDOWS[specs[i]]
                toks = [t for t in toks if w(pos[t], plens[i])]
                budget = caps[i] if caps[i] is not None else 1 << 60
                want = want_all.setdefault(f"r{i}", {"p": [], "v": [], "marks": 0})
                for t in toks:
                    if ref[i]["spent"] + per > budget:
                        ref[i]["cut"] = True
                        want["marks"] += 1
                        break
                    ref[i]["spent"] += per
                    want["p"].append(pos[t])
                    want["v"].append(float(res[t, 2]))
        want_all = {k: v for k, v in want_all.items() if v["p"] or v["marks"]}
        assert got_all == want_all, f"trial {trial}"
